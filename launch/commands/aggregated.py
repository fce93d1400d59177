"""`pdserve aggregated`: an aggregated node, which prefills and decodes by itself (no KV
push): gRPC server (the DecodeNode service, health, reflection), engine loop in its own
thread, registration in etcd under /pdserve/<cluster>/nodes/aggregated/<node_id>. Routers
send it whole requests (Decode with self_prefill) alongside or instead of prefill/decode
pairs. SIGTERM drains: deregister, finish what is in flight, exit."""

from __future__ import annotations

import argparse

from launch.commands.node_options import add_node_arguments

HELP = "run an aggregated node (prefill and decode on one node)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_arguments(parser, "aggregated", default_port=50081)


def run(args: argparse.Namespace) -> int:
    from launch.node_main import run_node

    return run_node("aggregated", args)
