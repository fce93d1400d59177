"""Fault tests: the integration fixtures (a real etcd on loopback, node processes)."""

from tests.integration.conftest import etcd, folder, llm, start_node  # noqa: F401
