"""Every node's /metrics, end to end: real node processes, real gRPC, a real etcd.

A prefill + decode pair behind a router (pdserve's LocalCluster) and an aggregated node
serve one request each; each process's /metrics (the nodes' --metrics-listen, the router's
HTTP port) parses with prometheus_client's own parser, every series of a node carries its
role and node id, and each counter named in docs/OPERATIONS.md moved by the expected amount:
tokens by the exact count on each side, the KV push by the exact bytes of the prompt's
blocks, one observation per request histogram, a reservation admitted and none left. The
Grafana dashboard reads only metric names these processes export.
"""

from __future__ import annotations

import json
import re
import secrets
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cluster.proto_convert import sampling_to_proto
from engine.kv_cache import KVCache
from engine.models.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from launch.etcd_server import free_port
from protos import node_pb2, node_pb2_grpc
from tests.deploy.test_grafana_dashboard import dashboard_metric_names, exported_sample_names
from tests.deploy.test_prometheus_rules import alert_metric_names
from tests.integration.router_harness import MODEL, NODE_ARGS, start_cluster, wait_for
from tests.tiny_models import random_prompts
from tests.tiny_mtp import with_mtp

pytestmark = pytest.mark.timeout(600)
BLOCK_SIZE = 4                    # NODE_ARGS' --block-size
PD_PROMPT, AGG_PROMPT = random_prompts(2, [11, 7], 320, seed=41)
PD_TOKENS, AGG_TOKENS = 8, 5
TRACING = ["--otel-exporter", "console"]


def scrape(url: str) -> tuple[str, dict[tuple[str, tuple], float]]:
    """(text, {(sample name, sorted labels): value}) of a /metrics URL."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def node_samples(url: str, role: str, node: str) -> dict[tuple[str, tuple], float]:
    """A node's samples without its role/node labels, which every series must carry."""
    out = {}
    for (name, labels), value in scrape(url)[1].items():
        rest = dict(labels)
        assert (rest.pop("role", None), rest.pop("node", None)) == (role, node), name
        out[(name, tuple(sorted(rest.items())))] = value
    return out


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def pd(folder, tmp_path_factory):
    ports = {"prefill": free_port(), "decode": free_port()}
    # tracing on (spans as JSON in each process's log): one trace across the processes
    cluster = start_cluster(
        folder, tmp_path_factory.mktemp("cluster-metrics"), prefill=1, decode=1,
        node_args=[*NODE_ARGS, *TRACING], router_args=TRACING,
        prefill_args=["--metrics-listen", f"127.0.0.1:{ports['prefill']}"],
        decode_args=["--metrics-listen", f"127.0.0.1:{ports['decode']}"])
    yield cluster, {role: f"http://127.0.0.1:{p}/metrics" for role, p in ports.items()}
    cluster.stop()


def _complete(http_url: str, prompt: list[int], max_tokens: int,
              headers: dict | None = None) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(f"{http_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_a_pd_request_moves_each_node_and_router_metric_by_the_expected_amount(pd, folder):
    cluster, urls = pd
    router_url = f"{cluster.http_url}/metrics"
    pre0 = node_samples(urls["prefill"], "prefill", "prefill-0")
    dec0 = node_samples(urls["decode"], "decode", "decode-0")
    rtr0 = scrape(router_url)[1]

    usage = _complete(cluster.http_url, PD_PROMPT, PD_TOKENS)["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PD_PROMPT), PD_TOKENS)

    (decode_address,) = [n.ready() for n in cluster.nodes if n.role == "decode"]
    # the engines' counters are a snapshot each engine thread takes after its pass: wait
    # until both have taken the one after this request's last step
    done = lambda: delta(node_samples(urls["decode"], "decode", "decode-0"), dec0,
                         "pdserve_e2e_request_latency_seconds_count") == 1 and delta(
        node_samples(urls["prefill"], "prefill", "prefill-0"), pre0,
        "pdserve_generation_tokens_total") >= 1
    assert wait_for(done, 10)
    pre = node_samples(urls["prefill"], "prefill", "prefill-0")
    dec = node_samples(urls["decode"], "decode", "decode-0")
    rtr = scrape(router_url)[1]

    # the prefill node: the prompt, its one sampled token, the push of all its blocks
    mc = ModelConfig.from_folder(folder)
    blocks = -(-len(PD_PROMPT) // BLOCK_SIZE)
    push_bytes = blocks * KVCache.bytes_per_block(mc.num_hidden_layers, BLOCK_SIZE,
                                                  mc.num_key_value_heads, mc.head_dim,
                                                  torch.float32)
    for name, want in [("pdserve_prompt_tokens_total", len(PD_PROMPT)),
                       ("pdserve_generation_tokens_total", 1),
                       ("pdserve_prefix_cache_queries_total", len(PD_PROMPT)),
                       ("pdserve_request_queue_time_seconds_count", 1),
                       ("pdserve_request_prefill_time_seconds_count", 1),
                       ("pdserve_e2e_request_latency_seconds_count", 1)]:
        assert delta(pre, pre0, name) == want, name
    assert delta(pre, pre0, "pdserve_kv_push_bytes_total", peer=decode_address) == push_bytes
    assert delta(pre, pre0, "pdserve_kv_push_seconds_count", peer=decode_address) == 1
    assert not [k for k in pre if k[0] == "pdserve_kv_push_failures_total"]
    assert pre[("pdserve_num_requests_running", ())] == 0

    # the decode node: the pushed prompt, every token the client got, one reservation
    for name, want in [("pdserve_prompt_tokens_total", len(PD_PROMPT)),
                       ("pdserve_generation_tokens_total", PD_TOKENS),
                       ("pdserve_request_decode_time_seconds_count", 1),
                       ("pdserve_request_time_per_output_token_seconds_count", 1),
                       ("pdserve_request_queue_time_seconds_count", 0)]:
        assert delta(dec, dec0, name) == want, name
    assert delta(dec, dec0, "pdserve_request_success_total", finished_reason="length") == 1
    assert delta(dec, dec0, "pdserve_reservation_transitions_total", state="admitted",
                 reason="none") == 1
    assert delta(dec, dec0, "pdserve_reservation_lease_expiries_total") == 0
    assert {k[1]: v for k, v in dec.items() if k[0] == "pdserve_reservations"} == {
        (("state", s),): 0.0 for s in ("reserved", "receiving", "admitted", "released")}
    assert wait_for(lambda: node_samples(urls["decode"], "decode", "decode-0")[
        ("pdserve_kv_cache_usage_perc", ())] == 0.0, 10)

    # the router: one request end to end, its finish, both roles ready, no failed attempt
    assert delta(rtr, rtr0, "pdserve_router_e2e_request_latency_seconds_count",
                 endpoint="completions") == 1
    assert delta(rtr, rtr0, "pdserve_router_finished_requests_total",
                 finish_reason="length") == 1
    assert {dict(k[1])["role"]: v for k, v in rtr.items()
            if k[0] == "pdserve_router_ready_nodes"} == {"prefill": 1, "decode": 1,
                                                         "aggregated": 0}
    assert not [k for k in rtr if k[0] == "pdserve_router_attempt_failures_total"]


def test_an_aggregated_node_with_mtp_and_graphs_and_the_dashboard_names(pd, folder, start_node,
                                                                       tmp_path):
    cluster, urls = pd
    port = free_port()
    node = start_node("aggregated", "--model", str(with_mtp(folder, tmp_path / "mtp")),
                      "--etcd", "none", *NODE_ARGS, "--enable-graph", "--speculative-method",
                      "mtp", "--num-speculative-tokens", "2",
                      "--metrics-listen", f"127.0.0.1:{port}", "--node-id", "agg-0")
    address = node.wait_ready()
    url = f"http://127.0.0.1:{port}/metrics"
    before = node_samples(url, "aggregated", "agg-0")
    params = SamplingParams(max_tokens=AGG_TOKENS, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(address) as ch:
        events = list(node_pb2_grpc.DecodeNodeStub(ch).Decode(node_pb2.ReserveRequest(
            request_id="agg-r1", prompt_token_ids=AGG_PROMPT,
            sampling=sampling_to_proto(params), self_prefill=True), timeout=120))
    assert sum(len(e.tokens.token_ids) for e in events) == AGG_TOKENS
    after = node_samples(url, "aggregated", "agg-0")
    for name, want in [("pdserve_prompt_tokens_total", len(AGG_PROMPT)),
                       ("pdserve_generation_tokens_total", AGG_TOKENS),
                       ("pdserve_prefix_cache_queries_total", len(AGG_PROMPT)),
                       ("pdserve_request_queue_time_seconds_count", 1),
                       ("pdserve_request_prefill_time_seconds_count", 1),
                       ("pdserve_request_decode_time_seconds_count", 1),
                       ("pdserve_request_time_per_output_token_seconds_count", 1),
                       ("pdserve_e2e_request_latency_seconds_count", 1)]:
        assert delta(after, before, name) == want, name
    assert delta(after, before, "pdserve_request_success_total",
                 finished_reason="length") == 1
    assert not [k for k in after if k[0] == "pdserve_reservations"]
    # MTP: every draft round proposes at position 0; what was accepted is counted per
    # position and in total alike. Graphs: decode steps replayed.
    drafts = delta(after, before, "pdserve_spec_decode_num_drafts_total")
    assert drafts >= 1
    assert delta(after, before, "pdserve_spec_decode_num_proposed_tokens_per_pos_total",
                 position="0") == drafts
    assert sum(delta(after, before, "pdserve_spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(p)) for p in (0, 1)) == delta(
        after, before, "pdserve_spec_decode_num_accepted_tokens_total")
    assert delta(after, before, "pdserve_graph_replays_total") >= 1

    # the dashboard reads only what these four processes export
    exported = set()
    for target in (url, urls["prefill"], urls["decode"], f"{cluster.http_url}/metrics"):
        exported |= exported_sample_names(text_string_to_metric_families(scrape(target)[0]))
    missing = (dashboard_metric_names() | alert_metric_names()) - exported
    assert not missing, sorted(missing)


def traces(log: str, span: str) -> list[str]:
    """Trace ids of the spans named `span` in a log (ConsoleSpanExporter's JSON)."""
    return re.findall(rf'"name": "{re.escape(span)}",\s*"context": {{\s*"trace_id": '
                      rf'"0x([0-9a-f]{{32}})"', log)


def test_a_request_is_one_trace_across_router_prefill_and_decode(pd):
    cluster, _ = pd
    logs = {"router": cluster.router.log_path,
            **{n.role: n.log_path for n in cluster.nodes}}
    read = lambda who: logs[who].read_text(errors="replace")
    # Earlier tests in this module send requests through the same cluster and each
    # process flushes its spans on its own 5 s timer, so "the router's latest trace"
    # may be another request's: this one names its own trace with a client traceparent.
    trace = secrets.token_hex(16)
    _complete(cluster.http_url, PD_PROMPT[:5], 3,
              headers={"traceparent": f"00-{trace}-{secrets.token_hex(8)}-01"})
    roots = [("router", "pdserve.request"), ("prefill", "prefill_node.Prefill"),
             ("decode", "decode_node.Decode")]
    wait_for(lambda: all(trace in traces(read(who), span) for who, span in roots), 30)
    for who, span in roots:
        assert trace in traces(read(who), span), (who, span, read(who)[-3000:])
    for who, span in [("prefill", "prefill_node.Prefill"), ("decode", "decode_node.Decode")]:
        assert trace in traces(read(who), span), who
    for who, span in [("router", "router.prefill"), ("prefill", "kv_push"),
                      ("decode", "admission"), ("decode", "decode")]:
        assert trace in traces(read(who), span), (who, span)
