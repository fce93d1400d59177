"""Small C++ CPU kernels built on first use with torch's cpp_extension (g++ and ninja),
cached under ~/.cache/torch_extensions, with a torch fallback when they cannot be built.

Each kernel module (engine/layers/cpu_paged_attention.py, engine/layers/cpu_fused_ops.py)
declares one CpuExtension; `load()` builds or loads it once per process and returns the
compiled module, or None with the reason kept in `failed` and logged once (no compiler,
no ninja, a build error). Whether a model uses a kernel is not decided here: the model's
layers take a KernelOptions value at construction (engine/layers/kernel_options.py, where
the environment switches are read) and load only the kernels it turns on.

    python -m engine.layers.cpu_extension

builds every kernel in one process: `make test` and `make up` run it first, so the nodes
and test processes that start together later only load the builds (never race to build).
A node loads its kernels before it serves (launch/node_main.py), so a build never lands
on live requests.

Builds cannot hang a process (docs/RELIABILITY.md):
- a build directory belongs to one source and one torch install: its name carries a hash
  of both. Two checkouts or venvs sharing ~/.cache/torch_extensions under one name rewrote
  each other's build.ninja, so every process start rebuilt (minutes on a busy machine);
- builds of one extension are serialised by an flock on `pdserve-build.lock` in its
  build directory, waited on for at most `build_lock_timeout` (PDSERVE_KERNEL_BUILD_TIMEOUT,
  600 s) and then refused with KernelBuildLockTimeout naming the lock and its holder. The
  kernel releases an flock when its holder dies, so a killed build never blocks the next;
- torch's own lock (a FileBaton: an empty `lock` file, waited on forever, left behind when
  its holder is killed) found while holding the flock belongs to a dead process, since
  every builder holds the flock: it is removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sysconfig
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BUILD_TIMEOUT_ENV = "PDSERVE_KERNEL_BUILD_TIMEOUT"
BUILD_LOCK_TIMEOUT_S = 600.0    # a build takes 1-5 min on a busy 2-core machine
LOCK_NAME = "pdserve-build.lock"


class KernelBuildLockTimeout(RuntimeError):
    """Another live process held the build lock for longer than the bound."""


class CpuExtension:
    def __init__(self, name: str, source: str, functions: list[str], cflags: list[str],
                 what: str, openmp: bool = True):
        self.name = name                # versioned: bump it when the source changes
        self.source = source
        self.functions = functions
        self.cflags = cflags
        self.what = what                # for log lines
        # -fopenmp links libgomp.so.1, which in a process that imported torch first
        # resolves to torch's own copy (one runtime in /proc/self/maps): worth it for big
        # calls, but a parallel region in a small call waits for a second thread to be
        # scheduled (ms on a loaded box), so kernels keep small calls inline
        self.openmp = openmp
        self.module = None
        self.failed: str | None = None
        self._lock = threading.Lock()

    def build_name(self) -> str:
        """`name`_`cpu capability`_`hash of the source, flags and torch install`: the
        -march=native build is for this CPU (a cache shared between different CPUs never
        loads a foreign build), and another checkout or venv builds in its own folder."""
        cap = torch.backends.cpu.get_cpu_capability().lower()
        key = "\0".join([self.source, *self.cflags, str(self.openmp), torch.__version__,
                         os.path.dirname(torch.__file__)])
        return f"{self.name}_{cap}_{hashlib.sha256(key.encode()).hexdigest()[:10]}"

    def load(self, build_lock_timeout: float | None = None):
        """The compiled module, or None when it cannot be built here (reason logged once).
        Raises KernelBuildLockTimeout when another process's build holds the lock longer
        than `build_lock_timeout` (default: $PDSERVE_KERNEL_BUILD_TIMEOUT or 600 s)."""
        if self.module is not None or self.failed is not None:
            return self.module
        with self._lock:
            if self.module is not None or self.failed is not None:
                return self.module
            _find_ninja()
            name = self.build_name()
            try:
                from torch.utils.cpp_extension import _get_build_directory, load_inline

                build_dir = Path(_get_build_directory(name, verbose=False))
            except Exception as exc:   # noqa: BLE001 - no cpp_extension: the torch path
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("%s unavailable (%s)", self.what, self.failed)
                return None
            timeout = lock_timeout() if build_lock_timeout is None else build_lock_timeout
            with build_lock(build_dir, timeout, self.what):
                try:
                    log.info("%s: building it, or loading the cached build", self.what)
                    self.module = load_inline(
                        name=name, cpp_sources=[self.source], functions=self.functions,
                        extra_cflags=["-O3", "-march=native", *self.cflags,
                                      *(["-fopenmp"] if self.openmp else [])],
                        extra_ldflags=["-fopenmp"] if self.openmp else [], verbose=False)
                except Exception as exc:   # no compiler, no ninja, a build error: torch path
                    self.failed = (f"{type(exc).__name__}: "
                                   f"{str(exc).strip().splitlines()[-1:]}")
                    log.warning("%s unavailable (%s); the slower torch path runs instead",
                                self.what, self.failed)
        return self.module

    def reset(self) -> None:
        """Forget the build and any failure (tests switch a kernel off and on again)."""
        with self._lock:
            self.module, self.failed = None, None


def lock_timeout() -> float:
    raw = os.environ.get(BUILD_TIMEOUT_ENV, "")
    try:
        return float(raw) if raw else BUILD_LOCK_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{BUILD_TIMEOUT_ENV} must be seconds, got {raw!r}") from None


def _holder(path: Path) -> str:
    try:
        pid = int(path.read_text().split()[0])
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        return f"pid {pid} ({cmd.strip()[:120]})"
    except (OSError, ValueError, IndexError):
        return "another process"


@contextmanager
def build_lock(build_dir: Path, timeout: float, what: str = "CPU kernel",
               poll_s: float = 0.1) -> Iterator[Path]:
    """Hold the build lock of one extension's build directory (see the module docstring).
    The holder's pid is written into the lock file so a waiter can name it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, waiting = time.monotonic() + timeout, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KernelBuildLockTimeout(
                        f"{what}: the build lock {path} is still held by {_holder(path)} "
                        f"after {timeout:.0f} s. If that process is stuck, stop it: the lock "
                        f"is freed when it exits (no file to delete). To start without the "
                        f"kernel, set PDSERVE_CPU_ATTENTION_KERNEL=0 / PDSERVE_CPU_FUSED_OPS=0; "
                        f"to wait longer, {BUILD_TIMEOUT_ENV}=<seconds>") from None
                if not waiting:
                    log.info("%s: waiting for the build held by %s (lock %s, at most %.0f s)",
                             what, _holder(path), path, timeout)
                    waiting = True
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        baton = build_dir / "lock"
        if baton.exists():
            log.warning("%s: removing torch's build lock %s left by a process killed while "
                        "building (every builder holds %s, which is now ours)", what, baton,
                        LOCK_NAME)
            baton.unlink(missing_ok=True)
        yield path
    finally:
        os.close(fd)        # releases the flock


def _find_ninja() -> None:
    """torch runs `ninja` from PATH; the pip-installed one sits beside this Python, which
    is not on PATH when the venv is not activated (`.venv/bin/python -m ...`)."""
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        if os.path.exists(os.path.join(scripts, "ninja")):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def all_extensions() -> list[CpuExtension]:
    from engine.layers import (
        cpu_bf16_gemm,
        cpu_decode_layers,
        cpu_fixed_order_linear,
        cpu_fused_ops,
        cpu_paged_attention,
        cpu_prefill_attention,
    )
    return [cpu_paged_attention.EXTENSION, cpu_fused_ops.EXTENSION, cpu_decode_layers.EXTENSION,
            cpu_prefill_attention.EXTENSION, cpu_bf16_gemm.EXTENSION,
            cpu_fixed_order_linear.EXTENSION]


def preload(options) -> dict[str, bool]:
    """Build or load now the kernels `options` (a KernelOptions narrowed to the device)
    turn on: what -> loaded. A process that calls this before serving never builds
    later (each extension loads once per process). May raise KernelBuildLockTimeout."""
    from engine.layers import (
        cpu_bf16_gemm,
        cpu_decode_layers,
        cpu_fixed_order_linear,
        cpu_fused_ops,
        cpu_paged_attention,
        cpu_prefill_attention,
    )
    wanted = [(options.batch_invariant, cpu_fixed_order_linear.EXTENSION),
              (options.batch_invariant, cpu_bf16_gemm.EXTENSION),
(options.cpu_attention_kernel, cpu_paged_attention.EXTENSION),
              (options.cpu_fused_ops, cpu_fused_ops.EXTENSION),
              # both call into the kernels above: off with them (as the model decides)
              (options.cpu_decode_layers and options.cpu_fused_ops
               and options.cpu_attention_kernel and options.cpu_packed_linear,
               cpu_decode_layers.EXTENSION),
              (options.cpu_prefill_tiles and options.cpu_attention_kernel,
               cpu_prefill_attention.EXTENSION),
              # the loader packs for it only with packed linears (bf16, oneDNN's bf16)
              (options.cpu_bf16_gemm and options.cpu_packed_linear, cpu_bf16_gemm.EXTENSION)]
    return {ext.what: ext.load() is not None for on, ext in wanted if on}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for ext in all_extensions():
        mod = ext.load()
        print(f"{ext.what}: {mod.__file__ if mod else 'unavailable: ' + str(ext.failed)}")
