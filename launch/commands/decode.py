"""`pdserve decode`: a decode node of PD PUSH mode: gRPC server (health, reflection), engine
loop in its own thread, registration in etcd under /pdserve/<cluster>/nodes/decode/<node_id>.
SIGTERM drains: deregister, finish what is in flight, exit."""

from __future__ import annotations

import argparse

from launch.cli_common import env_argument
from launch.commands.node_options import add_node_arguments

HELP = "run a decode node"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_arguments(parser, "decode", default_port=50071)
    env_argument(parser, "--kv-tcp-listen", "PDSERVE_KV_TCP_LISTEN", default="auto",
                 metavar="HOST:PORT",
                 help="raw-TCP KV data plane for prefill nodes using --kv-transport tcp "
                      "(auto: the listen host, any free port; none: off)")
    env_argument(parser, "--lease-s", "PDSERVE_RESERVATION_LEASE", default=30.0, type=float,
                 metavar="S", help="reservation lease: blocks not filled by then return to "
                                   "the pool")


def run(args: argparse.Namespace) -> int:
    from launch.node_main import run_node

    return run_node("decode", args)
