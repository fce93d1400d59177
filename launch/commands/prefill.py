from __future__ import annotations

import argparse

from launch.cli_common import env_argument
from launch.commands.node_options import add_node_arguments, node_doc, node_runner

# `pdserve prefill`: the description --help shows, and the one-line help
__doc__ = node_doc("prefill", "a prefill node of PD PUSH mode")
HELP = "run a prefill node"
run = node_runner("prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_arguments(parser, "prefill", default_port=50061)
    env_argument(parser, "--kv-transport", "PDSERVE_KV_TRANSPORT", default="grpc",
                 choices=["grpc", "tcp"],
                 help="how KV reaches decode nodes: gRPC streaming (works between any two "
                      "hosts), or the decode node's raw-TCP data plane (falls back to gRPC "
                      "where a decode node has none)")
    env_argument(parser, "--kv-push", "PDSERVE_KV_PUSH", default="auto",
                 choices=["auto", "layer", "step"],
                 help="when a prefill's KV leaves: `layer` as each layer is computed "
                      "(overlaps the compute), `step` once the step's forward is done (one "
                      "hand-off per step: on a CPU the sending threads would otherwise take "
                      "the forward's cores once per layer); auto: step on a CPU, layer on "
                      "an accelerator")
    env_argument(parser, "--allowed-decode", "PDSERVE_ALLOWED_DECODE", default=None,
                 metavar="HOST:PORT,...",
                 help="without etcd (--etcd none): the decode nodes this node may push KV "
                      "to (with etcd: the decode nodes registered there)")
