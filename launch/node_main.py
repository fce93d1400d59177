"""`pdserve prefill|decode|aggregated`: build the node, serve gRPC, register, drain on
SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from launch.cli_common import (
    CliError,
    configure_tracing,
    etcd_access_from_args,
    tls_from_args,
)

# A draining node keeps its listener this long after leaving discovery (refusing new work
# with the replay hint): a router whose watch has not yet delivered the deregistration may
# still pick it, and a refusal makes it try another pair, while a closed port would count
# as a node failure. Found by the 64-stream decode-drain test: a node with little left to
# finish exited before the router saw it leave (connection refused, 1 run in 4).
LEAVE_GRACE_S = 2.0

log = logging.getLogger("cluster.node")


def build_node(role: str, args: argparse.Namespace, node_id: str):
    from launch.commands.node_options import engine_config_from_args

    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    tls = tls_from_args(args)
    try:
        core_share = None
        if args.core_share_lock:
            from cluster.core_share import CoreShare
            core_share = CoreShare(args.core_share_lock)
        if role == "aggregated":
            # the decode node's wiring, prefilling by itself: no reservations, no data plane
            from decode_node.node import DecodeNode
            return DecodeNode(config, node_id=node_id, tls=tls, role="aggregated",
                              core_share=core_share)
        if role == "decode":
            from cluster.kv_transfer.limits import TcpLimits
            from decode_node.node import DecodeNode
            tcp = None if args.kv_tcp_listen in ("", "none", "off") else args.kv_tcp_listen
            if tcp == "auto":
                tcp = f"{args.listen.rpartition(':')[0]}:0"
            limits = TcpLimits(max_connections=args.kv_tcp_max_connections,
                               header_timeout_s=args.kv_tcp_header_timeout,
                               idle_timeout_s=args.kv_tcp_idle_timeout)
            if args.max_grpc_pushes < 0:
                raise CliError(f"--max-grpc-pushes must be >= 0 (0: automatic), got "
                               f"{args.max_grpc_pushes}")
            return DecodeNode(config, node_id=node_id, lease_s=args.lease_s, kv_tcp_listen=tcp,
                              max_lease_s=args.max_lease_s, kv_tcp_limits=limits, tls=tls,
                              max_grpc_pushes=args.max_grpc_pushes or None,
                              core_share=core_share,
                              kv_local_socket=args.kv_local_socket != "off")
        from cluster.kv_transfer.grpc_transport import GrpcTransport
        from prefill_node.node import PrefillNode
        transport = GrpcTransport(tls=tls)
        if args.kv_transport == "tcp":
            from cluster.kv_transfer.tcp_transport import TcpTransport
            transport = TcpTransport(transport)
        return PrefillNode(config, transport, node_id=node_id, decode_gate=decode_gate(args),
                           core_share=core_share, kv_push=args.kv_push)
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(f"cannot load the model: {exc}") from None


def decode_gate(args: argparse.Namespace):
    """Where this prefill node may push KV: the decode nodes registered in etcd (a registry
    of its own, watched only), or with etcd off the --allowed-decode list. With neither,
    refuse to start rather than push to whatever address a caller names."""
    from prefill_node.decode_gate import DiscoveryDecodeGate, StaticDecodeGate

    registry = make_registry(args)
    if registry is not None:
        return DiscoveryDecodeGate(registry, close_registry=True)
    allowed = [a.strip() for a in (args.allowed_decode or "").split(",") if a.strip()]
    if not allowed:
        raise CliError("a prefill node without etcd (--etcd none) needs --allowed-decode "
                       "HOST:PORT,... [PDSERVE_ALLOWED_DECODE]: the decode nodes it may push to")
    return StaticDecodeGate(allowed)


def load_kernels(device: str) -> dict[str, bool]:
    """The CPU kernels the model will use, built or loaded before the node exists: a build
    (minutes) or a wait on another process's build happens here, before the gRPC port opens
    and the node registers, never under live requests. A build lock held too long by
    another process ends the start with a message naming the lock and its holder."""
    from engine.layers.cpu_extension import KernelBuildLockTimeout, preload
    from engine.layers.kernel_options import KernelOptions

    try:
        options = KernelOptions.from_env().for_device(device)
    except (RuntimeError, ValueError):
        return {}       # a bad device is reported, with the flag's name, by build_node
    try:
        loaded = preload(options)
    except (KernelBuildLockTimeout, ValueError) as exc:
        raise CliError(str(exc)) from None
    from engine.layers.cpu_extension import KERNELS
    if KERNELS.failed is not None:      # loud: a node that serves slower must say why
        log.error("CPU kernels could not be built (%s): every kernel family runs the slower "
                  "torch path; `pdserve kernels` shows the build's errors", KERNELS.failed)
    for what, ok in loaded.items():
        log.info("%s: %s", what, "loaded" if ok else "not on this CPU or not built; the "
                 "torch path runs")
    return loaded


def kernel_error() -> str:
    """Why the C++ CPU kernels could not be built, if a load was tried and failed."""
    from engine.layers.cpu_extension import KERNELS
    return KERNELS.failed or ""


def make_registry(args: argparse.Namespace):
    if str(args.etcd).strip().lower() in ("", "none", "off"):
        return None
    from cluster.discovery import EtcdRegistry
    try:
        return EtcdRegistry(args.etcd, args.cluster, ttl=args.lease_ttl,
                            access=etcd_access_from_args(args))
    except ValueError as exc:
        raise CliError(str(exc)) from None


async def serve(role: str, node, args: argparse.Namespace, node_id: str) -> int:
    from cluster.discovery import NodeRecord, new_incarnation
    from cluster.node_server import (
        GrpcNodeServer,
        Presence,
        advertised,
        drain,
        install_stop_signals,
        write_ready_file,
    )
    from cluster.omp_threads import serial_thread_pool
    from cluster.proto_convert import fingerprint_to_proto  # noqa: F401 - fail early if broken

    # asyncio.to_thread's workers (KV landing over gRPC, the sender's waits) run torch
    # serially too
    asyncio.get_running_loop().set_default_executor(serial_thread_pool(
        thread_name_prefix=f"{role}-executor"))
    registry = make_registry(args)
    server = GrpcNodeServer(node.SERVICE, args.listen, tls=tls_from_args(args))
    server.add(node.add_to_server, node.service)
    try:
        port = await server.start()
    except OSError as exc:
        raise CliError(str(exc)) from None
    address = advertised(args.listen, port, args.advertise)
    node.start(advertise_host=address.rpartition(":")[0])
    metrics = start_metrics(node, args)
    record = NodeRecord(node_id=node_id, role=role, address=address,
                        incarnation=new_incarnation(), model_id=node.service.model_id,
                        max_model_len=node.engine.max_model_len,
                        fingerprint=node.fingerprint.as_dict(), kernel_error=kernel_error())
    presence = Presence(registry, record, node.load, args.load_interval)
    stop = asyncio.Event()
    install_stop_signals(stop)
    await server.set_serving(True)
    await presence.start(wait_s=float(args.lease_ttl))
    write_ready_file(args.ready_file, address)
    log.info("%s node %s serving on %s (advertised %s), cluster %r, etcd %s", role, node_id,
             args.listen, address, args.cluster, args.etcd)
    await stop.wait()

    log.info("%s node %s: SIGTERM, draining", role, node_id)
    # Leave discovery first (routers stop picking this node), then refuse new work and
    # release reservations whose push has not begun (their callers replay elsewhere),
    # then finish what was admitted.
    await presence.stop()
    left_at = asyncio.get_running_loop().time()
    node.begin_drain()
    await server.set_serving(False)
    await drain(lambda: node.service.in_flight, args.drain_timeout, f"{role} node {node_id}")
    await asyncio.sleep(left_at + LEAVE_GRACE_S - asyncio.get_running_loop().time())
    await server.stop(grace=1.0)
    await node.stop()
    if metrics is not None:
        metrics.stop()
    log.info("%s node %s stopped", role, node_id)
    return 0


def metrics_address(args: argparse.Namespace) -> tuple[str, int] | None:
    """--metrics-listen as (host, port), None when off; a bad value is a CliError."""
    from cluster.metrics_server import metrics_listen

    try:
        return metrics_listen(args.metrics_listen)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def start_metrics(node, args: argparse.Namespace):
    """The node's /metrics server (cluster/metrics_server.py), or None when off."""
    listen = metrics_address(args)
    if listen is None:
        return None
    from cluster.metrics_server import MetricsServer

    try:
        return MetricsServer(node.metrics.registry, *listen)
    except OSError as exc:
        raise CliError(str(exc)) from None


def run_node(role: str, args: argparse.Namespace) -> int:
    if str(args.device).startswith("cpu"):
        # before any thread of this process allocates: the engine thread then shares the
        # main heap instead of an arena that hands its pages back after every step
        from engine.host_allocator import keep_large_allocations_in_heap
        keep_large_allocations_in_heap()
    # libgomp keeps its default spin-wait (GOMP_SPINCOUNT 300,000): a node is alone on its
    # cores, or takes turns with the others on them (cluster/core_share.py). A short spin
    # (3,000, the default here until 2026-12-06) let each idle OpenMP worker sleep between a
    # step's ~250 parallel regions and lose its core to the router or the load generator;
    # on an AMX Xeon that cost served SmolLM2 bf16 at c64 a quarter of its throughput
    # (aggregated 550 -> 733 tok/s, docs/PERFORMANCE.md). A user's GOMP_SPINCOUNT or
    # OMP_WAIT_POLICY still reaches libgomp as set.
    from cluster.node_server import default_node_id

    node_id = args.node_id or default_node_id(role)
    metrics_address(args)            # a bad --metrics-listen fails before the model loads
    configure_tracing(args, f"pdserve-{role}")
    from cluster.gc_pause import freeze_startup_objects
    from cluster.omp_threads import run_in_passing_thread, serial_torch_thread

    def load():
        load_kernels(args.device)
        return build_node(role, args, node_id)

    # the model loads on a thread that ends, and this thread (the event loop's) runs torch
    # serially: the engine loop's thread keeps the only OpenMP team (cluster/omp_threads.py)
    node = run_in_passing_thread(load, name=f"{role}-load")
    serial_torch_thread()
    freeze_startup_objects()         # full GC passes skip the model and torch (gc_pause.py)
    ranks = getattr(getattr(node, "engine", None), "ranks", None)
    if ranks is not None:
        ranks.on_lost = _exit_for_lost_rank
    return asyncio.run(serve(role, node, args, node_id))


def _exit_for_lost_rank(why: str) -> None:
    """A tensor-parallel node whose rank died cannot compute: it exits at once, so it
    leaves discovery with its lease and the router replays its requests elsewhere (pdserve
    up's supervisor starts it again)."""
    log.critical("%s: the node exits", why)
    logging.shutdown()
    os._exit(70)
