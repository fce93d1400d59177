"""Rendered overlays, once per session (kubectl kustomize takes ~0.3 s each)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.deploy.manifests import K8S, OVERLAYS, render

EXTERNAL_ETCD = "etcd-a.example:2379,etcd-b.example:2379"


def write_external_etcd_overlay(folder: Path) -> Path:
    """An overlay as a user would write it: cpu-dev + the external-etcd component."""
    rel = os.path.relpath(K8S, folder)   # kustomize refuses absolute paths
    (folder / "kustomization.yaml").write_text(f"""\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [{rel}/overlays/cpu-dev]
components: [{rel}/components/external-etcd]
configMapGenerator:
- name: pdserve-cluster
  behavior: merge
  literals: ["PDSERVE_ETCD={EXTERNAL_ETCD}"]
""")
    return folder


def write_cluster_tls_overlay(folder: Path) -> Path:
    """cpu-dev + the cluster-tls component (mutual TLS from the pdserve-tls Secret)."""
    rel = os.path.relpath(K8S, folder)
    (folder / "kustomization.yaml").write_text(f"""\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [{rel}/overlays/cpu-dev]
components: [{rel}/components/cluster-tls]
""")
    return folder


@pytest.fixture(scope="session")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """name -> rendered objects, for the base, every overlay and the external-etcd setup."""
    out = {"base": render(K8S / "base")}
    for name in OVERLAYS:
        out[name] = render(K8S / "overlays" / name)
    out["external-etcd"] = render(write_external_etcd_overlay(tmp_path_factory.mktemp("ext")))
    out["cluster-tls"] = render(write_cluster_tls_overlay(tmp_path_factory.mktemp("tls")))
    return out


RENDERED_NAMES = ("base", *OVERLAYS, "external-etcd", "cluster-tls")
