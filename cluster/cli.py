"""The `pdserve` command line (console script `pdserve = cluster.cli:main`).

Each subcommand lives in a module listed in SUBCOMMANDS. Such a module provides
`add_parser(subparsers)`, which adds its parser and sets `func` with `set_defaults`:
`func(args) -> int` runs the command and returns the exit status. Modules are imported when
the parser is built, so they must keep top-level imports light (import torch etc. inside `func`).

A mistake the user can fix is raised as `CliError`: one line on stderr, exit status 2, no
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

# "module" (its `add_parser`) or "module:function". Order is the order shown in --help.
SUBCOMMANDS: tuple[str, ...] = (
    "cluster.cli:add_models_parser",
    "cluster.offline_demo",
    # Later: router, prefill, decode, generate.
)

EXIT_USAGE = 2


class CliError(Exception):
    """A mistake the user can fix; the message is printed as one line, exit status 2."""


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
    logger = logging.getLogger("pdserve")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("pdserve: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


# --------------------------------------------------------------------------- pdserve models


def _cache_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                        help="cache root (default: $PDSERVE_CACHE_DIR, else "
                             "$XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve)")


def _cache(args: argparse.Namespace) -> Path | None:
    return args.cache_dir.expanduser() if args.cache_dir is not None else None


def _models_prepare(args: argparse.Namespace) -> int:
    from engine.models.default_model import DefaultModelError, prepare_default_model

    try:
        folder = prepare_default_model(_cache(args), progress=not args.quiet)
    except DefaultModelError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:  # unwritable cache dir, disk full, ...
        raise CliError(f"cannot prepare the default model: {exc}") from None
    print(folder, flush=True)  # the last line of stdout, for scripts
    return 0


def _models_path(args: argparse.Namespace) -> int:
    from engine.models.default_model import model_dir, prepared_model_dir

    folder = prepared_model_dir(_cache(args))
    if folder is None:
        again = f" --cache-dir {args.cache_dir}" if args.cache_dir is not None else ""
        print(f"pdserve: the default model is not prepared in {model_dir(_cache(args))}; "
              f"run `pdserve models prepare{again}`", file=sys.stderr)
        return 1
    print(folder, flush=True)
    return 0


def add_models_parser(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="prepare or locate the default model",
                                   description="The default model (SmolLM2-135M-Instruct) ships "
                                   "as a GGUF file; `prepare` converts it once into an HF folder.")
    sub = models.add_subparsers(dest="models_command", metavar="{prepare,path}", required=True)
    prepare = sub.add_parser("prepare", help="convert the packaged GGUF into the cache (once)",
                             description="Convert the packaged GGUF into <cache>/models/ once and "
                             "print the folder as the last line of stdout.")
    _cache_arg(prepare)
    prepare.add_argument("--quiet", "-q", action="store_true",
                         help="no progress bar or log lines, only the folder")
    prepare.set_defaults(func=_models_prepare)
    path = sub.add_parser("path", help="print the prepared folder (exit 1 if not prepared)")
    _cache_arg(path)
    path.set_defaults(func=_models_path)


# --------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve",
                                     description="Prefill/decode-disaggregated LLM serving.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for entry in SUBCOMMANDS:
        module_name, _, func_name = entry.partition(":")
        add_parser = getattr(importlib.import_module(module_name), func_name or "add_parser")
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # bad usage: argparse exits with status 2
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
    # `python -m cluster.cli`: run the importable module's main, so that its CliError is the one
    # the subcommands raise (this file would otherwise be loaded twice, as two modules).
    from cluster.cli import main as _main

    sys.exit(_main())
