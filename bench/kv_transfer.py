"""KV transfer benchmarks for PD PUSH mode, each against a peer measured in the same run.

    python bench/kv_transfer.py [--model DIR] [--prompt-len 2048] [--repeats 3] [--quick]

1. Push bandwidth over loopback. A real decode node (`pdserve decode`, own process)
   reserves the blocks of a --prompt-len prompt; the bench pushes that prompt's whole KV
   (random bytes of the right shape: every layer's K and V for every block) through the
   default gRPC transport (DecodeNode.PushKv: header, raw-bytes chunks, done), so the
   decode node validates every chunk and writes it into its cache. Peer: a raw TCP socket
   moving the same number of bytes, in the same chunk size, to a receiver process that
   reads them into a buffer. Reported: GB/s of both and the ratio (target >= 50%).
   With TLS: a second decode node started with the cluster's mutual TLS (a throw-away CA
   made in the run's folder), the same pushes over TLS, and the cost of TLS on each
   transport (target: the TCP data plane loses at most 20%).
2. Time to first token of a --prompt-len prompt. PD: the bench drives a prefill node and a
   decode node (both real processes) with the router's PdBackend over a static pool
   (Decode -> reservation -> Prefill, layer-wise push, first token streamed by the decode
   node). Peer: the same model and
   engine options on a single node (an LLMEngine in this process, prefill + first token).
   Reported: medians and the PD / single-node ratio (target <= 1.2x).
Default model: SmolLM2-135M-Instruct (the prepared default), float32 on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHUNK = 4 << 20


# ---- node processes -----------------------------------------------------------------------
def start_node(role: str, model: str, opts: list[str], tmp: Path,
               name: str | None = None) -> tuple[subprocess.Popen, str]:
    from launch.etcd_server import free_port
    port = free_port()
    name = name or role
    ready = tmp / f"{name}.ready"
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", role, "--listen",
                             f"127.0.0.1:{port}", "--etcd", "none", "--ready-file", str(ready),
                             "--model", model, *opts], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} node failed: {(tmp / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, ready.read_text().strip()


def tls_flags(tls) -> list[str]:
    return ["--tls-ca", tls.ca, "--tls-cert", tls.cert, "--tls-key", tls.key]


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- 1a: raw TCP peer ---------------------------------------------------------------------
RECEIVER = r"""
import socket, sys
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
buf = bytearray(1 << 22); view = memoryview(buf)
while True:
    conn, _ = srv.accept()
    header = conn.recv(16)
    if not header: break
    total = int(header.decode()); got = 0
    while got < total:
        n = conn.recv_into(view, min(len(buf), total - got))
        if n == 0: break
        got += n
    conn.sendall(b"k"); conn.close()
"""


def raw_tcp_seconds(payload: list[bytes], repeats: int) -> list[float]:
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE)
    port = int(proc.stdout.readline())
    total = sum(len(p) for p in payload)
    times = []
    try:
        for _ in range(repeats):
            with socket.create_connection(("127.0.0.1", port)) as s:
                t0 = time.perf_counter()
                s.sendall(f"{total:16d}".encode())
                for part in payload:
                    s.sendall(part)
                assert s.recv(1) == b"k"
                times.append(time.perf_counter() - t0)
    finally:
        with socket.create_connection(("127.0.0.1", port)):
            pass                                   # empty header: the receiver exits
        proc.wait(10)
    return times


# ---- 1b: push into a real decode node through a KvTransport ------------------------------
async def _aiter(items):
    for item in items:
        yield item


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) of this process plus process `pid`: the
    sender's and the receiver's work together, which machine load does not stretch."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return time.process_time() + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def push_seconds(decode_addr: str, prompt: list[int], repeats: int, transport_name: str,
                       tls=None, pid: int | None = None):
    """Times KvTransport.push of a whole prompt's KV (random bytes) into a real decode
    node: its reservation, validation and cache writes included. tls: a TlsConfig for a
    decode node started with mutual TLS. pid: the decode node's, to count CPU seconds."""
    import torch

    from cluster.kv_transfer.base import GRPC_OPTIONS
    from cluster.kv_transfer.codec import layer_chunk_parts, tensor_bytes, tensor_view
    from cluster.kv_transfer.grpc_transport import GrpcTransport, open_channel
    from cluster.kv_transfer.tcp_transport import TcpTransport
    from cluster.proto_convert import fingerprint_from_proto, sampling_to_proto
    from engine.sampling_params import SamplingParams
    from protos import node_pb2, node_pb2_grpc

    grpc_transport = GrpcTransport(tls=tls)
    transport = TcpTransport(grpc_transport) if transport_name == "tcp" else grpc_transport
    async with open_channel(decode_addr, tls, GRPC_OPTIONS) as ch:
        stub = node_pb2_grpc.DecodeNodeStub(ch)
        times, cpus, nbytes, payload = [], [], 0, None
        for r in range(repeats + 1):                      # the first run warms up
            call = stub.Decode(node_pb2.ReserveRequest(
                request_id=f"bw-{transport_name}-{r}", prompt_token_ids=prompt,
                sampling=sampling_to_proto(SamplingParams(max_tokens=1, temperature=0.0))))
            res = (await anext(aiter(call))).reservation
            fp = fingerprint_from_proto(res.fingerprint)
            ids = list(res.block_ids)[res.num_cached_blocks:]
            layer_kv = torch.randn(len(ids), fp.block_size, fp.num_kv_heads, fp.head_dim,
                                   dtype=torch.float32).to(getattr(torch, fp.dtype))
            parts = [p for layer in range(fp.num_layers)
                     for p in layer_chunk_parts(layer, ids, layer_kv, layer_kv, fp.dtype, CHUNK)]
            items = [node_pb2.KvPushMessage(header=node_pb2.PushHeader(
                request_id=call_id(transport_name, r), reservation_id=res.reservation_id,
                fingerprint=res.fingerprint, block_ids=ids, push_token=res.push_token))]
            if transport_name == "tcp":       # what PushSender yields for a raw transport
                items += [(node_pb2.KvPushMessage(chunk=m), tensor_view(t)) for m, t in parts]
            else:
                for m, t in parts:
                    m.data = tensor_bytes(t)
                items += [node_pb2.KvPushMessage(chunk=m) for m, _ in parts]
            items.append(node_pb2.KvPushMessage(done=node_pb2.PushDone(
                first_token_id=1, num_chunks=len(parts))))
            c0 = cpu_seconds(pid) if pid else 0.0
            t0 = time.perf_counter()
            ack = await transport.push(decode_addr, _aiter(items))
            dt = time.perf_counter() - t0
            cpu = cpu_seconds(pid) - c0 if pid else 0.0
            async for _ in call:                          # the 1-token request finishes
                pass
            if r:
                times.append(dt)
                cpus.append(cpu)
            nbytes = ack.bytes_received
            payload = [tensor_bytes(t) for _, t in parts]
    await transport.close()
    return times, cpus, nbytes, payload


def call_id(transport_name: str, r: int) -> str:
    return f"bw-{transport_name}-{r}"


# ---- 2: TTFT ------------------------------------------------------------------------------
class SingleNode:
    """The peer: the same model and engine options, prefill + first token in one engine."""

    def __init__(self, model: str, engine_opts: dict):
        from engine.config import EngineConfig
        from engine.engine_core import LLMEngine

        self.engine = LLMEngine(EngineConfig(model=model, enable_prefix_caching=False,
                                             **engine_opts))
        self.n = 0

    def ttft(self, prompt: list[int]) -> float:
        from engine.sampling_params import SamplingParams

        self.n += 1
        rid = f"s{self.n}"
        t0 = time.perf_counter()
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while not self.engine.step():
            pass
        dt = time.perf_counter() - t0
        self.engine.release(rid)
        return dt


async def ttft_pairs(prefill_addr: str, decode_addr: str, single: SingleNode,
                     prompts: list[list[int]]) -> tuple[list[float], list[float]]:
    """PD and single-node runs interleaved (same prompts, same moments), so load from
    other processes on the machine hits both alike. The first pair warms up."""
    from engine.sampling_params import SamplingParams
    from router.backend import NodeRequest
    from router.static_pool import static_backend

    backend = static_backend([prefill_addr], [decode_addr], max_model_len=1 << 30,
                             max_attempts=1)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    pd, one = [], []
    try:
        for r, prompt in enumerate(prompts):
            t0, t_pd = time.perf_counter(), 0.0
            async for step in backend.generate(NodeRequest(f"pd-{r}", prompt, params)):
                if step.token_ids and not t_pd:        # max_tokens=1: also the last step
                    t_pd = time.perf_counter() - t0
            t_single = await asyncio.to_thread(single.ttft, prompt)
            if r:
                pd.append(t_pd)
                one.append(t_single)
    finally:
        await backend.close()
    return pd, one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="512-token prompt, 2 repeats")
    ap.add_argument("--skip-ttft", action="store_true", help="push bandwidth only")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of alternating pushes (each: --repeats per kind)")
    ap.add_argument("--kv-transport", default="grpc", choices=["grpc", "tcp"],
                    help="the prefill node's transport in the TTFT part")
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.repeats = 512, 2
    import random

    from bench.common import machine_facts
    model = args.model
    if model is None:
        from launch.default_model import prepare_default_model
        model = str(prepare_default_model(progress=True))
    print("machine:", machine_facts())
    engine_opts = dict(dtype=args.dtype, block_size=16, max_num_batched_tokens=max(
        2048, args.prompt_len), max_num_seqs=8, kv_cache_memory_gb=2.0)
    opts = ["--dtype", args.dtype, "--block-size", "16", "--max-num-batched-tokens",
            str(engine_opts["max_num_batched_tokens"]), "--max-num-seqs", "8",
            "--kv-cache-memory-gb", "2", "--no-prefix-caching"]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_len)]
               for _ in range(args.repeats + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        from cluster.tls import write_cluster_certs
        tls = write_cluster_certs(Path(tmp) / "tls", ["decode", "bench"])
        decode, d_addr = start_node("decode", model, opts, Path(tmp))
        decode_tls, d_tls_addr = start_node("decode", model, [*opts, *tls_flags(tls["decode"])],
                                            Path(tmp), name="decode-tls")
        prefill = None
        try:
            runs, cpus = {}, {}
            for _ in range(args.rounds):          # alternate, so machine load hits all alike
                for name in ("grpc", "tcp"):
                    t, c, nbytes, payload = asyncio.run(push_seconds(
                        d_addr, prompts[0], args.repeats, name, pid=decode.pid))
                    runs.setdefault(name, []).extend(t)
                    cpus.setdefault(name, []).extend(c)
                    t, c, _, _ = asyncio.run(push_seconds(d_tls_addr, prompts[0], args.repeats,
                                                          name, tls=tls["bench"],
                                                          pid=decode_tls.pid))
                    runs.setdefault(f"{name}-tls", []).extend(t)
                    cpus.setdefault(f"{name}-tls", []).extend(c)
                runs.setdefault("raw", []).extend(raw_tcp_seconds(payload, args.repeats))
            best = {k: nbytes / min(v) / 1e9 for k, v in runs.items()}

            def med(a: str, b: str) -> float:       # throughput ratio a / b of the medians
                return statistics.median(runs[b]) / statistics.median(runs[a])
            print(f"\nKV push of a {args.prompt_len}-token prompt: {nbytes / 1e6:.1f} MB in "
                  f"{len(payload)} chunks of <= {CHUNK >> 20} MiB, {len(runs['raw'])} runs each")
            for key, label in (("grpc", "gRPC push (default transport)"),
                               ("tcp", "TCP data-plane push (--kv-transport tcp)"),
                               ("raw", "raw TCP socket, same bytes (peer)")):
                print(f"  {label:42s} best {min(runs[key]) * 1e3:7.1f} ms = {best[key]:5.2f} "
                      f"GB/s (median {statistics.median(runs[key]) * 1e3:.1f} ms)")
            print(f"  ratio gRPC push / raw TCP: {best['grpc'] / best['raw']:.0%}; TCP data-plane "
                  f"push / raw TCP: {best['tcp'] / best['raw']:.0%} (target >= 50%)")
            for key, label in (("grpc-tls", "gRPC push, mutual TLS"),
                               ("tcp-tls", "TCP data-plane push, mutual TLS")):
                print(f"  {label:42s} best {min(runs[key]) * 1e3:7.1f} ms = {best[key]:5.2f} "
                      f"GB/s (median {statistics.median(runs[key]) * 1e3:.1f} ms)")
            print(f"  cost of TLS (best vs best): gRPC {1 - best['grpc-tls'] / best['grpc']:.0%},"
                  f" TCP data plane {1 - best['tcp-tls'] / best['tcp']:.0%} (target <= 20%); "
                  f"medians: gRPC {1 - med('grpc-tls', 'grpc'):.0%}, "
                  f"TCP {1 - med('tcp-tls', 'tcp'):.0%}")
            cpu = {k: statistics.median(v) for k, v in cpus.items()}
            print("  CPU seconds per push, sender + decode node (median; load does not stretch "
                  "these): " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in cpu.items()))
            print(f"  CPU added by TLS: gRPC +{cpu['grpc-tls'] / cpu['grpc'] - 1:.0%}, TCP data "
                  f"plane +{cpu['tcp-tls'] / cpu['tcp'] - 1:.0%} "
                  f"({(cpu['tcp-tls'] - cpu['tcp']) * 1e3:.0f} ms for {nbytes / 1e6:.1f} MB)")
            stop(decode_tls)
            decode_tls = None

            if args.skip_ttft:
                return 0
            prefill, p_addr = start_node("prefill", model,
                                         [*opts, "--kv-transport", args.kv_transport,
                                          "--allowed-decode", d_addr], Path(tmp))
            single_node = SingleNode(model, engine_opts)
            pd, single = asyncio.run(ttft_pairs(p_addr, d_addr, single_node, prompts))
        finally:
            stop(decode)
            if decode_tls is not None:
                stop(decode_tls)
            if prefill is not None:
                stop(prefill)
    m_pd, m_single = statistics.median(pd), statistics.median(single)
    print(f"\nTTFT of a {args.prompt_len}-token prompt ({args.dtype}, CPU, KV over "
          f"{args.kv_transport}):")
    print(f"  single node (LLMEngine in the bench):  median {m_single * 1e3:.0f} ms "
          f"{[round(t * 1e3) for t in single]}")
    print(f"  PD (prefill node -> decode node):      median {m_pd * 1e3:.0f} ms "
          f"{[round(t * 1e3) for t in pd]}")
    print(f"  ratio PD / single node: {m_pd / m_single:.2f}x (target <= 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
