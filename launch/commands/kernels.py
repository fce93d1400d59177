"""`pdserve kernels`: build (or load) the C++ CPU kernels and list which kernel families run
on this machine (built, and the CPU has what they need: AVX512-BF16 for the bf16 GEMM and
the tiled prefill attention). Exit status 1 when the extension cannot be built (the
compiler's first errors are printed): the nodes then serve through the slower torch path."""

from __future__ import annotations

import argparse

HELP = "build or load the C++ CPU kernels and list which run here"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--compile-commands", action="store_true",
                   help="also copy the build's compile_commands.json to the repository root "
                        "(for clangd and other C++ tools)")


def run(args: argparse.Namespace) -> int:
    from engine.layers.cpu_extension import main

    return main((["--json"] if args.json else [])
                + (["--compile-commands"] if args.compile_commands else []))
