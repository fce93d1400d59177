"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Under the (git-ignored) venv: reused across runs, never committed, gone with `make clean`.
DEFAULT_MODEL_CACHE = REPO / ".venv" / "pdserve-cache"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct HF folder (converted from the GGUF on first use)."""
    from launch.default_model import prepare_default_model

    return prepare_default_model(DEFAULT_MODEL_CACHE, progress=False)


# ---- tiers (markers registered in pyproject.toml) -----------------------------------------
# Every test gets one tier marker from its folder: tests/integration and the tests that start
# real processes -> `cluster`, tests/fault -> `fault`, everything else (tests/<package>/,
# tests/security's in-process tests, tests/deploy's static checks) -> `unit`. Unit tests
# listed in SLOW (or marked @pytest.mark.slow in their file) also get `slow`; `make
# test-fast` runs `-m "unit and not slow"`, `make test` runs everything.
TESTS = Path(__file__).resolve().parent

CLUSTER_DIRS = ("integration",)
FAULT_DIRS = ("fault",)
# files outside those folders that start real processes (etcd, node processes)
CLUSTER_FILES = (
    "security/test_etcd_tls.py",            # a real etcd serving TLS
    "deploy/test_manifest_processes.py",    # the cpu-dev overlay's router and nodes + etcd
)

# Unit tests that are slow: over ~10 s on a 2-core machine (pytest --durations; the times
# below), or that start processes, gRPC servers or etcd (in-process HTTP listeners and the
# raw-TCP data plane do not count). file -> "*" (every test in it) or the names of its slow
# test functions (all their parametrized cases). Keys are paths under tests/.
SLOW: dict[str, tuple[str, ...] | str] = {
    # -- over ~10 s (the default model, long generations, wide sweeps) --
    "engine/test_batch_invariant.py": (
        "test_bf16_tokens_do_not_depend_on_batch_chunking_or_cache",    # 8-250 s a case
        "test_bf16_pd_streams_equal_alone_and_concurrent",              # 40 s
    ),
    "engine/test_cpu_bf16_gemm.py": ("test_silu_mul_form_on_the_same_sums",),      # 21 s
    "engine/test_cpu_decode_layers.py": ("test_decode_forwards_equal_the_python_layers",),
    "engine/test_edge_prompts.py": (
        "test_every_prompt_edge_gives_the_reference_tokens_in_every_mode",   # Hypothesis, 15 s
    ),
    "engine/test_graph_engine.py": ("test_default_model_graph_equals_eager",),    # 17 s
    "launch/test_default_model.py": "*",          # converts the GGUF once (~30 s), a CLI process
    "launch/test_default_model_engine.py": "*",   # SmolLM2 against HF: 2-170 s a test
    "launch/test_default_mtp.py": ("test_trained_head_greedy_identical_and_accepts",),  # 95 s
    # -- start processes (a fresh interpreter, a lock holder, a compiler) --
    "cluster/test_core_share.py": ("test_a_killed_holder_frees_the_turn",),
    "cluster/test_heap_trim.py": ("test_freed_step_buffers_stay_resident_until_the_loop_trims",),
    "cluster/test_omp_threads.py": "*",
    "engine/test_host_allocator.py": "*",
    "engine/test_kernel_build_lock.py": (
        "test_a_live_holder_is_waited_for_then_refused_with_the_lock_and_its_holder",
        "test_a_source_that_does_not_compile_is_reported_with_the_compiler_error",
        "test_a_waiter_gets_the_lock_once_the_build_ends_or_its_holder_is_killed",
        "test_extension_load_raises_instead_of_hanging_and_keeps_no_failure",
    ),
    "engine/test_kernel_choice.py": ("test_processes_that_start_together_agree",),
    # -- start gRPC servers (scripted nodes, the router's gRPC front, a real node service) --
    "cluster/test_tracing.py": (
        "test_a_client_traceparent_over_grpc_becomes_the_request_spans_parent",
        "test_a_pd_request_is_one_trace_whose_context_reaches_both_nodes",
        "test_off_nothing_is_recorded_or_sent",
    ),
    "deploy/test_healthcheck.py": ("test_grpc_probe_follows_the_serving_status",),
    "router/test_router_admission.py": "*",
    "router/test_router_aggregated_flow.py": (
        "test_an_aggregated_node_dying_before_its_first_token_is_replayed_on_another_unit",
        "test_an_aggregated_node_dying_mid_stream_continues_on_a_pd_pair_without_loss",
        "test_an_aggregated_node_serves_a_whole_request_in_one_self_prefill_call",
    ),
    "router/test_router_grpc.py": "*",
    "router/test_router_outcome_metrics.py": (
        "test_a_decode_node_dying_mid_stream_counts_a_decode_node_down_and_a_replay",
        "test_a_full_decode_node_counts_a_refusal_by_its_code_and_no_replay",
        "test_a_prefill_node_failing_counts_on_the_prefill_side",
    ),
    "router/test_router_pd_flow.py": (
        "test_a_draining_decode_node_sends_new_requests_elsewhere_and_keeps_its_streams",
        "test_a_prefill_refusal_reports_its_root_cause_not_the_decode_abort",
        "test_a_prefill_reply_still_on_its_way_when_the_request_finishes",
        "test_a_refusal_that_repeats_with_the_same_cause_is_a_500_at_once_not_four_replays",
        "test_a_request_waits_for_room_when_every_decode_node_is_full",
        "test_a_silent_decode_node_is_dropped_after_the_stall_timeout_and_replayed",
        "test_an_internal_error_on_one_pair_is_replayed_on_another_not_a_500",
        "test_closing_the_stream_early_cancels_the_decode_call",
        "test_decode_death_mid_stream_replays_on_another_pair_without_loss_or_duplicates",
        "test_discovery_dropping_a_hung_prefill_node_replays_its_pending_prefill_at_once",
        "test_every_decode_node_full_is_overloaded_and_no_nodes_is_unavailable",
        "test_prefill_failure_drops_the_prefill_node_and_replays",
        "test_reserve_then_prefill_with_the_reservation_and_stream_tokens",
    ),
    "router/test_router_phases.py": (
        "test_a_pd_request_observes_each_phase_once_and_an_aggregated_one_its_own",
    ),
    "security/test_api_key.py": (
        "test_grpc_client_takes_the_key_from_the_environment",
        "test_grpc_health_is_open_and_reflection_is_off_by_default",
        "test_grpc_with_either_key_is_served",
        "test_grpc_without_a_valid_key_is_unauthenticated",
        "test_http_health_and_metrics_stay_open",
        "test_http_with_either_key_is_served",
        "test_http_without_a_valid_key_is_401",
        "test_no_keys_means_open_and_metrics_can_be_turned_off",
        "test_pdserve_generate_sends_the_key",
        "test_reflection_when_on_needs_the_key",
    ),
    "security/test_liveness.py": "*",
    "security/test_malformed_grpc.py": "*",
    "security/test_malformed_http.py": "*",
    "security/test_mtls.py": (
        "test_data_plane_refuses_plaintext_and_foreign_certificates",
        "test_grpc_server_admits_only_clients_of_the_cluster_ca",
        "test_push_with_cluster_certificates_over_tls_serves_the_request",
    ),
    "security/test_public_tls.py": (
        "test_grpc_over_tls_with_the_client",
        "test_https_refuses_plaintext_and_other_cas",
        "test_https_serves_a_client_that_trusts_the_router_ca",
    ),
    "security/test_push_cap.py": (
        "test_pushes_past_the_cap_are_refused_and_a_real_push_still_goes_through",
    ),
    "security/test_rate_limit.py": (
        "test_grpc_past_the_limit_is_resource_exhausted_with_a_retry_after_trailer",
        "test_http_past_the_burst_is_429_with_retry_after_and_reaches_no_node",
        "test_keys_do_not_share_a_bucket",
        "test_the_bucket_refills_at_the_rate",
    ),
    "security/test_request_ids.py": "*",
}


def _tier(rel: str) -> str:
    top = rel.split("/", 1)[0]
    if top in CLUSTER_DIRS or rel in CLUSTER_FILES:
        return "cluster"
    if top in FAULT_DIRS:
        return "fault"
    return "unit"


def pytest_collection_modifyitems(config, items):
    gone = [rel for rel in SLOW if not (TESTS / rel).is_file()]
    if gone:        # a moved or removed file must not leave the list stale
        raise pytest.UsageError(f"tests/conftest.py SLOW names files that do not exist: {gone}")
    checked: set[str] = set()
    for item in items:
        rel = item.path.resolve().relative_to(TESTS).as_posix()
        tier = _tier(rel)
        item.add_marker(getattr(pytest.mark, tier))
        slow = SLOW.get(rel)
        if rel not in checked and isinstance(slow, tuple):
            checked.add(rel)
            missing = [name for name in slow if not hasattr(getattr(item, "module", None), name)]
            if missing:     # nor a renamed or removed test
                raise pytest.UsageError(f"tests/conftest.py SLOW names {missing} that "
                                        f"tests/{rel} does not define")
        name = getattr(item, "originalname", item.name)
        if tier == "unit" and (slow == "*" or (slow and name in slow)):
            item.add_marker(pytest.mark.slow)
