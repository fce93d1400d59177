from __future__ import annotations

import argparse

from launch.commands.node_options import add_node_arguments, node_doc, node_runner

# `pdserve aggregated`: the description --help shows, and the one-line help
__doc__ = node_doc(
    "aggregated", "an aggregated node, which prefills and decodes by itself (no KV push)",
    services="the DecodeNode service, health, reflection",
    more="Routers send it whole requests (Decode with self_prefill) alongside or instead "
         "of prefill/decode pairs. ")
HELP = "run an aggregated node (prefill and decode on one node)"
run = node_runner("aggregated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_arguments(parser, "aggregated", default_port=50081)
