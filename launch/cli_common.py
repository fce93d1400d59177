"""What the subcommand modules share: CliError and flags that fall back to env variables."""

from __future__ import annotations

import argparse
import os
from typing import Any


class CliError(Exception):
    """A mistake the user can fix; the message is printed as one line, exit status 2."""


def env_argument(parser: argparse.ArgumentParser | Any, flag: str, env: str, default: Any = None,
                 type: Any = str, help: str = "", **kwargs: Any) -> None:
    """Add `flag` whose default comes from the environment variable `env` when it is set
    (the flag still wins). The help text names the variable."""
    raw = os.environ.get(env)
    value = default
    if raw is not None and raw != "":
        try:
            value = type(raw)
        except (TypeError, ValueError):
            raise CliError(f"environment variable {env}={raw!r} is not a valid value for "
                           f"{flag}") from None
    shown = f" (default: {default})" if default not in (None, "") else ""
    parser.add_argument(flag, type=type, default=value, help=f"{help} [env {env}]{shown}",
                        **kwargs)


def env_flag(parser: argparse.ArgumentParser | Any, flag: str, env: str, help: str = "") -> None:
    """A boolean switch that is also on when `env` is 1/true/yes."""
    on = os.environ.get(env, "").strip().lower() in ("1", "true", "yes", "on")
    parser.add_argument(flag, action="store_true", default=on, help=f"{help} [env {env}]")
