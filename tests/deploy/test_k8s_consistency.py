"""The rendered objects fit together: selectors select pods, every workload has a disruption
budget, the serving roles have autoscalers that own their replica count, the pods run
locked down, and the etcd member list agrees with the StatefulSet."""

from __future__ import annotations

import copy
import re

import pytest

from tests.deploy.conftest import RENDERED_NAMES
from tests.deploy.manifests import containers, find, labels_match, one, workloads

SERVING = ("pdserve-router", "pdserve-prefill", "pdserve-decode")


def _pod_labels(objects):
    return [(w["metadata"]["name"], t["metadata"]["labels"]) for w, t in workloads(objects)]


def _selected(objects, selector):
    return sorted(name for name, labels in _pod_labels(objects) if labels_match(selector, labels))


@pytest.mark.parametrize("name", RENDERED_NAMES)
def test_every_selector_selects_exactly_its_pods(rendered, name):
    objects = rendered[name]
    for w, template in workloads(objects):
        if w["kind"] != "Job":
            assert labels_match(w["spec"]["selector"], template["metadata"]["labels"])
            assert _selected(objects, w["spec"]["selector"]) == [w["metadata"]["name"]]
    for svc in find(objects, "Service"):
        selected = _selected(objects, {"matchLabels": svc["spec"]["selector"]})
        assert len(selected) == 1, f"Service {svc['metadata']['name']} selects {selected}"
    for pdb in find(objects, "PodDisruptionBudget"):
        assert _selected(objects, pdb["spec"]["selector"]) == [pdb["metadata"]["name"]]
    for policy in find(objects, "NetworkPolicy"):
        assert _selected(objects, policy["spec"]["podSelector"]), policy["metadata"]["name"]
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                assert _selected(objects, peer["podSelector"])


@pytest.mark.parametrize("name", RENDERED_NAMES)
def test_disruption_budgets_and_autoscalers_cover_the_workloads(rendered, name):
    objects = rendered[name]
    long_running = {w["metadata"]["name"] for w, _ in workloads(objects) if w["kind"] != "Job"}
    assert {p["metadata"]["name"] for p in find(objects, "PodDisruptionBudget")} == long_running
    targets = {h["spec"]["scaleTargetRef"]["name"]: h
               for h in find(objects, "HorizontalPodAutoscaler")}
    assert set(targets) == set(SERVING)
    for deployment in SERVING:
        assert targets[deployment]["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        one(objects, "Deployment", deployment)
        # The HPA owns the count; a `replicas` in the manifest would reset it on every apply.
        assert "replicas" not in one(objects, "Deployment", deployment)["spec"]
        hpa = targets[deployment]["spec"]
        assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]


def test_the_network_policy_starts_from_deny_all(rendered):
    deny = one(rendered["base"], "NetworkPolicy", "pdserve-default-deny-ingress")["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress"]}
    etcd = one(rendered["base"], "NetworkPolicy", "pdserve-etcd-from-cluster")["spec"]
    clients = etcd["ingress"][0]["from"][0]["podSelector"]
    assert _selected(rendered["base"], clients) == sorted(SERVING)
    router = one(rendered["base"], "NetworkPolicy", "pdserve-router-from-clients")["spec"]
    assert all("from" not in rule for rule in router["ingress"]), "clients come from anywhere"


def lockdown_problems(objects) -> list[str]:
    problems = []
    for w, template in workloads(objects):
        pod = template["spec"].get("securityContext", {})
        if not pod.get("runAsNonRoot") or pod.get("runAsUser", 0) == 0:
            problems.append(f"{w['metadata']['name']}: pod may run as root")
        if template["spec"].get("automountServiceAccountToken") is not False:
            problems.append(f"{w['metadata']['name']}: mounts a service account token")
    for c in containers(objects):
        sc = c.container.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c.where}: allowPrivilegeEscalation")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{c.where}: writable root filesystem")
        if sc.get("capabilities", {}).get("drop") != ["ALL"]:
            problems.append(f"{c.where}: capabilities not dropped")
        if sc.get("privileged"):
            problems.append(f"{c.where}: privileged")
        requests = c.container.get("resources", {}).get("requests", {})
        if not {"cpu", "memory"} <= set(requests):
            problems.append(f"{c.where}: no cpu/memory requests")
        if c.argv[:1] == ["pdserve"]:
            writable = {m for m, mount, vol in c.mounts() if "emptyDir" in vol}
            if not {"/tmp", "/home/pdserve/.cache"} <= writable:
                problems.append(f"{c.where}: read-only root but no emptyDir for /tmp and cache")
    return problems


@pytest.mark.parametrize("name", RENDERED_NAMES)
def test_pods_run_locked_down(rendered, name):
    assert lockdown_problems(rendered[name]) == []


def test_lockdown_check_catches_a_root_container(rendered):
    objects = copy.deepcopy(rendered["cpu-dev"])
    spec = one(objects, "Deployment", "pdserve-router")["spec"]["template"]["spec"]
    spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
    del spec["securityContext"]["runAsNonRoot"]
    problems = lockdown_problems(objects)
    assert any("pdserve-router: pod may run as root" in p for p in problems)
    assert any("container router: writable root filesystem" in p for p in problems)


def etcd_problems(objects) -> list[str]:
    sts = one(objects, "StatefulSet", "pdserve-etcd")
    headless = one(objects, "Service", sts["spec"]["serviceName"])["spec"]
    env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]
           ["env"]}
    problems = []
    if headless.get("clusterIP") != "None" or not headless.get("publishNotReadyAddresses"):
        problems.append("the peer Service must be headless and publish not-ready addresses")
    replicas = sts["spec"]["replicas"]
    members = dict(m.split("=", 1) for m in env["ETCD_INITIAL_CLUSTER"].split(","))
    name = sts["metadata"]["name"]
    want = {f"{name}-{i}": f"http://{name}-{i}.{sts['spec']['serviceName']}.$(POD_NAMESPACE)"
                           f".svc:2380" for i in range(replicas)}
    if members != want:
        problems.append(f"ETCD_INITIAL_CLUSTER {members} != the {replicas} pods {want}")
    if replicas > 1 and sts["spec"].get("podManagementPolicy") != "Parallel":
        problems.append("members must start in parallel (no quorum, no readiness)")
    return problems


@pytest.mark.parametrize("name", ("base", "cpu-dev", "cuda", "ascend"))
def test_etcd_members_agree_with_the_statefulset(rendered, name):
    assert etcd_problems(rendered[name]) == []


def test_etcd_check_catches_a_replica_count_change(rendered):
    objects = copy.deepcopy(rendered["base"])
    one(objects, "StatefulSet", "pdserve-etcd")["spec"]["replicas"] = 5
    assert any("!= the 5 pods" in p for p in etcd_problems(objects))


def undefined_references(objects) -> list[str]:
    """$(VAR) in an env value must name a variable defined EARLIER in the container's env
    (or its envFrom), in command/args one defined anywhere in it: Kubernetes leaves any
    other reference as literal text. (A patch's env list goes first in the rendered list,
    which once left cpu-dev's ETCD_INITIAL_CLUSTER before the POD_NAMESPACE it uses.)"""
    problems = []
    for c in containers(objects):
        defined = {k for k in c.env} - {e["name"] for e in c.container.get("env", [])}
        for item in c.container.get("env", []):
            for var in _REF.findall(item.get("value", "")):
                if var not in defined:
                    problems.append(f"{c.where}: env {item['name']} uses $({var}) before it "
                                    f"is defined")
            defined.add(item["name"])
        for arg in c.container.get("command", []) + c.container.get("args", []):
            problems += [f"{c.where}: {arg!r} uses undefined $({var})"
                         for var in _REF.findall(arg) if var not in defined]
    return problems


_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@pytest.mark.parametrize("name", RENDERED_NAMES)
def test_env_references_are_defined_before_use(rendered, name):
    assert undefined_references(rendered[name]) == []


def test_reference_check_catches_a_variable_used_before_it_is_defined(rendered):
    objects = copy.deepcopy(rendered["base"])
    env = one(objects, "StatefulSet", "pdserve-etcd")["spec"]["template"]["spec"][
        "containers"][0]["env"]
    env.append(env.pop(0))                              # POD_NAME to the end
    assert any("uses $(POD_NAME) before it is defined" in p
               for p in undefined_references(objects))
