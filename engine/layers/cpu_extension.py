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
"""

from __future__ import annotations

import logging
import os
import shutil
import sysconfig
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


class CpuExtension:
    def __init__(self, name: str, source: str, functions: list[str], cflags: list[str],
                 what: str, openmp: bool = True):
        self.name = name                # versioned: bump it when the source changes
        self.source = source
        self.functions = functions
        self.cflags = cflags
        self.what = what                # for log lines
        # OpenMP here is the extension's own runtime, beside torch's (torch.set_num_threads
        # does not reach it): worth it for big calls, but a parallel region in a small
        # call waits for a second thread to be scheduled (ms on a loaded box)
        self.openmp = openmp
        self.module = None
        self.failed: str | None = None
        self._lock = threading.Lock()

    def load(self):
        """The compiled module, or None when it cannot be built here (reason logged once)."""
        if self.module is not None or self.failed is not None:
            return self.module
        with self._lock:
            if self.module is not None or self.failed is not None:
                return self.module
            _find_ninja()
            cap = torch.backends.cpu.get_cpu_capability().lower()
            _clear_stale_lock(f"{self.name}_{cap}")
            try:
                from torch.utils.cpp_extension import load_inline

                log.info("%s: building it, or loading the cached build", self.what)
                # -march=native: the build is for this CPU; its capability is in the name
                # so a cache shared between different CPUs never loads a foreign build
                self.module = load_inline(
                    name=f"{self.name}_{cap}", cpp_sources=[self.source],
                    functions=self.functions,
                    extra_cflags=["-O3", "-march=native", *self.cflags,
                                  *(["-fopenmp"] if self.openmp else [])],
                    extra_ldflags=["-fopenmp"] if self.openmp else [], verbose=False)
            except Exception as exc:   # no compiler, no ninja, a build error: torch path
                self.failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
                log.warning("%s unavailable (%s); the slower torch path runs instead",
                            self.what, self.failed)
        return self.module

    def reset(self) -> None:
        """Forget the build and any failure (tests switch a kernel off and on again)."""
        with self._lock:
            self.module, self.failed = None, None


# torch's build lock (a FileBaton: an empty file, waited on with no timeout) outlives a
# process killed while holding it, e.g. a node SIGKILLed during start-up; every later
# process on the machine would then wait forever. No build takes this long.
STALE_LOCK_S = 300.0


def _clear_stale_lock(name: str) -> None:
    try:
        from torch.utils.cpp_extension import _get_build_directory
        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        age = time.time() - lock.stat().st_mtime
    except (ImportError, OSError):
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale build lock %s (%.0f s old; its holder died)", lock, age)
        lock.unlink(missing_ok=True)


def _find_ninja() -> None:
    """torch runs `ninja` from PATH; the pip-installed one sits beside this Python, which
    is not on PATH when the venv is not activated (`.venv/bin/python -m ...`)."""
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        if os.path.exists(os.path.join(scripts, "ninja")):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def all_extensions() -> list[CpuExtension]:
    from engine.layers import cpu_fused_ops, cpu_paged_attention
    return [cpu_paged_attention.EXTENSION, cpu_fused_ops.EXTENSION]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for ext in all_extensions():
        mod = ext.load()
        print(f"{ext.what}: {mod.__file__ if mod else 'unavailable: ' + str(ext.failed)}")
