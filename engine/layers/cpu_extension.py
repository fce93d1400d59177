"""The C++ CPU kernels: one extension built on first use from engine/csrc/cpu/*.cpp (g++
and ninja), cached under ~/.cache/torch_extensions, its ops registered as
torch.ops.pdserve.* (engine/csrc/cpu/bindings.cpp), with a torch fallback when it cannot
be built.

The sources are real files: `ops.h` declares every kernel's entry point, `vec.h` holds
what they share (bf16 conversion, the exp polynomial), one file per kernel family, and
`bindings.cpp` the op schemas. Each file is compiled with its own floating-point flags
(SOURCES below: the attention kernels with -ffast-math, the fused ops and the fixed-order
linear with -ffp-contract=off, which their bit-exactness needs) and all are linked into one
.so, so the one-call decode layers call the other kernels as declared functions. We write
the build.ninja ourselves (torch's cpp_extension gives one set of flags to every file) and
load the result with torch.ops.load_library. The build folder's name carries the CPU
capability and a hash of the sources, the flags and the torch install, so another source
or torch never loads a stale build, and the runtime switches (PDSERVE_CPU_*) never change
what is built. `compile_commands.json` is written into the build folder, and
`python -m engine.layers.cpu_extension --compile-commands` copies it to the repository
root for clangd.

    python -m engine.layers.cpu_extension

builds (or loads) it in one process: `make test` and `make up` run it first, so the nodes
and test processes that start together later only load the build (never race to build).
A node loads its kernels before it serves (launch/node_main.py), so a build never lands
on live requests. Each kernel module (engine/layers/cpu_*.py) holds a `KernelFamily` view
of the one extension: `load()` returns the ops namespace or None, `failed` the reason.
Whether a model uses a kernel is not decided here: the model's layers take a
KernelOptions value at construction (engine/layers/kernel_options.py).

Builds cannot hang a process (docs/RELIABILITY.md):
- builds are serialised by an flock on `pdserve-build.lock` in the build directory,
  waited on for at most `build_lock_timeout` (PDSERVE_KERNEL_BUILD_TIMEOUT, 600 s) and
  then refused with KernelBuildLockTimeout naming the lock and its holder. The kernel
  releases an flock when its holder dies, so a killed build never blocks the next;
- a `lock` file left in the build directory (torch's FileBaton, from older builds) found
  while holding the flock belongs to a dead process: it is removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
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
CSRC = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
LIBRARY = "pdserve_cpu.so"
# each source and its own flags, on top of COMMON_FLAGS
SOURCES = {
    "paged_attention.cpp": ["-ffast-math", "-fno-finite-math-only"],
    "paged_attention_amx.cpp": ["-ffast-math", "-fno-finite-math-only"],
    "paged_attention_f32.cpp": ["-ffast-math", "-fno-finite-math-only"],
    "prefill_attention.cpp": ["-ffast-math", "-fno-finite-math-only"],
    "prefill_attention_brgemm.cpp": ["-ffast-math", "-fno-finite-math-only"],
    "latent_attention.cpp": ["-fno-math-errno"],
    "fused_ops.cpp": ["-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd"],
    "bf16_gemm.cpp": ["-fno-math-errno"],
    "bf16_gemm_brgemm.cpp": ["-fno-math-errno"],
    "decode_layers.cpp": ["-fno-math-errno"],
    "fixed_order_linear.cpp": ["-ffp-contract=off"],
    "top_k_top_p.cpp": ["-fno-math-errno"],
    "bindings.cpp": [],
}
HEADERS = ("cost_split.h", "ops.h", "paged_decode_common.h", "prefill_common.h", "vec.h")
# -march=native: the build is for this CPU (the folder name carries its capability);
# PDSERVE_CPU_MARCH=<arch> builds for a named target instead (a container image built for
# its target ISA: deploy/docker/Dockerfile), and the folder name carries that.
MARCH_ENV = "PDSERVE_CPU_MARCH"
# -fopenmp links libgomp.so.1, which in a process that imported torch first resolves to
# torch's own copy (one runtime in /proc/self/maps): worth it for big calls, but a
# parallel region in a small call waits for a second thread to be scheduled (ms on a
# loaded box), so kernels keep small calls inline
COMMON_FLAGS = ["-O3", "-fPIC", "-std=c++20", "-fopenmp"]


def march() -> str:
    value = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(f"{MARCH_ENV} must name a -march target, got {value!r}")
    return value


class KernelBuildLockTimeout(RuntimeError):
    """Another live process held the build lock for longer than the bound."""


class CpuKernels:
    """The one extension: build (or load) once per process, then its ops namespace."""

    def __init__(self, csrc: Path = CSRC, sources: dict[str, list[str]] | None = None,
                 headers: tuple[str, ...] = HEADERS, namespace: str = "pdserve"):
        self.csrc = csrc
        self.sources = SOURCES if sources is None else sources
        self.headers = headers
        self.namespace = namespace
        self.ops = None                 # torch.ops.<namespace> once loaded
        self.failed: str | None = None
        self._lock = threading.Lock()

    def build_name(self) -> str:
        """pdserve_cpu_<cpu capability or -march target>_<hash of the sources, flags and
        torch install>."""
        arch = march()
        cap = torch.backends.cpu.get_cpu_capability().lower() if arch == "native" else arch
        h = hashlib.sha256()
        for name in sorted([*self.sources, *self.headers]):
            h.update(name.encode() + b"\0" + (self.csrc / name).read_bytes() + b"\0")
        h.update("\0".join([*COMMON_FLAGS, arch, repr(sorted(self.sources.items())),
                            torch.__version__, os.path.dirname(torch.__file__)]).encode())
        return f"pdserve_cpu_{cap}_{h.hexdigest()[:12]}"

    def build_dir(self) -> Path:
        from torch.utils.cpp_extension import _get_build_directory
        return Path(_get_build_directory(self.build_name(), verbose=False))

    def load(self, build_lock_timeout: float | None = None):
        """torch.ops.<namespace>, or None when the extension cannot be built here (the
        reason in `failed`, logged once as an error). Raises KernelBuildLockTimeout when
        another process's build holds the lock longer than `build_lock_timeout` (default:
        $PDSERVE_KERNEL_BUILD_TIMEOUT or 600 s)."""
        if self.ops is not None or self.failed is not None:
            return self.ops
        with self._lock:
            if self.ops is not None or self.failed is not None:
                return self.ops
            try:
                build_dir = self.build_dir()
            except Exception as exc:   # noqa: BLE001 - no cpp_extension: the torch path
                self.failed = f"{type(exc).__name__}: {exc}"
                log.error("CPU kernels unavailable (%s); the slower torch path runs",
                          self.failed)
                return None
            timeout = lock_timeout() if build_lock_timeout is None else build_lock_timeout
            with build_lock(build_dir, timeout, "CPU kernels"):
                try:
                    library = build_dir / LIBRARY
                    if not library.exists():
                        log.info("CPU kernels: building %s (a few minutes, once)", build_dir)
                        self._build(build_dir)
                    torch.ops.load_library(str(library))
                    self.ops = getattr(torch.ops, self.namespace)
                except Exception as exc:   # no compiler, no ninja, a build error
                    self.failed = _short(exc)
                    log.error("CPU kernels unavailable (%s); the slower torch path runs "
                              "instead", self.failed)
        return self.ops

    def _build(self, build_dir: Path) -> None:
        from torch.utils.cpp_extension import include_paths, library_paths
        _find_ninja()
        includes = " ".join(f"-isystem {p}" for p in include_paths())
        lines = ["ninja_required_version = 1.3", "cxx = c++",
                 f"cflags = {' '.join(COMMON_FLAGS)} -march={march()} -I{self.csrc} "
                 f"{includes}",
                 f"ldflags = -shared -fopenmp -L{library_paths()[0]} -lc10 -ltorch_cpu -ltorch",
                 "rule compile",
                 "  command = $cxx -MMD -MF $out.d $cflags $extra -c $in -o $out",
                 "  depfile = $out.d", "  deps = gcc",
                 "rule link", "  command = $cxx $in $ldflags -o $out"]
        objects = []
        for name, flags in self.sources.items():
            obj = name.replace(".cpp", ".o")
            objects.append(obj)
            lines += [f"build {obj}: compile {self.csrc / name}",
                      f"  extra = {' '.join(flags)}"]
        lines += [f"build {LIBRARY}: link {' '.join(objects)}", f"default {LIBRARY}", ""]
        (build_dir / "build.ninja").write_text("\n".join(lines))
        done = subprocess.run(["ninja", "-C", str(build_dir)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the build failed:\n{done.stdout[-4000:]}{done.stderr[-2000:]}")
        compdb = subprocess.run(["ninja", "-C", str(build_dir), "-t", "compdb", "compile"],
                                capture_output=True, text=True)
        if compdb.returncode == 0:
            (build_dir / "compile_commands.json").write_text(compdb.stdout)


class KernelFamily:
    """One kernel module's view of the one extension (its name in log lines and reports)."""

    def __init__(self, what: str, kernels: CpuKernels | None = None):
        self.what = what
        self.kernels = KERNELS if kernels is None else kernels

    def load(self, build_lock_timeout: float | None = None):
        return self.kernels.load(build_lock_timeout)

    @property
    def failed(self) -> str | None:
        return self.kernels.failed


def _short(exc: Exception) -> str:
    """The exception and the lines of a compiler's output that say what went wrong."""
    text = str(exc).strip()
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    return f"{type(exc).__name__}: " + ("; ".join(errors[:3]) if errors else text[-500:])


KERNELS = CpuKernels()


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


def all_families() -> list[KernelFamily]:
    from engine.layers import (
        cpu_bf16_gemm,
        cpu_decode_layers,
        cpu_fixed_order_linear,
        cpu_fused_ops,
        cpu_latent_attention,
        cpu_paged_attention,
        cpu_prefill_attention,
    )
    return [cpu_paged_attention.EXTENSION, cpu_fused_ops.EXTENSION, cpu_decode_layers.EXTENSION,
            cpu_prefill_attention.EXTENSION, cpu_bf16_gemm.EXTENSION,
            cpu_fixed_order_linear.EXTENSION, cpu_latent_attention.EXTENSION]


def preload(options) -> dict[str, bool]:
    """Build or load now the extension when `options` (a KernelOptions narrowed to the
    device) turn a kernel on: kernel family -> usable here. A process that calls this before
    serving never builds later. May raise KernelBuildLockTimeout."""
    wanted = (options.cpu_attention_kernel or options.cpu_fused_ops
              or options.cpu_bf16_gemm or options.batch_invariant)
    if not wanted:
        return {}
    KERNELS.load()
    return kernel_report()


def kernel_report() -> dict[str, bool]:
    """Kernel family -> whether it runs here (built, and this CPU has what it needs)."""
    from engine.layers import cpu_bf16_gemm, cpu_paged_attention, cpu_prefill_attention
    if KERNELS.load() is None:
        return {f.what: False for f in all_families()}
    needs_isa = {cpu_bf16_gemm.EXTENSION.what: cpu_bf16_gemm.available(),
                 cpu_prefill_attention.EXTENSION.what:
                     bool(KERNELS.ops.prefill_attention_available()),
                 cpu_paged_attention.EXTENSION.what: True}
    return {f.what: needs_isa.get(f.what, True) for f in all_families()}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    p = argparse.ArgumentParser(description="Build (or load) the CPU kernels and report them.")
    p.add_argument("--compile-commands", action="store_true",
                   help="also copy the build's compile_commands.json to the repository root")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ops = KERNELS.load()
    report = kernel_report()
    from engine.layers import kernel_choice
    build = KERNELS.build_name()    # choices kept for other builds of the kernels are stale
    choices = {k.replace(f" {build}", ""): v for k, v in kernel_choice.CHOICES.kept().items()
               if k.endswith(build)}
    if args.json:
        print(json.dumps({"build": str(KERNELS.build_dir()) if ops else None,
                          "failed": KERNELS.failed, "kernels": report,
                          "machine": kernel_choice.machine_key(), "choices": choices},
                         indent=2))
    else:
        where = KERNELS.build_dir() / LIBRARY if ops else f"unavailable: {KERNELS.failed}"
        print(f"CPU kernels: {where}")
        for what, ok in report.items():
            print(f"  {what}: {'yes' if ok else 'no'}")
        print(f"Chosen by measurement on this machine ({kernel_choice.machine_key()}, this "
              f"build; kept in {kernel_choice.cache_path()}):")
        for key, name in sorted(choices.items()):
            print(f"  {key}: {name}")
        if not choices:
            print("  none yet: a model's first load measures them")
    if args.compile_commands and ops is not None:
        root = CSRC.parent.parent.parent
        shutil.copy(KERNELS.build_dir() / "compile_commands.json",
                    root / "compile_commands.json")
    return 0 if ops is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
