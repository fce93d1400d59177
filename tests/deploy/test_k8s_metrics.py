"""Prometheus in the manifests, against the code: every node serves /metrics
(--metrics-listen, parsed by the pdserve CLI) on the port its pod's prometheus.io
annotations, its headless metrics Service and the NetworkPolicy name; the Prometheus
Operator component's ServiceMonitor selects exactly the router and node Services and each
of its endpoint ports reaches a port where the process serves /metrics. Negative tests
plant one mistake each and check it is caught."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import kubernetes_validate
import pytest

from tests.deploy.cli_check import (
    check_container,
    node_metrics_port,
    split_address,
)
from tests.deploy.conftest import RENDERED_NAMES
from tests.deploy.manifests import (
    K8S,
    KUBERNETES_VERSION,
    find,
    labels_match,
    one,
    pdserve_containers,
    render,
    workloads,
)

NODE_ROLES = ("prefill", "decode")
SERVICE_MONITOR = "ServiceMonitor"
OPERATOR_KINDS = {SERVICE_MONITOR, "PrometheusRule"}      # CRDs: no schema to validate with


def _parsed(objects) -> dict[str, tuple]:
    """role -> (container, args) of the router and node containers (no problems)."""
    out, problems = {}, []
    for c in pdserve_containers(objects):
        args, found = check_container(c, objects)
        problems += found
        if args.command in ("router", *NODE_ROLES):
            out[args.command] = (c, args)
    assert problems == []
    return out


def metrics_ports(objects) -> dict[str, int]:
    """Workload name -> the container port its process serves /metrics on."""
    out = {}
    for role, (c, args) in _parsed(objects).items():
        port = split_address(args.http)[1] if role == "router" else node_metrics_port(args)
        if port is not None:
            out[c.workload["metadata"]["name"]] = port
    return out


def _service_target(objects, svc: dict, port_name: str) -> tuple[str, int] | None:
    """(workload, container port) a Service port named `port_name` reaches, or None."""
    for port in svc["spec"]["ports"]:
        if port.get("name") != port_name:
            continue
        for w, template in workloads(objects):
            if labels_match({"matchLabels": svc["spec"]["selector"]},
                            template["metadata"]["labels"]):
                for c in template["spec"]["containers"]:
                    named = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
                    target = port["targetPort"]
                    return w["metadata"]["name"], named.get(target, target)
    return None


def service_monitor_problems(objects) -> list[str]:
    """What a ServiceMonitor gets wrong: no Service selected, or an endpoint port that
    reaches no /metrics of the pods behind the Services it selects."""
    served = metrics_ports(objects)
    problems = []
    for sm in find(objects, SERVICE_MONITOR):
        where = f"ServiceMonitor/{sm['metadata']['name']}"
        spec = sm["spec"]
        namespaces = spec.get("namespaceSelector", {}).get("matchNames", [])
        services = [s for s in find(objects, "Service")
                    if labels_match(spec["selector"], s["metadata"].get("labels", {}))
                    and s["metadata"]["namespace"] in namespaces]
        if not services:
            problems.append(f"{where}: selects no Service")
        scraped = set()
        for svc in services:
            for endpoint in spec["endpoints"]:
                hit = _service_target(objects, svc, endpoint["port"])
                if hit is None:
                    continue
                workload, port = hit
                if served.get(workload) != port or endpoint.get("path") != "/metrics":
                    problems.append(f"{where}: endpoint {endpoint} reaches {workload} port "
                                    f"{port}, where nothing serves /metrics ({served})")
                scraped.add(workload)
        if scraped != set(served):
            problems.append(f"{where}: scrapes {sorted(scraped)}, not every process that "
                            f"serves /metrics ({sorted(served)})")
    return problems


@pytest.fixture(scope="module")
def with_operator(tmp_path_factory) -> list[dict]:
    """cpu-dev + components/prometheus-operator, as a user would add it."""
    folder = tmp_path_factory.mktemp("pmo")
    rel = os.path.relpath(K8S, folder)
    (Path(folder) / "kustomization.yaml").write_text(f"""\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [{rel}/overlays/cpu-dev]
components: [{rel}/components/prometheus-operator]
""")
    return render(Path(folder))


@pytest.mark.parametrize("name", RENDERED_NAMES)
def test_nodes_serve_metrics_where_annotations_service_and_policy_say(rendered, name):
    objects = rendered[name]
    policy = one(objects, "NetworkPolicy", "pdserve-node-metrics-from-scrapers")["spec"]
    opened = {p["port"] for rule in policy["ingress"] for p in rule["ports"]}
    for role in NODE_ROLES:
        c, args = _parsed(objects)[role]
        port = node_metrics_port(args)
        assert port == 9300
        annotations = c.pod["metadata"]["annotations"]
        assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"],
                annotations["prometheus.io/path"]) == ("true", str(port), "/metrics")
        svc = one(objects, "Service", f"pdserve-{role}-metrics")
        assert svc["spec"]["clusterIP"] == "None"
        assert _service_target(objects, svc, "metrics") == (f"pdserve-{role}", port)
        assert port in opened and labels_match(policy["podSelector"],
                                               c.pod["metadata"]["labels"])


def test_a_wrong_annotation_port_is_caught(rendered):
    objects = copy.deepcopy(rendered["cpu-dev"])
    deployment = one(objects, "Deployment", "pdserve-decode")
    deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = "9301"
    (c,) = [c for c in pdserve_containers(objects)
            if c.workload["metadata"]["name"] == "pdserve-decode"]
    _, problems = check_container(c, objects)
    assert any("--metrics-listen port 9300" in p for p in problems), problems


def test_a_scraped_node_without_metrics_is_caught(rendered):
    objects = copy.deepcopy(rendered["cpu-dev"])
    container = one(objects, "Deployment", "pdserve-prefill")["spec"]["template"]["spec"][
        "containers"][0]
    i = container["args"].index("--metrics-listen")
    container["args"][i + 1] = "none"
    (c,) = [c for c in pdserve_containers(objects)
            if c.workload["metadata"]["name"] == "pdserve-prefill"]
    _, problems = check_container(c, objects)
    assert any("--metrics-listen is off" in p for p in problems), problems


def test_the_service_monitor_scrapes_every_metrics_endpoint(with_operator):
    (sm,) = find(with_operator, SERVICE_MONITOR)
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["namespace"] == "pdserve"
    assert service_monitor_problems(with_operator) == []
    assert set(metrics_ports(with_operator)) == {"pdserve-router", "pdserve-prefill",
                                                 "pdserve-decode"}
    (rule,) = find(with_operator, "PrometheusRule")
    assert rule["metadata"]["namespace"] == "pdserve" and rule["spec"]["groups"][0]["rules"]
    # everything else still validates strictly (the operator's kinds are CRDs: no schema)
    for obj in with_operator:
        if obj["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_a_service_monitor_port_that_reaches_no_metrics_is_caught(with_operator):
    objects = copy.deepcopy(with_operator)
    sm = one(objects, SERVICE_MONITOR, "pdserve")
    sm["spec"]["endpoints"][0]["port"] = "grpc"      # the router's gRPC port: no /metrics
    problems = service_monitor_problems(objects)
    assert any("pdserve-router port 50051" in p for p in problems), problems
