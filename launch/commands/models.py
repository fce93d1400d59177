"""`pdserve models prepare|path`: the default model (SmolLM2-135M-Instruct) ships as a GGUF
file; `prepare` converts it once into an HF folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.cli_common import CliError

HELP = "prepare or locate the default model"


def _cache_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                        help="cache root (default: $PDSERVE_CACHE_DIR, else "
                             "$XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve)")


def _cache(args: argparse.Namespace) -> Path | None:
    return args.cache_dir.expanduser() if args.cache_dir is not None else None


def _prepare(args: argparse.Namespace) -> int:
    from launch.default_model import DefaultModelError, prepare_default_model

    try:
        folder = prepare_default_model(_cache(args), progress=not args.quiet)
    except DefaultModelError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:  # unwritable cache dir, disk full, ...
        raise CliError(f"cannot prepare the default model: {exc}") from None
    print(folder, flush=True)  # the last line of stdout, for scripts
    return 0


def _path(args: argparse.Namespace) -> int:
    from launch.default_model import model_dir, prepared_model_dir

    folder = prepared_model_dir(_cache(args))
    if folder is None:
        again = f" --cache-dir {args.cache_dir}" if args.cache_dir is not None else ""
        print(f"pdserve: the default model is not prepared in {model_dir(_cache(args))}; "
              f"run `pdserve models prepare{again}`", file=sys.stderr)
        return 1
    print(folder, flush=True)
    return 0


_ACTIONS = {"prepare": _prepare, "path": _path}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", metavar="{prepare,path}", required=True)
    prepare = sub.add_parser("prepare", help="convert the packaged GGUF into the cache (once)",
                             description="Convert the packaged GGUF into <cache>/models/ once and "
                             "print the folder as the last line of stdout.")
    _cache_arg(prepare)
    prepare.add_argument("--quiet", "-q", action="store_true",
                         help="no progress bar or log lines, only the folder")
    path = sub.add_parser("path", help="print the prepared folder (exit 1 if not prepared)")
    _cache_arg(path)


def run(args: argparse.Namespace) -> int:
    return _ACTIONS[args.models_command](args)
