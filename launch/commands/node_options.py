"""What the node commands (`pdserve prefill`, `decode`, `aggregated`) share: their flags
(each also read from an env var), the frame of their description and their `run`."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from launch.cli_common import (
    add_etcd_access_arguments,
    add_tls_arguments,
    add_tracing_arguments,
    env_argument,
    env_bool_argument,
    env_flag,
)


def node_doc(role: str, what: str, services: str = "health, reflection",
             more: str = "") -> str:
    """A node command's description (its module's __doc__, which `pdserve ROLE --help`
    shows): `what` the node is, inside what every node does and how it stops."""
    return (f"`pdserve {role}`: {what}: gRPC server ({services}), engine loop in its own "
            f"thread, registration in etcd under /pdserve/<cluster>/nodes/{role}/<node_id>. "
            f"{more}SIGTERM drains: deregister, finish what is in flight, exit.")


def node_runner(role: str) -> Callable[[argparse.Namespace], int]:
    """A node command's `run(args)`. The node's main is imported only when it runs: the
    CLI imports every command module to build its parser, and the node pulls in torch."""
    def run(args: argparse.Namespace) -> int:
        from launch.node_main import run_node

        return run_node(role, args)

    return run


def add_node_arguments(p: argparse.ArgumentParser, role: str, default_port: int) -> None:
    net = p.add_argument_group("network and discovery")
    env_argument(net, "--listen", "PDSERVE_LISTEN", default=f"127.0.0.1:{default_port}",
                 metavar="HOST:PORT", help="gRPC listen address (port 0: any free port)")
    env_argument(net, "--advertise", "PDSERVE_ADVERTISE", default=None, metavar="HOST:PORT",
                 help="address other nodes and routers dial (default: the bound listen "
                      "address; 0.0.0.0 becomes 127.0.0.1)")
    env_argument(net, "--etcd", "PDSERVE_ETCD", default="127.0.0.1:2379",
                 metavar="HOST:PORT[,HOST:PORT]",
                 help="etcd endpoints; `none` runs without discovery")
    env_argument(net, "--cluster", "PDSERVE_CLUSTER", default="default",
                 help="cluster name: the etcd prefix /pdserve/<cluster>/")
    env_argument(net, "--node-id", "PDSERVE_NODE_ID", default=None,
                 help=f"node id (default: {role}-<host>-<pid>)")
    env_argument(net, "--lease-ttl", "PDSERVE_LEASE_TTL", default=5, type=int, metavar="S",
                 help="etcd lease TTL in seconds (the liveness signal)")
    env_argument(net, "--load-interval", "PDSERVE_LOAD_INTERVAL", default=0.5, type=float,
                 metavar="S", help="how often the load is sampled; it is published "
                 "only when it changed, at most once per second (etcd keeps every write)")
    env_argument(net, "--drain-timeout", "PDSERVE_DRAIN_TIMEOUT", default=30.0, type=float,
                 metavar="S", help="on SIGTERM, how long in-flight requests may take")
    env_argument(net, "--ready-file", "PDSERVE_READY_FILE", default=None, metavar="PATH",
                 help="write the advertised address here once serving (for launchers)")
    env_argument(net, "--metrics-listen", "PDSERVE_METRICS_LISTEN", default="none",
                 metavar="HOST:PORT", help="serve Prometheus GET /metrics over plain HTTP on "
                 "this address (port 0: any free port, logged; none: off)")
    add_etcd_access_arguments(p)
    add_tls_arguments(p)
    add_tracing_arguments(p.add_argument_group("tracing"))
    add_engine_arguments(p, max_num_batched_tokens=ROLE_MAX_NUM_BATCHED_TOKENS.get(
        role, MAX_NUM_BATCHED_TOKENS))


# A step's token budget. A prefill node's is twice the others': it decodes nothing, so a
# longer step delays no token of its own, and each of its steps costs a fixed share besides
# the forward (the push hand-over in its turn on shared cores, the decode node's step between
# two of its turns). Measured (pdserve up, 2 cores, bf16, 16 concurrent 256-token prompts,
# three bursts): 2048 split each burst into 2-3 steps and gave the last request its first
# token after 1.31-1.56 s; 4096 took each burst in one step, 1.10-1.21 s, and the bursts'
# wall time fell 5.6-5.8 -> 5.1-5.3 s. An aggregated or decode node keeps 2048: its decode
# rows wait for each step, so the budget bounds their inter-token latency.
MAX_NUM_BATCHED_TOKENS = 2048
ROLE_MAX_NUM_BATCHED_TOKENS = {"prefill": 4096}


def add_engine_arguments(p: argparse.ArgumentParser,
                         max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS) -> None:
    """The engine's flags: a node's, and a tensor-parallel rank's (`pdserve tp-rank`).
    max_num_batched_tokens: the role's default step budget (the scheduler's, so only rank
    0 of a tensor-parallel group reads it)."""
    eng = p.add_argument_group("engine")
    env_argument(eng, "--model", "PDSERVE_MODEL", default=None, metavar="DIR",
                 help="HF model folder (default: the prepared SmolLM2-135M-Instruct)")
    env_argument(eng, "--device", "PDSERVE_DEVICE", default="cpu", help="cpu | cuda[:i] | npu[:i]")
    env_argument(eng, "--dtype", "PDSERVE_DTYPE", default="auto",
                 choices=["auto", "float32", "bfloat16", "float16"])
    env_argument(eng, "--block-size", "PDSERVE_BLOCK_SIZE", default=16, type=int)
    env_argument(eng, "--num-gpu-blocks", "PDSERVE_NUM_GPU_BLOCKS", default=None, type=int,
                 help="KV blocks (default: from --kv-cache-memory-gb)")
    env_argument(eng, "--kv-cache-memory-gb", "PDSERVE_KV_CACHE_MEMORY_GB", default=1.0,
                 type=float)
    env_argument(eng, "--max-num-seqs", "PDSERVE_MAX_NUM_SEQS", default=64, type=int)
    env_argument(eng, "--max-num-batched-tokens", "PDSERVE_MAX_NUM_BATCHED_TOKENS",
                 default=max_num_batched_tokens, type=int,
                 help=f"tokens one engine step may compute (prompt chunks included; "
                      f"default here {max_num_batched_tokens}: a prefill node's is "
                      f"{ROLE_MAX_NUM_BATCHED_TOKENS['prefill']}, other nodes' "
                      f"{MAX_NUM_BATCHED_TOKENS})")
    env_argument(eng, "--max-model-len", "PDSERVE_MAX_MODEL_LEN", default=None, type=int)
    env_bool_argument(eng, "--prefault-memory", "PDSERVE_PREFAULT_MEMORY", default=True,
                      help="on a CPU, give the KV cache and a step's working heap their "
                      "memory at start, not at their first use (a page's first touch is "
                      "slow in a VM; engine/kv_cache.py, engine/host_allocator.py)")
    env_bool_argument(eng, "--huge-pages", "PDSERVE_HUGE_PAGES", default=True,
                      help="on a CPU, the KV cache and the weights a decode step streams on "
                      "2 MB pages where the OS gives them to memory that asks "
                      "(engine/huge_pages.py)")
    env_flag(eng, "--no-prefix-caching", "PDSERVE_NO_PREFIX_CACHING",
             help="disable the prefix cache")
    env_argument(eng, "--seed", "PDSERVE_SEED", default=0, type=int)
    env_argument(eng, "--cpu-threads", "PDSERVE_CPU_THREADS", default=0, type=int, metavar="N",
                 help="torch threads on a CPU device (0: one per core; give nodes that "
                      "share a machine's cores a share each)")
    env_argument(eng, "--core-share-lock", "PDSERVE_CORE_SHARE_LOCK", default=None,
                 metavar="FILE", help="nodes on the same cores give the same file: their "
                 "engine steps take turns instead of running side by side (pdserve up sets "
                 "it on a CPU device; cluster/core_share.py)")
    env_argument(eng, "--tensor-parallel-size", "PDSERVE_TENSOR_PARALLEL_SIZE", default=1,
                 type=int, metavar="N", help="ranks the model is split across (torch."
                 "distributed: gloo on a CPU, nccl on CUDA, hccl on Ascend), each a process; "
                 "pushed KV carries every head, so prefill and decode nodes of different "
                 "sizes work together")
    env_argument(eng, "--expert-parallel-size", "PDSERVE_EXPERT_PARALLEL_SIZE", default=1,
                 type=int, metavar="N", help="MoE experts split across N ranks: 1 (every "
                 "rank keeps every expert) or --tensor-parallel-size (each its share)")
    env_argument(eng, "--tensor-parallel-store", "PDSERVE_TENSOR_PARALLEL_STORE",
                 default=None, metavar="HOST:PORT", help="the group's rendezvous: rank 0 (the "
                 "node) listens on PORT and the other ranks, started apart with `pdserve "
                 "tp-rank` (e.g. a LeaderWorkerSet's workers), connect to HOST:PORT; unset: "
                 "the node spawns them on its machine")
    env_flag(eng, "--batch-invariant", "PDSERVE_BATCH_INVARIANT",
             help="a request's tokens do not depend on what runs beside it (bf16 greedy "
                  "reproducible under load; cpu only, slower prefill)")

    fast = p.add_argument_group("graphs and speculative decoding")
    env_flag(fast, "--enable-graph", "PDSERVE_ENABLE_GRAPH",
             help="replay captured graphs for decode batches")
    env_argument(fast, "--graph-max-batch-size", "PDSERVE_GRAPH_MAX_BATCH_SIZE", default=None,
                 type=int, metavar="N",
                 help="larger decode batches run eagerly (default: --max-num-seqs)")
    env_argument(fast, "--speculative-method", "PDSERVE_SPECULATIVE_METHOD", default="none",
                 type=speculative_method, metavar="none|mtp",
                 help="speculative decoding (mtp: the model's MTP head or --speculative-model)")
    env_argument(fast, "--num-speculative-tokens", "PDSERVE_NUM_SPECULATIVE_TOKENS", default=1,
                 type=int, metavar="K", help="draft tokens per step")
    env_argument(fast, "--speculative-model", "PDSERVE_SPECULATIVE_MODEL", default=None,
                 metavar="DIR", help="a separate MTP draft folder")


SPECULATIVE_METHODS = {"none": None, "mtp": "mtp"}


def speculative_method(value: str) -> str:
    """argparse type: a known method name (lower-cased), else ValueError naming the choices."""
    name = value.strip().lower()
    if name not in SPECULATIVE_METHODS:
        raise ValueError(f"--speculative-method must be one of {sorted(SPECULATIVE_METHODS)}, "
                         f"got {value!r}")
    return name


def engine_config_from_args(args: argparse.Namespace):
    """EngineConfig from the parsed flags (ValueError names a bad value)."""
    from engine.config import EngineConfig

    model = args.model
    if model is None:
        from launch.default_model import prepare_default_model
        model = str(prepare_default_model(progress=False))
    return EngineConfig(model=model, dtype=args.dtype, device=args.device,
                        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                        kv_cache_memory_gb=args.kv_cache_memory_gb,
                        prefault_memory=args.prefault_memory, huge_pages=args.huge_pages,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len,
                        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
                        cpu_threads=args.cpu_threads or None,
                        batch_invariant=args.batch_invariant,
                        tensor_parallel_size=args.tensor_parallel_size,
                        tensor_parallel_store=args.tensor_parallel_store,
                        expert_parallel_size=args.expert_parallel_size,
                        enable_graph=args.enable_graph,
                        graph_max_batch_size=args.graph_max_batch_size,
                        speculative_method=SPECULATIVE_METHODS[
                            speculative_method(args.speculative_method)],
                        num_speculative_tokens=args.num_speculative_tokens,
                        speculative_model=args.speculative_model)
