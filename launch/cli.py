"""The `pdserve` command line (console script `pdserve = launch.cli:main`).

Each subcommand lives in its own module, listed in SUBCOMMANDS (name -> module). Such a
module provides `HELP` (one line), `add_arguments(parser)` and `run(args) -> int` (the exit
status); its `__doc__` is the subcommand's description (the node commands build theirs and
their `run` with launch/commands/node_options.py). Modules are imported when the
parser is built, so they must keep top-level imports light (import torch, grpc etc. inside
`run`). Flags of the serving commands also read env variables (PDSERVE_ETCD, PDSERVE_CLUSTER,
...; see launch/cli_common.py).

A mistake the user can fix is raised as `CliError`: one line on stderr, exit status 2, no
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from launch.cli_common import CliError

# Order is the order shown in --help.
SUBCOMMANDS: dict[str, str] = {
    "models": "launch.commands.models",
    "up": "launch.commands.up",
    "router": "launch.commands.router",
    "prefill": "launch.commands.prefill",
    "decode": "launch.commands.decode",
    "aggregated": "launch.commands.aggregated",
    "tp-rank": "launch.commands.tp_rank",
    "generate": "launch.commands.generate",
    "offline": "launch.commands.offline",
    "certs": "launch.commands.certs",
    "kernels": "launch.commands.kernels",
}

EXIT_USAGE = 2

__all__ = ["CliError", "SUBCOMMANDS", "build_parser", "main"]


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (pytest's capsys swaps it per test)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _setup_logging(quiet: bool) -> None:
    for name in ("pdserve", "engine", "cluster", "prefill_node", "decode_node", "router"):
        logger = logging.getLogger(name)
        if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
            handler = _StderrHandler()
            prefix = "pdserve" if name == "pdserve" else f"pdserve[{name}]"
            handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
            logger.addHandler(handler)
        logger.setLevel(logging.WARNING if quiet else logging.INFO)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve",
                                     description="Prefill/decode-disaggregated LLM serving.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=module.HELP, description=module.__doc__)
        module.add_arguments(sub)
        sub.set_defaults(func=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except CliError as exc:  # e.g. a malformed env variable read as a flag default
        print(f"pdserve: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)  # bad usage: argparse exits with status 2
    _setup_logging(quiet=bool(getattr(args, "quiet", False)))
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"pdserve: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pdserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m launch.cli`: run the importable module's main, so that its CliError is the one
    # the subcommands raise (this file would otherwise be loaded twice, as two modules).
    from launch.cli import main as _main

    sys.exit(_main())
