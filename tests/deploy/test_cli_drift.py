"""The manifests cannot drift from the code: every `pdserve ...` container (command, args, env
from env + ConfigMaps) is parsed by the pdserve CLI's own parser, and the parsed flags are
compared with ports, probes, Services, NetworkPolicies, grace periods and volumes. The
negative tests plant one mistake each and check it is caught, naming what is wrong."""

from __future__ import annotations

import copy
import os
import re

import pytest

from tests.deploy.cli_check import (
    CliRejected,
    check_container,
    kv_tcp_port,
    parse_pdserve,
    split_address,
)
from tests.deploy.conftest import RENDERED_NAMES
from tests.deploy.manifests import (
    containers,
    find,
    labels_match,
    one,
    pdserve_containers,
    workloads,
)

ROLES = ("router", "prefill", "decode")


def _parsed(objects):
    """role -> (container, args) for the serving roles; asserts no problems anywhere."""
    out, problems = {}, []
    for c in pdserve_containers(objects):
        args, found = check_container(c, objects)
        problems += found
        out.setdefault(args.command, []).append((c, args))
    assert problems == []
    return out


@pytest.mark.parametrize("name", RENDERED_NAMES)
def test_every_pdserve_container_parses_and_matches_its_pod(rendered, name):
    parsed = _parsed(rendered[name])
    assert set(ROLES) <= set(parsed), f"{name}: roles found {sorted(parsed)}"
    assert "models" in parsed, "the model-prepare Job runs `pdserve models prepare`"
    for role in ROLES:
        assert len(parsed[role]) == 1


@pytest.mark.parametrize("name", RENDERED_NAMES)
def test_roles_agree_on_cluster_model_and_kv_layout(rendered, name):
    parsed = {role: args for role, [(_, args)] in
              ((r, v) for r, v in _parsed(rendered[name]).items() if r in ROLES)}
    for field in ("cluster", "etcd", "model"):
        assert len({getattr(parsed[r], field) for r in ROLES}) == 1, field
    # The KV fingerprint: a prefill node pushes into a decode node's blocks.
    for field in ("dtype", "block_size", "device", "max_model_len"):
        assert getattr(parsed["prefill"], field) == getattr(parsed["decode"], field), field


@pytest.mark.parametrize("name", RENDERED_NAMES)
def test_router_service_and_network_policy_use_the_router_flags(rendered, name):
    objects = rendered[name]
    (router, args), = _parsed(objects)["router"]
    flag_ports = {"http": split_address(args.http)[1], "grpc": split_address(args.grpc)[1]}
    assert flag_ports == {"http": 8000, "grpc": 50051}     # what the issue and the docs say
    service = one(objects, "Service", "pdserve-router")
    for port in service["spec"]["ports"]:
        assert router.resolve_port(port["targetPort"]) == flag_ports[port["name"]]
        assert port["port"] == flag_ports[port["name"]]
    policy = one(objects, "NetworkPolicy", "pdserve-router-from-clients")
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert allowed == set(flag_ports.values())


@pytest.mark.parametrize("name", RENDERED_NAMES)
def test_node_network_policy_opens_the_listen_ports(rendered, name):
    objects = rendered[name]
    parsed = _parsed(objects)
    listen = {split_address(parsed[r][0][1].listen)[1] for r in ("prefill", "decode")}
    policy = one(objects, "NetworkPolicy", "pdserve-nodes-from-cluster")
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert allowed == listen


@pytest.mark.parametrize("name", RENDERED_NAMES)
def test_prefill_pushes_kv_over_the_decode_tcp_plane_the_policy_opens(rendered, name):
    objects = rendered[name]
    parsed = _parsed(objects)
    (_, prefill), = parsed["prefill"]
    (_, decode), = parsed["decode"]
    assert prefill.kv_transport == "tcp"
    port = kv_tcp_port(decode)
    assert port and port != split_address(decode.listen)[1]
    policy = one(objects, "NetworkPolicy", "pdserve-decode-kv-from-prefill")["spec"]
    assert [p["port"] for rule in policy["ingress"] for p in rule["ports"]] == [port]
    prefill_pods = policy["ingress"][0]["from"][0]["podSelector"]
    pods = {w["metadata"]["name"] for w, t in workloads(objects)
            if labels_match(prefill_pods, t["metadata"]["labels"])}
    assert pods == {"pdserve-prefill"}
    decode_pods = {w["metadata"]["name"] for w, t in workloads(objects)
                   if labels_match(policy["podSelector"], t["metadata"]["labels"])}
    assert decode_pods == {"pdserve-decode"}


def test_accelerator_overlays_select_their_device(rendered):
    for overlay, device in (("cpu-dev", "cpu"), ("cuda", "cuda"), ("ascend", "npu")):
        parsed = _parsed(rendered[overlay])
        assert {parsed[r][0][1].device for r in ("prefill", "decode")} == {device}


# --- the checks catch planted mistakes ------------------------------------------------------

def _decode(objects):
    return next(c for c in pdserve_containers(objects)
                if c.workload["metadata"]["name"] == "pdserve-decode")


def _with(objects, deployment, mutate):
    """A copy of `objects` with `mutate(container_dict, pod_spec)` applied to a Deployment."""
    objects = copy.deepcopy(objects)
    spec = one(objects, "Deployment", deployment)["spec"]["template"]["spec"]
    mutate(spec["containers"][0], spec)
    return objects


def test_a_bogus_flag_is_rejected_by_the_parser(rendered):
    objects = _with(rendered["cpu-dev"], "pdserve-decode",
                    lambda c, _: c["args"].append("--kv-cache-gb=4"))
    with pytest.raises(CliRejected, match="unrecognized arguments: --kv-cache-gb=4"):
        check_container(_decode(objects), objects)


def test_a_flag_of_another_role_is_rejected(rendered):
    objects = _with(rendered["cpu-dev"], "pdserve-prefill",
                    lambda c, _: c["args"].extend(["--policy", "round-robin"]))
    prefill = next(c for c in pdserve_containers(objects)
                   if c.workload["metadata"]["name"] == "pdserve-prefill")
    with pytest.raises(CliRejected, match="--policy"):
        check_container(prefill, objects)


def test_an_unknown_env_variable_is_rejected(rendered):
    objects = copy.deepcopy(rendered["cpu-dev"])
    engine = next(o for o in find(objects, "ConfigMap")
                  if o["metadata"]["name"].startswith("pdserve-engine"))
    engine["data"]["PDSERVE_BLOCKSIZE"] = "32"           # typo of PDSERVE_BLOCK_SIZE
    with pytest.raises(CliRejected, match="PDSERVE_BLOCKSIZE"):
        check_container(_decode(objects), objects)


@pytest.mark.parametrize("key,value,match", [
    ("PDSERVE_BLOCK_SIZE", "sixteen", "PDSERVE_BLOCK_SIZE"),   # wrong type
    ("PDSERVE_DTYPE", "bf16", "--dtype='bf16'"),               # not one of the choices
])
def test_a_bad_env_value_is_rejected(rendered, key, value, match):
    objects = copy.deepcopy(rendered["cuda"])
    engine = next(o for o in find(objects, "ConfigMap")
                  if o["metadata"]["name"].startswith("pdserve-engine"))
    engine["data"][key] = value
    with pytest.raises(CliRejected, match=match):
        check_container(_decode(objects), objects)


@pytest.mark.parametrize("configmap,key,value,match", [
    ("pdserve-decode", "PDSERVE_KV_CACHE_MEMORY_GB", "0", "kv_cache_memory_gb must be > 0"),
    ("pdserve-engine", "PDSERVE_BLOCK_SIZE", "4096", "block_size must be an integer in"),
])
def test_a_value_the_engine_refuses_is_reported(rendered, configmap, key, value, match):
    objects = copy.deepcopy(rendered["cpu-dev"])
    engine = next(o for o in find(objects, "ConfigMap")
                  if o["metadata"]["name"].startswith(configmap))
    engine["data"][key] = value
    _, problems = check_container(_decode(objects), objects)
    assert any("would refuse to start" in p and match in p for p in problems), problems


def test_a_router_value_it_refuses_is_reported(rendered):
    objects = copy.deepcopy(rendered["cpu-dev"])
    router_cm = next(o for o in find(objects, "ConfigMap")
                     if o["metadata"]["name"].startswith("pdserve-router"))
    router_cm["data"]["PDSERVE_MAX_ATTEMPTS"] = "0"
    router = next(c for c in pdserve_containers(objects) if c.argv[1] == "router")
    _, problems = check_container(router, objects)
    assert any("max_attempts must be >= 1" in p for p in problems), problems


@pytest.mark.parametrize("mutate,match", [
    (lambda c, s: c["ports"].__setitem__(0, {"name": "grpc", "containerPort": 50072}),
     "--listen port 50071 is not a containerPort"),
    (lambda c, s: c["readinessProbe"]["grpc"].__setitem__("port", 50061),
     "readinessProbe grpc port 50061"),
    (lambda c, s: c["args"].__setitem__(2, "127.0.0.1:50071"), "listens on '127.0.0.1' only"),
    (lambda c, s: c["args"].__setitem__(4, "$(POD_IP):50061"), "--advertise 10.1.2.3:50061"),
    (lambda c, s: c.__setitem__("livenessProbe", {"grpc": {"port": 50071}}),
     "killed mid-drain"),
    (lambda c, s: s.__setitem__("terminationGracePeriodSeconds", 30),
     "terminationGracePeriodSeconds 30 < preStop 5 \\+ --drain-timeout 60"),
    (lambda c, s: c["resources"]["limits"].__setitem__("nvidia.com/gpu", 1),
     "--device cpu but limits nvidia.com/gpu=1"),
    (lambda c, s: c.__setitem__("volumeMounts", c["volumeMounts"][1:]),
     "is on no volume"),
    (lambda c, s: c["args"].__setitem__(6, "auto"), "picks a random port"),
    (lambda c, s: c["ports"].pop(1), "--kv-tcp-listen port 50072 is not a containerPort"),
])
def test_a_node_mismatch_is_reported(rendered, mutate, match):
    objects = _with(rendered["cpu-dev"], "pdserve-decode", mutate)
    _, problems = check_container(_decode(objects), objects)
    assert any(re.search(match, p) for p in problems), problems


@pytest.mark.parametrize("mutate,match", [
    (lambda c, s: c["args"].extend(["--etcd-password", "hunter2"]),
     "--etcd-password on the command line"),
    (lambda c, s: c.setdefault("env", []).append({"name": "PDSERVE_ETCD_PASSWORD",
                                                  "value": "hunter2"}),
     "PDSERVE_ETCD_PASSWORD is not from a Secret"),
])
def test_a_password_outside_a_secret_is_reported(rendered, mutate, match):
    objects = _with(rendered["cluster-tls"], "pdserve-decode", mutate)
    _, problems = check_container(_decode(objects), objects)
    assert any(match in p for p in problems), problems
    ok = _with(rendered["cluster-tls"], "pdserve-decode", lambda c, s: c.setdefault(
        "env", []).append({"name": "PDSERVE_ETCD_PASSWORD", "valueFrom": {
            "secretKeyRef": {"name": "pdserve-etcd-auth", "key": "password"}}}))
    assert check_container(_decode(ok), ok)[1] == []


def test_router_probe_on_a_path_it_does_not_serve_is_reported(rendered):
    objects = _with(rendered["cpu-dev"], "pdserve-router",
                    lambda c, _: c["livenessProbe"]["httpGet"].__setitem__("path", "/healthz"))
    router = next(c for c in pdserve_containers(objects) if c.argv[1] == "router")
    _, problems = check_container(router, objects)
    assert any("GET /healthz is not a router route" in p for p in problems), problems


def test_router_scrape_annotation_must_name_the_http_port(rendered):
    objects = copy.deepcopy(rendered["cuda"])
    template = one(objects, "Deployment", "pdserve-router")["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    template["metadata"]["annotations"]["prometheus.io/port"] = "9090"
    router = next(c for c in pdserve_containers(objects) if c.argv[1] == "router")
    _, problems = check_container(router, objects)
    assert any("prometheus.io annotations" in p for p in problems), problems


def test_etcd_endpoint_must_name_the_etcd_service(rendered):
    objects = copy.deepcopy(rendered["base"])
    cluster = next(o for o in find(objects, "ConfigMap")
                   if o["metadata"]["name"].startswith("pdserve-cluster"))
    cluster["data"]["PDSERVE_ETCD"] = "etcd:2379"
    router = next(c for c in pdserve_containers(objects) if c.argv[1] == "router")
    _, problems = check_container(router, objects)
    assert any("no Service 'etcd'" in p for p in problems), problems


def test_prepare_job_must_fill_the_served_folder(rendered):
    objects = copy.deepcopy(rendered["base"])
    job = one(objects, "Job", "pdserve-model-prepare")
    job["spec"]["template"]["spec"]["containers"][0]["args"][-1] = "/models/cache"
    prepare = next(c for c in pdserve_containers(objects) if c.argv[1] == "models")
    _, problems = check_container(prepare, objects)
    assert any("prepares /models/cache/models/SmolLM2-135M-Instruct" in p for p in problems)


def test_parse_pdserve_leaves_the_environment_alone(monkeypatch):
    monkeypatch.setenv("PDSERVE_CLUSTER", "outer")
    args = parse_pdserve(["pdserve", "router"], {"PDSERVE_CLUSTER": "inner"})
    assert args.cluster == "inner"
    assert parse_pdserve(["pdserve", "router"], {}).cluster == "default"
    assert os.environ["PDSERVE_CLUSTER"] == "outer"


def test_non_pdserve_containers_are_the_expected_ones(rendered):
    others = {(c.workload["metadata"]["name"], c.container["name"])
              for c in containers(rendered["base"]) if c.argv[:1] != ["pdserve"]}
    assert others == {("pdserve-etcd", "etcd"), ("pdserve-router", "wait-for-model"),
                      ("pdserve-prefill", "wait-for-model"), ("pdserve-decode", "wait-for-model")}
