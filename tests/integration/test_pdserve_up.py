"""`pdserve up` as a user runs it: starts etcd, nodes and a router, prints the endpoints and
a curl example, serves the printed endpoint, and on Ctrl-C (SIGINT) stops all it started.
Secure as a user would run it: an API key (PDSERVE_API_KEY) and mutual TLS inside (the
default); the openai client and `pdserve generate` work against it with the key."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from launch.etcd_server import free_port
from tests.integration.router_harness import MODEL, Req, reference, tiny_model_folder

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
KEY = "up-test-key-7c1d"


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


def _banner(proc: subprocess.Popen, timeout: float = 180) -> str:
    """What `pdserve up` printed up to its "Ctrl-C stops everything" line (or until it
    exited or the time ran out)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Ctrl-C stops everything" in line:
            break
    return "".join(lines)


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
    proc, http_port, grpc_port = _start_up(folder, "--prefill", "1", "--decode", "1", key=KEY)
    env = _up_env(KEY)
    try:
        out = _banner(proc)
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
        assert '-H "Authorization: Bearer $PDSERVE_API_KEY"' in out and KEY not in out
        assert "API key:         required" in out
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
        with pytest.raises(urllib.error.HTTPError) as denied:      # no key: 401
            urllib.request.urlopen(req, timeout=60)
        assert denied.value.code == 401
        req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={**headers, "Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
        llm = LLM(folder, dtype="float32")
        want = reference(llm, Req("http", messages=body["messages"],
                                  max_tokens=body["max_tokens"]))
        assert answer["choices"][0]["message"]["content"] == want[1]

        # the openai client with the key, streaming
        from openai import OpenAI
        client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEY)
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, stream=True, max_tokens=body["max_tokens"], temperature=0,
            messages=body["messages"]))
        assert text == want[1]
        # `pdserve generate` as printed (it reads PDSERVE_API_KEY), greedy
        gen = subprocess.run(
            [sys.executable, "-m", "launch.cli", "generate", "--router",
             f"127.0.0.1:{grpc_port}", "--max-tokens", "8", "--temperature", "0",
             "The capital of France is"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0, gen.stderr
        want_gen = reference(llm, Req("grpc", "The capital of France is", 8))
        assert want_gen[1] and want_gen[1] in gen.stdout, (gen.stdout, want_gen)
        assert len(_processes_mentioning(run_dir)) >= 3      # etcd, 2 nodes, router
        # ... and it was served over mutual TLS, the default: every node and the router run
        # with their own certificate, and a node's gRPC port refuses a plaintext client
        assert "node links:      mutual TLS" in out
        tls_dir = Path(run_dir) / "tls"
        for name in ("prefill-0", "decode-0", "router"):
            assert _processes_mentioning(str(tls_dir / f"{name}.crt")), name
        node = (Path(run_dir) / "decode-0.ready").read_text().strip()
        assert _plaintext_health_fails(node)
        # etcd too: https only with client certificates required, and every process dials
        # it with its own leaf (the request above went through nodes found that way)
        (etcd_pid,) = _processes_mentioning(str(tls_dir / "etcd.crt"))
        etcd_cmd = Path(f"/proc/{etcd_pid}/cmdline").read_bytes().split(b"\0")
        assert b"--client-cert-auth" in etcd_cmd
        url = etcd_cmd[etcd_cmd.index(b"--listen-client-urls") + 1].decode()
        assert url.startswith("https://")
        for name in ("prefill-0", "decode-0", "router"):
            assert _processes_mentioning(f"--etcd-cert\0{tls_dir / name}.crt"), name
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, rest
    assert "stopped." in rest
    assert _processes_mentioning(run_dir) == []


def _up_env(key: str | None = None) -> dict[str, str]:
    """This checkout on the path, and `key` (or no key) as PDSERVE_API_KEY."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PDSERVE_API_KEY", None)
    return env if key is None else {**env, "PDSERVE_API_KEY": key}


def _start_up(folder, *flags: str, key: str | None = None
              ) -> tuple[subprocess.Popen, int, int]:
    """`pdserve up --model folder` in float32 at 4 sequences, on free ports, with `flags`
    and the API key `key` (none by default); (process, HTTP port, gRPC port)."""
    http_port, grpc_port = free_port(), free_port()
    env = _up_env(key)
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "up", "--model", str(folder), "--http-port",
         str(http_port), "--grpc-port", str(grpc_port), "--dtype", "float32",
         "--max-num-seqs", "4", *flags],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, http_port, grpc_port


def test_pdserve_up_aggregated_starts_one_aggregated_node_and_waits_for_health(tmp_path):
    """`pdserve up --aggregated`: etcd, one aggregated node and the router, no prefill or
    decode node; the banner comes only once the router's /health is 200, so the first
    request after it is served."""
    from engine import LLM

    folder = tiny_model_folder(tmp_path / "models")
    proc, http_port, _ = _start_up(folder, "--aggregated", "--insecure")
    try:
        out = _banner(proc)
        assert "pdserve is up: 1 aggregated node(s)" in out, out
        assert "prefill" not in out.split("pdserve is up:")[1].splitlines()[0]
        run_dir = Path(re.search(r"logs:\s+(\S+)", out).group(1))
        assert sorted(p.name for p in run_dir.glob("*.ready")) == ["aggregated-0.ready",
                                                                  "router.ready"]
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as r:
            assert r.status == 200
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
                "temperature": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
        want = reference(LLM(folder, dtype="float32"), Req("http", body["prompt"], 8))
        assert answer["choices"][0]["text"] == want[1]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, rest
    assert "stopped." in rest
    assert _processes_mentioning(str(run_dir)) == []


@pytest.mark.parametrize("name,transport,mtp,tp", [("deepseek-v3-mla", "tcp", True, 1),
                                                   ("deepseek-v3-mla", "grpc", False, 1),
                                                   ("qwen3-moe-e8k2", "grpc", False, 1),
                                                   ("qwen3-moe-e8k2", "tcp", False, 2)])
def test_pdserve_up_serves_the_moe_models_over_http_and_grpc(tmp_path, name, transport, mtp,
                                                             tp):
    """`pdserve up --model DIR` on a DeepSeek-V3 folder (MLA with its latent cache,
    DeepSeekMoE, with its own MTP layer drafting on the decode node) and on Qwen3-MoE (also
    with both nodes split over 2 tensor/expert-parallel ranks each): PD over mutual TLS,
    the KV pushed between real processes over the raw-TCP data plane or gRPC; greedy text
    over HTTP and gRPC equals the single-node engine's."""
    from engine import LLM
    from tests.tiny_mtp import with_mtp

    folder = tiny_model_folder(tmp_path / "models", name)
    extra = []
    if mtp:
        folder = with_mtp(folder, tmp_path / "models" / f"{name}-mtp")
        extra = ["--speculative-method", "mtp"]
    proc, http_port, grpc_port = _start_up(
        folder, "--kv-transport", transport, "--tensor-parallel-size", str(tp),
        "--expert-parallel-size", str(tp), *extra)
    try:
        out = _banner(proc)
        assert "pdserve is up: 1 prefill + 1 decode node(s)" in out, out
        assert "node links:      mutual TLS" in out
        run_dir = Path(re.search(r"logs:\s+(\S+)", out).group(1))
        llm = LLM(folder, dtype="float32")
        prompt = "The capital of France is"
        body = {"model": folder.name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
        want = reference(llm, Req("http", prompt, 12))
        assert want[1] and answer["choices"][0]["text"] == want[1]
        gen = subprocess.run(
            [sys.executable, "-m", "launch.cli", "generate", "--router",
             f"127.0.0.1:{grpc_port}", "--max-tokens", "12", "--temperature", "0", prompt],
            cwd=ROOT, env=_up_env(), capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0, gen.stderr
        assert want[1] in gen.stdout, (gen.stdout, want)
        decode_log = (run_dir / "decode-0.log").read_text()
        assert "KV complete" in decode_log          # the prompt's KV came by push
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, rest
    assert "stopped." in rest


def _children_of(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        kids = []
        for t in tasks:
            kids += [int(c) for c in (t / "children").read_text().split()]
        return kids
    except OSError:
        return []


def test_pdserve_up_aggregated_with_tensor_parallel_serves_and_survives_a_lost_rank(tmp_path):
    """`pdserve up --aggregated --tensor-parallel-size 2`: the aggregated node runs rank 1
    in a child process; greedy text equals a single node's. Killing that rank makes the
    node exit (it cannot compute without it; its lease ends, so it leaves discovery), and
    `up` starts it again, serving the same text."""
    from engine import LLM

    folder = tiny_model_folder(tmp_path / "models")
    proc, http_port, _ = _start_up(folder, "--aggregated", "--insecure",
                                   "--tensor-parallel-size", "2")
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}

    def complete() -> str:
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())["choices"][0]["text"]
    try:
        out = _banner(proc)
        assert "pdserve is up: 1 aggregated node(s)" in out, out
        run_dir = Path(re.search(r"logs:\s+(\S+)", out).group(1))
        want = reference(LLM(folder, dtype="float32"), Req("http", body["prompt"], 8))
        assert complete() == want[1]
        node_log = run_dir / "aggregated-0.log"
        assert "tensor parallel: 2 ranks on gloo" in node_log.read_text()
        (node,) = [p for p in _processes_mentioning(str(run_dir))     # `pdserve aggregated`
                   if b"launch.cli\0aggregated\0" in Path(f"/proc/{p}/cmdline").read_bytes()]
        (rank,) = [c for c in _children_of(node)      # not multiprocessing's own helper
                   if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        os.kill(rank, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{node}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/proc/{node}").exists(), "the node outlived its lost rank"
        assert "the group cannot go on: the node exits" in node_log.read_text()
        deadline = time.monotonic() + 120          # up restarts it; the router finds it
        while True:
            try:
                assert complete() == want[1]
                break
            except urllib.error.HTTPError:
                assert time.monotonic() < deadline, "the node did not come back"
                time.sleep(1)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, rest
    assert _processes_mentioning(str(run_dir)) == []
