"""The cpu-dev overlay's commands really serve: the router, prefill and decode containers'
argv and environment (ConfigMaps, downward API) exactly as rendered, run as processes on
loopback (only the addresses are mapped: pod IP and ports -> 127.0.0.1 and free ports; etcd
-> a real etcd started here; /models -> the prepared default model). Then the image's
HEALTHCHECK module reports each one healthy, a completion goes through the router, each
node's /metrics (where its pod's prometheus.io annotations point) counts its prompt, and
SIGTERM (what Kubernetes sends after preStop) drains and exits 0 well within the pods'
terminationGracePeriodSeconds."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch import healthcheck
from launch.etcd_server import EtcdServer, free_port
from tests.deploy.manifests import REPO, SAMPLE_POD_IP, pdserve_containers

ROLES = ("prefill", "decode", "router")


def _map_addresses(argv: list[str], ports: dict[int, int]) -> list[str]:
    """HOST:PORT arguments naming a manifest port -> 127.0.0.1:<its free port>."""
    out = []
    for arg in argv:
        m = re.fullmatch(r"(0\.0\.0\.0|" + re.escape(SAMPLE_POD_IP) + r"):(\d+)", arg)
        out.append(f"127.0.0.1:{ports[int(m.group(2))]}" if m else arg)
    return out


class Launched:
    def __init__(self, role: str, argv: list[str], env: dict[str, str], tmp: Path):
        self.role, self.argv = role, argv
        self.ready = tmp / f"{role}.ready"
        self.log_path = tmp / f"{role}.log"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        full_env = {**clean, **env, "PYTHONPATH": str(REPO),
                    "PDSERVE_READY_FILE": str(self.ready)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "launch.cli", *argv[1:]],
                                         cwd=REPO, env=full_env, stdout=log,
                                         stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not (self.ready.exists() and self.ready.read_text().strip()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} not ready in {timeout}s:\n{self.log()}")
            time.sleep(0.1)

    def healthcheck(self, tmp: Path, env: dict[str, str]) -> int:
        """The image's HEALTHCHECK, given this process's command line as /proc/1/cmdline."""
        cmdline = tmp / f"{self.role}.cmdline"
        cmdline.write_bytes(b"\0".join(a.encode() for a in
                                       ["/opt/pdserve/bin/python", "/opt/pdserve/bin/pdserve",
                                        *self.argv[1:]]) + b"\0")
        saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PDSERVE_")}
        os.environ.update(env)              # a health check inherits the container's env
        try:
            return healthcheck.main(["--cmdline-file", str(cmdline), "--timeout", "3"])
        finally:
            for k in [k for k in os.environ if k.startswith("PDSERVE_")]:
                del os.environ[k]
            os.environ.update(saved)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.timeout(300)
def test_cpu_dev_commands_serve_a_request_and_drain(rendered, default_model_dir, tmp_path):
    objects = rendered["cpu-dev"]
    by_role = {c.argv[1]: c for c in pdserve_containers(objects) if c.argv[1] in ROLES}
    # per role: prefill and decode pods both serve /metrics on 9300, on one host here
    ports = {role: {p: free_port() for p in c.container_ports()} for role, c in by_role.items()}
    etcd = EtcdServer(tmp_path / "etcd").start()
    launched: dict[str, Launched] = {}
    envs: dict[str, dict[str, str]] = {}
    try:
        for role in ROLES:
            c = by_role[role]
            env = {**c.env, "PDSERVE_ETCD": etcd.endpoint, "PDSERVE_MODEL": str(default_model_dir)}
            envs[role] = {k: v for k, v in env.items() if k.startswith("PDSERVE_")}
            launched[role] = Launched(role, _map_addresses(c.argv, ports[role]), env,
                                      tmp_path)
        for role in ROLES:
            launched[role].wait_ready(timeout=180)

        for role in ("prefill", "decode"):
            assert launched[role].healthcheck(tmp_path, envs[role]) == 0, launched[role].log()
        deadline = time.monotonic() + 30      # the router is healthy once it sees both nodes
        while launched["router"].healthcheck(tmp_path, envs["router"]) != 0:
            assert time.monotonic() < deadline, launched["router"].log()
            time.sleep(0.5)

        http = json.loads(launched["router"].ready.read_text())["http"]
        body = json.dumps({"model": default_model_dir.name, "prompt": "The capital of France is",
                           "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(f"{http}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            answer = json.loads(reply.read())
        assert answer["usage"]["completion_tokens"] == 4
        assert answer["choices"][0]["text"]
        # each node serves /metrics where its pod's prometheus.io annotations say
        for role in ("prefill", "decode"):
            annotations = by_role[role].pod["metadata"]["annotations"]
            port = ports[role][int(annotations["prometheus.io/port"])]
            url = f"http://127.0.0.1:{port}{annotations['prometheus.io/path']}"
            with urllib.request.urlopen(url, timeout=10) as reply:
                families = text_string_to_metric_families(reply.read().decode())
                prompt = {s.labels["role"]: s.value for f in families for s in f.samples
                          if s.name == "pdserve_prompt_tokens_total"}
            assert prompt[role] == answer["usage"]["prompt_tokens"], (role, prompt)

        for role in ("decode", "prefill", "router"):
            grace = by_role[role].spec["terminationGracePeriodSeconds"]
            started = time.monotonic()
            launched[role].proc.send_signal(signal.SIGTERM)
            assert launched[role].proc.wait(timeout=grace) == 0, launched[role].log()
            assert time.monotonic() - started < grace
    finally:
        for proc in launched.values():
            proc.stop()
        etcd.stop()
