"""The selector behind every measured kernel choice (engine/layers/kernel_select.py): it
takes the fastest candidate by the timer's word (timings are injected here, never taken),
and a candidate that fails to build, load or run is skipped with a warning naming it."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.layers.kernel_select import Candidate, NoCandidate, fastest


def _runs(name: str) -> Candidate:
    return Candidate(name, lambda: (lambda: name))      # a call returns its own name


@given(st.dictionaries(st.sampled_from("abcdefgh"), st.floats(1e-9, 10.0), min_size=1))
def test_the_fastest_candidate_by_the_timings_is_taken(times):
    best, timed = fastest("op", [_runs(n) for n in times], timer=lambda call: times[call()])
    assert timed == times
    assert times[best] == min(times.values())


def _fails_to_build() -> Candidate:
    def load():
        raise RuntimeError("g++: error: unrecognized option -mamx-tile")
    return Candidate("amx", load)


def test_a_candidate_that_cannot_build_or_load_is_skipped_with_a_warning(caplog):
    times = {"onednn": 2.0, "bf16_gemm": 3.0}
    with caplog.at_level(logging.WARNING, logger="engine.layers.kernel_select"):
        best, timed = fastest("linear [8, 4]", [_fails_to_build(), _runs("bf16_gemm"),
                                                _runs("onednn")],
                              timer=lambda call: times[call()])
    assert (best, set(timed)) == ("onednn", {"onednn", "bf16_gemm"})
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "amx" in warned[0] and "-mamx-tile" in warned[0]
    assert "linear [8, 4]" in warned[0]


def test_a_candidate_that_fails_when_run_is_skipped(caplog):
    def timer(call):
        name = call()
        if name == "tiles":
            raise ValueError("illegal instruction in the timed call")
        return {"sdpa": 5.0, "rows": 1.0}[name]
    with caplog.at_level(logging.WARNING, logger="engine.layers.kernel_select"):
        best, timed = fastest("attention", [_runs("tiles"), _runs("sdpa")], timer=timer)
    assert (best, list(timed)) == ("sdpa", ["sdpa"])
    assert any("tiles" in r.getMessage() for r in caplog.records)


def test_no_candidate_that_runs_is_a_clear_error():
    with pytest.raises(NoCandidate, match="amx: g\\+\\+: error"):
        fastest("linear [8, 4]", [_fails_to_build()], timer=lambda call: 1.0)
