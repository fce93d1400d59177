from __future__ import annotations

import argparse

from cluster.kv_transfer.limits import TcpLimits
from launch.cli_common import env_argument
from launch.commands.node_options import add_node_arguments, node_doc, node_runner

# `pdserve decode`: the description --help shows, and the one-line help
__doc__ = node_doc("decode", "a decode node of PD PUSH mode")
HELP = "run a decode node"
run = node_runner("decode")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_arguments(parser, "decode", default_port=50071)
    env_argument(parser, "--kv-tcp-listen", "PDSERVE_KV_TCP_LISTEN", default="auto",
                 metavar="HOST:PORT",
                 help="raw-TCP KV data plane for prefill nodes using --kv-transport tcp "
                      "(auto: the listen host, any free port; none: off)")
    env_argument(parser, "--kv-local-socket", "PDSERVE_KV_LOCAL_SOCKET", default="auto",
                 choices=("auto", "off"),
                 help="auto: the data plane also listens on a Unix socket, which prefill "
                      "nodes on this host (same kernel, same user, same file system) use "
                      "instead of TCP: no TLS on bytes that never leave the host, the "
                      "kernel vouches for the peer's user id; off: TCP only")
    env_argument(parser, "--lease-s", "PDSERVE_RESERVATION_LEASE", default=30.0, type=float,
                 metavar="S", help="reservation lease: blocks not filled by then return to "
                                   "the pool")
    env_argument(parser, "--max-lease-s", "PDSERVE_MAX_LEASE", default=None, type=float,
                 metavar="S", help="the longest lease a router may ask for; longer ones are "
                                   "clamped (default: --lease-s)")
    limits = TcpLimits()
    env_argument(parser, "--kv-tcp-max-connections", "PDSERVE_KV_TCP_MAX_CONNECTIONS",
                 default=limits.max_connections, type=int, metavar="N",
                 help="data-plane pushes served at once; more are refused (the sender "
                      "falls back to gRPC)")
    env_argument(parser, "--kv-tcp-header-timeout", "PDSERVE_KV_TCP_HEADER_TIMEOUT",
                 default=limits.header_timeout_s, type=float, metavar="S",
                 help="a data-plane connection must deliver its header (and finish its TLS "
                      "handshake) within this")
    env_argument(parser, "--kv-tcp-idle-timeout", "PDSERVE_KV_TCP_IDLE_TIMEOUT",
                 default=limits.idle_timeout_s, type=float, metavar="S",
                 help="each later data-plane frame must arrive within this")
    env_argument(parser, "--max-grpc-pushes", "PDSERVE_MAX_GRPC_PUSHES", default=0, type=int,
                 metavar="N",
                 help="gRPC PushKv streams served at once; more are answered "
                      "RESOURCE_EXHAUSTED (0: twice --max-num-seqs, at least 64)")
