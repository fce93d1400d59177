"""deploy/k8s/components/leaderworkerset: decode nodes as multi-host tensor-parallel groups.
It renders on top of cpu-dev; its pod templates (leader and worker) pass kubernetes-validate
in strict mode as pods (the LeaderWorkerSet itself is a CRD the validator has no schema
for); both commands parse with the pdserve CLI as the containers would run them, with the
LWS's injected variables, and agree on the group: the leader is a decode node of the group's
size listening for its ranks where the workers dial, a worker's rank is its LWS index."""

from __future__ import annotations

import os
import re

import kubernetes_validate
import pytest

from tests.deploy.cli_check import parse_pdserve
from tests.deploy.manifests import K8S, KUBERNETES_VERSION, find, one, render

LWS_ENV = {"LWS_LEADER_ADDRESS": "pdserve-decode-tp-0.pdserve-decode-tp.pdserve",
           "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "POD_IP": "10.1.2.3"}


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lws")
    rel = os.path.relpath(K8S, folder)
    (folder / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{rel}/overlays/cpu-dev]\ncomponents: [{rel}/components/leaderworkerset]\n")
    return render(folder)


def _env(objects, container) -> dict[str, str]:
    """What the container's environment holds (configMaps by name, fieldRefs sampled)."""
    maps = {m["metadata"]["name"]: m.get("data", {}) for m in find(objects, "ConfigMap")}

    def data(name):       # the rendered (hashed) name: kustomize must have rewritten it
        assert name in maps, f"{name} names no rendered ConfigMap ({sorted(maps)})"
        return maps[name]
    env = {}
    for ref in container.get("envFrom", []):
        env.update(data(ref["configMapRef"]["name"]))
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = data(ref["name"])[ref["key"]]
        else:
            env[e["name"]] = LWS_ENV.get(e["name"], "sample")
    return env


def _argv(container, env) -> list[str]:
    values = {**env, **LWS_ENV}
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a)
            for a in container["command"] + container["args"]]


def test_pod_templates_validate_strict_as_pods(objects):
    lws = one(objects, "LeaderWorkerSet", "pdserve-decode-tp")
    template = lws["spec"]["leaderWorkerTemplate"]
    for part in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"tp-{part.lower()}", **template[part]["metadata"]},
               "spec": template[part]["spec"]}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
    for obj in objects:           # the rest of the overlay, the component's policy too
        if obj["kind"] != "LeaderWorkerSet":
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    assert one(objects, "NetworkPolicy", "pdserve-decode-tp")["metadata"]["namespace"] \
        == "pdserve"


def test_leader_and_workers_agree_on_the_group(objects):
    template = one(objects, "LeaderWorkerSet", "pdserve-decode-tp")["spec"][
        "leaderWorkerTemplate"]
    size = template["size"]
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    lenv, wenv = _env(objects, leader), _env(objects, worker)
    lead = parse_pdserve(_argv(leader, lenv), {k: v for k, v in lenv.items()
                                               if k.startswith("PDSERVE_")})
    rank = parse_pdserve(_argv(worker, wenv), {k: v for k, v in wenv.items()
                                               if k.startswith("PDSERVE_")})
    assert lead.command == "decode" and rank.command == "tp-rank"
    assert lead.tensor_parallel_size == rank.tensor_parallel_size == int(
        LWS_ENV["LWS_GROUP_SIZE"])
    assert size == lead.tensor_parallel_size
    assert lead.tensor_parallel_store == rank.tensor_parallel_store
    port = int(lead.tensor_parallel_store.rpartition(":")[2])
    assert {"name": "tp-store", "containerPort": port} in leader["ports"]
    assert rank.rank == int(LWS_ENV["LWS_WORKER_INDEX"])
    for flag in ("model", "device", "dtype", "block_size"):   # the shard's shape: equal
        assert getattr(lead, flag) == getattr(rank, flag), flag
