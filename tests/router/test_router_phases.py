"""The router's phase histogram (pdserve_router_request_phase_seconds): each request's time
before its first token, split into queue / reserve / prefill / first_token on a PD pair
and queue / aggregated on an aggregated node, one observation per phase and request."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from router.metrics import PhaseClock
from tests.router.pd_fakes import PROMPT, Shared, _collect, _expected, _run
from tests.router.test_router_aggregated_flow import FakeAggregated, _close, _mixed

NAME = "pdserve_router_request_phase_seconds"


def _counts(metrics) -> dict[str, float]:
    out = {}
    for phase in ("queue", "reserve", "prefill", "first_token", "aggregated"):
        v = metrics.registry.get_sample_value(f"{NAME}_count", {"phase": phase})
        if v:
            out[phase] = v
    return out


def test_a_pd_request_observes_each_phase_once_and_an_aggregated_one_its_own():
    async def main():
        shared = Shared()
        _, pd, servers = await _mixed(shared, [], pairs=1)
        pd_tokens = [await _collect(pd, f"p{i}", PROMPT, 4) for i in range(3)]
        pd_counts = _counts(pd.metrics)
        await _close(pd, servers)
        _, agg, servers = await _mixed(shared, [FakeAggregated()])
        agg_tokens = await _collect(agg, "a1", PROMPT, 4)
        agg_counts = _counts(agg.metrics)
        await _close(agg, servers)
        return pd_tokens, pd_counts, agg_tokens, agg_counts

    pd_tokens, pd_counts, agg_tokens, agg_counts = _run(main())
    assert all(t == _expected(PROMPT, 4) for t, _ in pd_tokens)
    assert agg_tokens[0] == _expected(PROMPT, 4)
    assert pd_counts == {"queue": 3, "reserve": 3, "prefill": 3, "first_token": 3}
    assert agg_counts == {"queue": 1, "aggregated": 1}


def test_phase_clock_observes_a_phase_once_from_the_end_of_the_previous_one():
    registry = CollectorRegistry()
    clock = PhaseClock(Histogram("t_phase_seconds", "test", ["phase"], registry=registry))
    clock.end("reserve")
    clock.end("first_token")
    clock.end("prefill")         # after the first token: still observed once, from then
    clock.end("prefill")
    clock.end("first_token")     # already ended: nothing
    counts = {p: registry.get_sample_value("t_phase_seconds_count", {"phase": p})
              for p in ("reserve", "first_token", "prefill")}
    assert counts == {"reserve": 1, "first_token": 1, "prefill": 1}
