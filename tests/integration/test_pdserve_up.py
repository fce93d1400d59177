"""`pdserve up` as a user runs it: starts etcd, nodes and a router, prints the endpoints and
a curl example, serves the printed endpoint, and on Ctrl-C (SIGINT) stops all it started."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from launch.etcd_server import free_port
from tests.integration.router_harness import MODEL, Req, reference, tiny_model_folder

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _plaintext_health_fails(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=5.0)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNAVAILABLE
    return False


def test_pdserve_up_serves_and_stops_everything_on_ctrl_c(tmp_path):
    from engine import LLM

    folder = tiny_model_folder(tmp_path / "models")
    http_port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "up", "--model", str(folder), "--prefill", "1",
         "--decode", "1", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
         "--dtype", "float32", "--max-num-seqs", "4"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        out = "".join(lines)
        assert "Ctrl-C stops everything" in out, out
        assert f"http://127.0.0.1:{http_port}/v1" in out
        assert f"gRPC API:        127.0.0.1:{grpc_port}" in out
        curl = re.search(r"curl -s (\S+) .*?-d '(.+?)'", out, re.S)
        assert curl is not None, out
        run_dir = re.search(r"logs:\s+(\S+)", out).group(1)

        # the printed curl example works as printed (model name, path, body)
        url, body = curl.group(1), json.loads(curl.group(2))
        assert body["model"] == MODEL
        body["temperature"] = 0           # the example samples; greedy to compare exactly
        req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
        want = reference(LLM(folder, dtype="float32"),
                         Req("http", messages=body["messages"], max_tokens=body["max_tokens"]))
        assert answer["choices"][0]["message"]["content"] == want[1]
        assert len(_processes_mentioning(run_dir)) >= 3      # etcd, 2 nodes, router
        # ... and it was served over mutual TLS, the default: every node and the router run
        # with their own certificate, and a node's gRPC port refuses a plaintext client
        assert "node links:      mutual TLS" in out
        tls_dir = Path(run_dir) / "tls"
        for name in ("prefill-0", "decode-0", "router"):
            assert _processes_mentioning(str(tls_dir / f"{name}.crt")), name
        node = (Path(run_dir) / "decode-0.ready").read_text().strip()
        assert _plaintext_health_fails(node)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, rest
    assert "stopped." in rest
    assert _processes_mentioning(run_dir) == []
