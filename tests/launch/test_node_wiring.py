"""launch/node_main.py wires the CLI flags into the nodes: the prefill node's decode gate
(etcd: the registered decode nodes; no etcd: --allowed-decode, else it refuses to start),
the decode node's lease ceiling and data-plane limits, and the cluster TLS files."""

from __future__ import annotations

import pytest

from cluster.kv_transfer.limits import TcpLimits
from cluster.tls import TlsConfig, write_cluster_certs
from launch.cli import build_parser
from launch.cli_common import CliError
from launch.node_main import build_node, decode_gate
from prefill_node.decode_gate import DiscoveryDecodeGate, StaticDecodeGate
from tests.tiny_models import make_tiny_model


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_prefill_gate_follows_etcd_or_the_static_list():
    gate = decode_gate(parse("prefill", "--etcd", "127.0.0.1:2379"))
    assert isinstance(gate, DiscoveryDecodeGate) and gate.close_registry
    gate = decode_gate(parse("prefill", "--etcd", "none",
                             "--allowed-decode", "10.0.0.1:50071, 10.0.0.2:50071"))
    assert isinstance(gate, StaticDecodeGate)
    assert gate.allows("10.0.0.2:50071") and not gate.allows("10.0.0.3:50071")
    with pytest.raises(CliError, match="--allowed-decode"):
        decode_gate(parse("prefill", "--etcd", "none"))


def test_allowed_decode_from_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_ALLOWED_DECODE", "10.0.0.9:1")
    gate = decode_gate(parse("prefill", "--etcd", "none"))
    assert gate.allows("10.0.0.9:1") and not gate.allows("10.0.0.1:50071")


def test_decode_flags_reach_the_node(tmp_path):
    folder = make_tiny_model("qwen3-qknorm-hd24", tmp_path / "models")[0]
    tls = write_cluster_certs(tmp_path / "tls", ["decode"])["decode"]
    args = parse("decode", "--model", str(folder), "--etcd", "none", "--dtype", "float32",
                 "--num-gpu-blocks", "16", "--lease-s", "10", "--max-lease-s", "60",
                 "--kv-tcp-max-connections", "3", "--kv-tcp-header-timeout", "2",
                 "--kv-tcp-idle-timeout", "7", "--tls-ca", tls.ca, "--tls-cert", tls.cert,
                 "--tls-key", tls.key, "--max-grpc-pushes", "5")
    node = build_node("decode", args, "d0")
    assert node.receiver.max_lease_s == 60.0
    assert node.kv_tcp_limits == TcpLimits(max_connections=3, header_timeout_s=2.0,
                                           idle_timeout_s=7.0)
    assert node.tls == TlsConfig(ca=tls.ca, cert=tls.cert, key=tls.key)
    assert node.service.max_grpc_pushes == 5


def test_tls_flags_must_come_together(tmp_path):
    tls = write_cluster_certs(tmp_path / "tls", ["decode"])["decode"]
    args = parse("decode", "--model", "/nonexistent", "--etcd", "none", "--tls-ca", tls.ca)
    with pytest.raises(CliError, match="--tls-cert, --tls-key"):
        build_node("decode", args, "d0")


def test_pdserve_certs_makes_leaves_that_a_second_run_can_sign_with_the_same_ca(tmp_path):
    from cryptography import x509

    from launch.cli import main

    assert main(["certs", "--out", str(tmp_path / "a"), "--name", "decode"]) == 0
    assert main(["certs", "--out", str(tmp_path / "b"), "--name", "router", "--ca-cert",
                 str(tmp_path / "a" / "ca.crt"), "--ca-key", str(tmp_path / "a" / "ca.key")]) == 0
    ca = x509.load_pem_x509_certificate((tmp_path / "a" / "ca.crt").read_bytes())
    leaf = x509.load_pem_x509_certificate((tmp_path / "b" / "router.crt").read_bytes())
    leaf.verify_directly_issued_by(ca)          # raises when another CA signed it
    assert (tmp_path / "b" / "router.key").stat().st_mode & 0o077 == 0
    TlsConfig(str(tmp_path / "a" / "ca.crt"), str(tmp_path / "b" / "router.crt"),
              str(tmp_path / "b" / "router.key")).server_context()
    assert main(["certs", "--out", str(tmp_path / "c"), "--ca-cert", "x"]) == 2
