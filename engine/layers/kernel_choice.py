"""Kernel choices made by measurement on this machine, kept so every process agrees.

A choice measured by timing can come out differently in two processes that start side by
side on a loaded machine (a prefill and a decode node, a reference engine and the one
under test). Where the choice changes bits (batch-invariant mode's linears: each kernel
holds on its own, but two kernels round differently), every process must take the same
one. So the first process to measure writes its choice to a file under the user's cache
(PDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve), keyed on what
the result depends on: the CPU model and its ISA flags, the torch version and the kernel
build; later processes, and later starts, read it. Measuring and writing happen under an
flock, so two processes never measure the same key at once. An unwritable cache keeps the
choice in this process only (a warning says so).
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from engine.layers import cpu_extension

log = logging.getLogger(__name__)

CACHE_ENV = "PDSERVE_CACHE_DIR"
FILE_NAME = "kernel-choices.json"
# the ISA flags a kernel's speed or rounding can depend on
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")


@functools.cache
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    """The CPU model name and its flags, from /proc/cpuinfo ("unknown cpu" and none where
    it cannot be read)."""
    model, flags = "unknown cpu", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown cpu":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


@functools.cache
def machine_key() -> str:
    """The CPU model, its relevant ISA flags and the torch version."""
    model, flags = cpu_model_and_flags()
    isa = ",".join(f for f in ISA_FLAGS if f in flags)
    return f"{model} [{isa}] torch {torch.__version__}"


def cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve")
    return Path(root) / FILE_NAME


class ChoiceCache:
    def __init__(self, path: Path | None = None):
        self.path = path
        self._memo: dict[str, str] = {}
        self._lock = threading.Lock()

    def choose(self, key: str, measure: Callable[[], str],
               still_valid: Callable[[str], bool] = lambda name: True) -> str:
        """The choice kept for `key` on this machine, or `measure()`'s, kept from now on.
        A kept choice that `still_valid` rejects is measured again."""
        full = f"{machine_key()} | {key}"
        with self._lock:
            if full in self._memo:
                return self._memo[full]
            path = self.path or cache_path()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                log.warning("kernel choices not kept (%s): measured in this process only",
                            exc)
                self._memo[full] = measure()
                return self._memo[full]
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                kept = _read(path)
                name = kept.get(full)
                if name is None or not still_valid(name):
                    name = measure()
                    kept[full] = name
                    _write(path, kept)
                self._memo[full] = name
                return name
            finally:
                os.close(fd)


    def made(self) -> dict[str, str]:
        """The choices this process took (measured or read), key -> kernel."""
        prefix = f"{machine_key()} | "
        with self._lock:
            return {k.removeprefix(prefix): v for k, v in self._memo.items()
                    if k.startswith(prefix)}

    def kept(self) -> dict[str, str]:
        """The choices kept on disk for this machine (any process's), key -> kernel."""
        prefix = f"{machine_key()} | "
        return {k.removeprefix(prefix): v for k, v in _read(self.path or cache_path()).items()
                if k.startswith(prefix)}


def _read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, kept: dict[str, str]) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(kept, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("kernel choices not written to %s (%s)", path, exc)


CHOICES = ChoiceCache()


def choose_attention_path(kind: str, what: str, shape: tuple[int, int, int, int],
                          paths: list[str], measure: Callable[[], str]) -> str:
    """An attention path among `paths` for caches of `shape` (query heads, KV heads,
    head_dim, block size): the one kept for the machine under `kind` (a kept name no longer
    among `paths` is measured again), else `measure()`'s; logged with `what`."""
    hq, hk, d, bs = shape
    key = f"{kind} [{hq}, {hk}, {d}] block {bs} {cpu_extension.KERNELS.build_name()}"
    name = CHOICES.choose(key, measure, still_valid=lambda kept: kept in paths)
    log.info("%s [%d q, %d kv heads, head_dim %d, block %d] chosen by measurement: %s (of %s)",
             what, hq, hk, d, bs, name, ", ".join(paths))
    return name
