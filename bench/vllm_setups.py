"""vLLM's CPU backend as the peer: the setups every benchmark runs it in.

    vllm-default  as installed: vLLM reserves a core for its frontend and binds its OpenMP
                  threads to the rest
    vllm-2t       every core for compute (VLLM_CPU_OMP_THREADS_BIND=0-<n-1>,
                  VLLM_CPU_NUM_OF_RESERVED_CPU=0)
    vllm-tuned    vllm-2t plus what vLLM's CPU installation docs recommend for speed:
                  LD_PRELOAD of TCMalloc (Debian's libtcmalloc-minimal4) and of the Intel
                  OpenMP runtime (libiomp5.so from the intel-openmp wheel in .venv-peer)

A ratio's denominator is the best of the setups that ran, so pdserve is held to vLLM at its
best on the machine, not to one configuration of it. A setup whose libraries are missing
is reported as missing (`make bench-peer` installs them), never silently replaced.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / ".venv-peer"
PEER_PYTHON = PEER / "bin" / "python"
TCMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                       "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
                       "/usr/lib64/libtcmalloc_minimal.so.4")
NAMES = ("vllm-2t", "vllm-default", "vllm-tuned")
WHAT = {
    "vllm-default": "vLLM's default CPU setup (a core reserved for its frontend)",
    "vllm-2t": "every core for compute",
    "vllm-tuned": "every core for compute, TCMalloc and Intel OpenMP preloaded "
                  "(vLLM's CPU docs)",
}


def tcmalloc() -> Path | None:
    return next((Path(p) for p in TCMALLOC_CANDIDATES if Path(p).exists()), None)


def iomp() -> Path | None:
    found = sorted(PEER.glob("lib/libiomp5.so"))
    return found[0] if found else None


def missing(name: str) -> str | None:
    """Why setup `name` cannot run here, or None."""
    if name != "vllm-tuned":
        return None
    gone = [what for what, lib in (("libtcmalloc_minimal.so.4 (apt: libtcmalloc-minimal4)",
                                    tcmalloc()),
                                   ("libiomp5.so in .venv-peer (pip: intel-openmp)", iomp()))
            if lib is None]
    return f"missing {', '.join(gone)}: run `make bench-peer`" if gone else None


def env(name: str, n_cpus: int) -> dict[str, str]:
    """The environment setup `name` adds to vLLM's process."""
    all_cores = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{max(n_cpus - 1, 0)}",
                 "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if name == "vllm-default":
        return {}
    if name == "vllm-2t":
        return all_cores
    if name == "vllm-tuned":
        why = missing(name)
        if why:
            raise RuntimeError(f"vllm-tuned: {why}")
        return {**all_cores, "LD_PRELOAD": f"{tcmalloc()}:{iomp()}"}
    raise ValueError(f"unknown vLLM setup {name!r}; known: {', '.join(NAMES)}")
