"""A node's metrics (cluster/node_metrics.py) over a real engine run by a real EngineLoop,
read back through prometheus_client's own text parser: token counters by the exact count,
prefix-cache queries and hits, running/waiting and KV usage back at rest, the per-request
histograms of an aggregated-style request (cluster/request_timing.py), graph replays, MTP
acceptance per position, and a decode node's reservations with a lease expiry."""

from __future__ import annotations

import queue
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.engine_loop import EngineLoop
from cluster.kv_transfer.kv_receiver import KvReceiver
from cluster.node_metrics import NodeMetrics
from cluster.request_timing import RequestTimer
from engine.commands import AddRequest
from engine.config import EngineConfig
from engine.engine_core import LLMEngine
from engine.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, random_prompts
from tests.tiny_mtp import with_mtp

BS = 4
OPTS = dict(dtype="float32", block_size=BS, num_gpu_blocks=64, max_num_seqs=4)
PROMPT = random_prompts(1, [9], 320, seed=3)[0]        # 2 full blocks + 1 token
MAX_NEW = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base, _ = make_tiny_model("qwen3-qknorm-hd24", root)
    return with_mtp(base, root / "qwen3-mtp")


def scrape(metrics: NodeMetrics) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without role/node) -> value; every sample must carry
    the node's role and node labels."""
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            labels = dict(s.labels)
            assert (labels.pop("role"), labels.pop("node")) == (metrics.role, metrics.node_id)
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def run(engine: LLMEngine, metrics: NodeMetrics, prompts: list[list[int]],
        timers: list[RequestTimer] | None = None) -> None:
    """Each prompt to its finish, one after the other, through an EngineLoop whose
    observer is the metrics snapshot; timers (if given) see the outputs as a node would."""
    outputs: queue.Queue = queue.Queue()
    loop = EngineLoop(engine, outbox=lambda outs: [outputs.put(o) for o in outs],
                      observer=metrics.observer).start()
    try:
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
            seq = engine.submit(AddRequest(rid, prompt, params)).result(timeout=30)
            timer = timers[i] if timers else RequestTimer(None)
            timer.seq = seq
            while True:
                out = outputs.get(timeout=30)
                assert out.request_id == rid
                timer.tokens(len(out.token_ids), self_prefilled=True)
                if out.finished:
                    timer.finished(out.finish_reason)
                    break
    finally:
        loop.stop()


def test_counters_move_by_the_exact_amounts_and_gauges_return_to_rest(folder):
    engine = LLMEngine(EngineConfig(model=str(folder), **OPTS))
    metrics = NodeMetrics("aggregated", "agg-0", engine)
    before = scrape(metrics)
    assert before[("pdserve_prompt_tokens_total", ())] == 0
    timers = [RequestTimer(metrics), RequestTimer(metrics)]
    run(engine, metrics, [PROMPT, PROMPT], timers)
    got = scrape(metrics)
    assert got[("pdserve_prompt_tokens_total", ())] == 2 * len(PROMPT)
    assert got[("pdserve_generation_tokens_total", ())] == 2 * MAX_NEW
    assert got[("pdserve_prefix_cache_queries_total", ())] == 2 * len(PROMPT)
    # the second prompt finds its two full blocks (the last token is always computed)
    assert got[("pdserve_prefix_cache_hits_total", ())] == 2 * BS
    assert got[("pdserve_num_preemptions_total", ())] == 0
    assert got[("pdserve_num_requests_running", ())] == 0
    assert got[("pdserve_num_requests_waiting", ())] == 0
    assert got[("pdserve_kv_cache_usage_perc", ())] == 0.0
    assert got[("pdserve_kv_cache_total_blocks", ())] == OPTS["num_gpu_blocks"] - 1
    for name in ("queue_time", "prefill_time", "decode_time", "time_per_output_token"):
        assert got[(f"pdserve_request_{name}_seconds_count", ())] == 2, name
    assert got[("pdserve_e2e_request_latency_seconds_count", ())] == 2
    assert got[("pdserve_request_success_total", (("finished_reason", "length"),))] == 2
    assert ("pdserve_reservations", (("state", "reserved"),)) not in got   # not a decode node


def test_graph_replays_and_mtp_acceptance_per_position(folder):
    engine = LLMEngine(EngineConfig(model=str(folder), enable_graph=True,
                                    speculative_method="mtp", num_speculative_tokens=2, **OPTS))
    metrics = NodeMetrics("decode", "dec-0", engine)
    run(engine, metrics, [PROMPT])
    got = scrape(metrics)
    assert got[("pdserve_generation_tokens_total", ())] == MAX_NEW
    assert got[("pdserve_graph_captures_total", ())] >= 1
    assert got[("pdserve_graph_replays_total", ())] >= 1
    drafts = got[("pdserve_spec_decode_num_drafts_total", ())]
    assert drafts >= 1
    proposed = [got[("pdserve_spec_decode_num_proposed_tokens_per_pos_total",
                     (("position", str(p)),))] for p in (0, 1)]
    accepted = [got[("pdserve_spec_decode_num_accepted_tokens_per_pos_total",
                     (("position", str(p)),))] for p in (0, 1)]
    assert proposed[0] == drafts and all(a <= p for a, p in zip(accepted, proposed, strict=True))
    assert sum(accepted) == got[("pdserve_spec_decode_num_accepted_tokens_total", ())]
    assert got[("pdserve_spec_decode_num_draft_tokens_total", ())] == sum(proposed)


def test_reservations_by_state_and_a_lease_expiry(folder):
    engine = LLMEngine(EngineConfig(model=str(folder), **OPTS))
    receiver = KvReceiver(engine, default_lease_s=30.0)
    metrics = NodeMetrics("decode", "dec-0", engine, receiver=receiver)
    # no loop attached: the engine applies the reserve command at once
    receiver.reserve("r0", PROMPT, SamplingParams(max_tokens=4)).result(timeout=0)
    held = scrape(metrics)
    assert held[("pdserve_reservations", (("state", "reserved"),))] == 1
    assert held[("pdserve_reservation_lease_expiries_total", ())] == 0
    expired = receiver.expire(now=float("inf"))
    assert [r.request_id for r in expired] == ["r0"]
    got = scrape(metrics)
    assert got[("pdserve_reservations", (("state", "reserved"),))] == 0
    assert got[("pdserve_reservation_lease_expiries_total", ())] == 1
    assert got[("pdserve_reservation_transitions_total",
                (("reason", "lease expired"), ("state", "released")))] == 1


def test_every_metric_the_dashboard_and_the_alerts_read_is_exported(folder):
    from router.metrics import RouterMetrics
    from router.node_pool import NodePool
    from tests.deploy.test_grafana_dashboard import dashboard_metric_names, exported_sample_names
    from tests.deploy.test_prometheus_rules import alert_metric_names

    engine = LLMEngine(EngineConfig(model=str(folder), enable_graph=True,
                                    speculative_method="mtp", num_speculative_tokens=2, **OPTS))
    node = NodeMetrics("decode", "dec-0", engine, receiver=KvReceiver(engine))
    texts = [node.render().decode(), RouterMetrics(NodePool()).render().decode()]
    exported = set()
    for text in texts:
        exported |= exported_sample_names(text_string_to_metric_families(text))
    missing = dashboard_metric_names() - exported
    assert not missing, sorted(missing)
    missing = alert_metric_names() - exported
    assert not missing, sorted(missing)


def _family_names(texts: list[str]) -> set[str]:
    """Metric names, without prometheus_client's `*_created` timestamps of each counter
    and histogram (the parser reports them as families of their own)."""
    return {f.name for text in texts for f in text_string_to_metric_families(text)
            if not f.name.endswith("_created")}


def test_docs_operations_names_exactly_the_exported_metrics(folder, tmp_path):
    """docs/OPERATIONS.md describes every metric a router or a node exports, and no other
    (names compared without the _total / _bucket / _count / _sum sample suffixes)."""
    import re
    from pathlib import Path

    from router.metrics import RouterMetrics
    from router.node_pool import NodePool

    engine = LLMEngine(EngineConfig(model=str(folder), enable_graph=True,
                                    speculative_method="mtp", num_speculative_tokens=2, **OPTS))
    from cluster.core_share import CoreShare
    from cluster.kv_transfer.handoff import TurnHandoffs

    node = NodeMetrics("decode", "dec-0", engine, receiver=KvReceiver(engine),
                       core_share=CoreShare(tmp_path / "cores.lock"), handoffs=TurnHandoffs())
    exported = _family_names([node.render().decode(),
                              RouterMetrics(NodePool()).render().decode()])
    doc = (Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md").read_text()
    documented = {re.sub(r"_(total|bucket|count|sum)$", "", name)
                  for name in re.findall(r"\bpdserve_[a-z0-9_]+", doc)
                  if not name.endswith("_")}          # `pdserve_router_*`, `pdserve_`
    assert exported - documented == set(), "exported but not in docs/OPERATIONS.md"
    assert documented - exported == set(), "in docs/OPERATIONS.md but not exported"


def test_turns_and_wait_on_shared_cores(folder, tmp_path):
    from cluster.core_share import CoreShare
    from tests.cluster.test_core_share import _queued, _until

    lock = tmp_path / "cores.lock"
    other, ours = CoreShare(lock), CoreShare(lock)   # another node's step, and this node
    engine = LLMEngine(EngineConfig(model=str(folder), **OPTS))
    metrics = NodeMetrics("decode", "dec-0", engine, core_share=ours)
    plain = scrape(NodeMetrics("decode", "dec-1", engine))
    assert not any(name.startswith("pdserve_core_share") for name, _ in plain)
    assert scrape(metrics)[("pdserve_core_share_wait_seconds_total", ())] == 0
    outputs: queue.Queue = queue.Queue()
    other.request(lambda: None)
    assert other.held
    loop = EngineLoop(engine, outbox=lambda outs: [outputs.put(o) for o in outs],
                      observer=metrics.observer, step_gate=ours).start()
    try:
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        engine.submit(AddRequest("r0", PROMPT, params)).result(timeout=30)
        _until(lambda: _queued(lock), "the node waits for its turn")
        held_s = 0.2
        time.sleep(held_s)                   # the other node's step goes on
        other.release()
        while not outputs.get(timeout=30).finished:
            pass
    finally:
        loop.stop()
        other.close()
    got = scrape(metrics)
    assert got[("pdserve_core_share_turns_total", ())] >= 1
    assert got[("pdserve_core_share_wait_seconds_total", ())] >= held_s


def test_a_prefill_nodes_turn_kept_for_its_pushes_is_exported(folder, tmp_path):
    from cluster.core_share import CoreShare
    from cluster.kv_transfer.handoff import TurnHandoffs

    handoffs = TurnHandoffs()
    engine = LLMEngine(EngineConfig(model=str(folder), **OPTS))
    metrics = NodeMetrics("prefill", "pre-0", engine, core_share=CoreShare(tmp_path / "l"),
                          handoffs=handoffs)
    close = handoffs.open()
    assert not handoffs.wait(0.05)                       # a push that does not deliver
    close()
    got = scrape(metrics)
    assert got[("pdserve_core_share_push_hold_timeouts_total", ())] == 1
    assert got[("pdserve_core_share_push_hold_seconds_total", ())] >= 0.05


def test_the_kernels_chosen_by_measurement_are_exported(folder, tmp_path, monkeypatch):
    """pdserve_cpu_kernel_choice: one sample per choice this process took (measured or read
    from the machine's cache), labelled with what it was for and the kernel."""
    from engine.layers import kernel_choice
    cache = kernel_choice.ChoiceCache(tmp_path / "choices.json")
    monkeypatch.setattr(kernel_choice, "CHOICES", cache)
    engine = LLMEngine(EngineConfig(model=str(folder), **OPTS))
    cache.choose("bf16_linear gemm [96, 64] decode x2 build", lambda: "onednn")
    cache.choose("bf16_prefill_attention [4, 2, 64] block 16 build", lambda: "sdpa")
    got = {labels: v for (name, labels), v in scrape(NodeMetrics("decode", "dec-0", engine)).items()
           if name == "pdserve_cpu_kernel_choice"}
    made = cache.made()
    assert made["bf16_linear gemm [96, 64] decode x2 build"] == "onednn"
    assert made["bf16_prefill_attention [4, 2, 64] block 16 build"] == "sdpa"
    # the float32 engine's own choices: its small-row linears (linear_choice)
    assert any(c.startswith("f32_linear ") for c in made)
    assert got == {(("choice", c), ("kernel", k)): 1.0 for c, k in made.items()}
