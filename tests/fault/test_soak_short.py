"""`make soak`'s driver (bench/soak.py), short: a supervised 2 prefill + 2 decode cluster
(real processes and etcd) under mixed HTTP / SSE / gRPC unary / gRPC stream load for
about a minute, with a SIGKILL of a decode node, a SIGTERM (drain) of a prefill node and
a SIGKILL of a prefill node, each waited out until the node serves again. No request
fails, and every greedy text equals the undisturbed single-node run's (float32)."""

from __future__ import annotations

import pytest

from bench.soak import SoakOptions, run_soak

pytestmark = pytest.mark.timeout(600)


def test_short_soak_with_kills_and_a_drain_loses_nothing(tmp_path):
    report = run_soak(SoakOptions(
        minutes=1.0, seed=7, out=tmp_path, concurrency=4, pool_size=32,
        schedule=["sigkill-decode", "sigterm-prefill", "sigkill-prefill"],
        first_fault_s=8.0, gap_s=(3.0, 6.0), warmup_s=20.0))
    summary = (tmp_path / "soak.md").read_text()
    assert not report["fatal"], summary
    assert [f["kind"] for f in report["faults"]] == ["sigkill-decode", "sigterm-prefill",
                                                      "sigkill-prefill"], summary
    for fault in report["faults"]:
        assert fault["error"] is None and fault["recovered_after"] is not None, summary
    requests = report["requests"]
    assert requests["total"] >= 50, summary
    assert set(requests["by_via"]) == {"http", "http-stream", "grpc", "grpc-stream"}, summary
    assert requests["failed"] == 0, summary
    assert requests["mismatched"] == 0, summary
    assert report["supervisor_restart_s"], summary          # the kills were restarts
