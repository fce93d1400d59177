"""The fastest of a kernel's candidates on this machine, by timing them where they run.

A kernel tuned on one CPU lost 2x on another (the weight-streaming bf16 GEMM: ahead of
oneDNN on an AVX512-BF16 EPYC, half its speed on a Xeon whose oneDNN takes the AMX tiles;
the tiled prefill attention: ahead of SDPA on the EPYC, 4x behind it on that Xeon at
1,024 tokens). So where the engine has a choice it does not read a table: each candidate
is loaded, timed on the work it will do, and the fastest is taken. The callers keep the
result per machine (engine/layers/kernel_choice.py) and say what they timed.

A candidate that fails to load (its kernel did not build, this CPU lacks its ISA) or to
run is skipped with a warning naming it; the others still compete. Timings come from a
`timer`, which tests replace to check the choice without timing anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

PASSES = 3


@dataclass(frozen=True)
class Candidate:
    name: str
    # builds or loads the candidate and returns one timed call of it; raises where it
    # cannot run here
    load: Callable[[], Callable[[], object]]


class NoCandidate(RuntimeError):
    """No candidate of a choice could run on this machine."""


def best_of(call: Callable[[], object], passes: int = PASSES) -> float:
    """Seconds of the fastest of `passes` calls, after two untimed ones (first-call setup:
    oneDNN's primitive cache, lazy allocations)."""
    call()
    call()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def fastest(what: str, candidates: Sequence[Candidate],
            timer: Callable[[Callable[[], object]], float] | None = None
            ) -> tuple[str, dict[str, float]]:
    """(name of the fastest candidate that runs, seconds per candidate timed); `timer`
    defaults to best_of (looked up at the call, so a test can stand in for it)."""
    timer = timer or best_of
    times: dict[str, float] = {}
    skipped: list[str] = []
    for c in candidates:
        try:
            call = c.load()
            times[c.name] = timer(call)
        except Exception as exc:          # noqa: BLE001 - any failure skips the candidate
            skipped.append(f"{c.name}: {exc}")
            log.warning("%s: candidate %s skipped, it does not run here (%s)", what, c.name,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    if not times:
        raise NoCandidate(f"{what}: no candidate runs on this machine ({'; '.join(skipped)})")
    best = min(times, key=times.__getitem__)
    log.debug("%s: %s -> %s", what, ", ".join(f"{k} {v * 1e6:.0f} us"
                                               for k, v in times.items()), best)
    return best, times
