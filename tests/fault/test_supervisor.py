"""`pdserve up` supervises its children: a SIGKILLed node comes back (new PID, same node
id, new incarnation in etcd) while the rest keeps serving, and requests succeed again;
the restart policy (backoff, crash loop, clean exits, router/etcd loss) on a fake clock."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from launch.etcd_server import free_port
from launch.supervisor import RestartPolicy, Supervisor, exit_reason
from tests.integration.router_harness import MODEL, tiny_model_folder

ROOT = Path(__file__).resolve().parents[2]


class FakeProc:
    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None


class FakeChild:
    def __init__(self, name: str):
        self.name, self.log_path, self.proc, self.is_ready = name, Path(f"/{name}.log"), \
            FakeProc(1), True

    def alive(self) -> bool:
        return self.proc.returncode is None

    def ready(self):
        return "addr" if self.is_ready else None

    def die(self, rc: int) -> None:
        self.proc.returncode = rc


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _supervisor(*names: str):
    clock, said, restarted = Clock(), [], []
    children = {n: FakeChild(n) for n in names}

    def restart(child):
        restarted.append(child.name)
        child.proc = FakeProc(child.proc.pid + 1)

    sup = Supervisor(restart, RestartPolicy(0.5, 10.0, 30.0, 5), said.append, clock)
    return sup, clock, said, restarted, children


def test_backoff_doubles_resets_after_a_stable_run_and_a_crash_loop_stops_the_cluster():
    sup, clock, said, restarted, ch = _supervisor("decode-0")
    node = ch["decode-0"]
    sup.watch_node(node)
    delays = []
    for _ in range(5):
        node.die(-signal.SIGKILL)
        assert sup.poll() == []
        died = clock.now
        while not restarted or node.alive() is False:
            clock.now += 0.25
            assert sup.poll() == []
        delays.append(round(clock.now - died, 2))
        restarted.clear()
        clock.now += 1.0                           # a short run: still the same crash loop
        assert sup.poll() == []
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert "killed by SIGKILL" in said[0] and "restarting it in 0.5 s" in said[0]
    clock.now += 31.0                              # a stable run forgives the past
    sup.poll()
    node.die(1)
    assert sup.poll() == [] and "restarting it in 0.5 s" in said[-1]
    for _ in range(5):                             # then five more quick crashes
        clock.now += 11.0
        sup.poll()
        assert node.alive()
        node.die(3)
        fatal = sup.poll()
    assert fatal == [node] and "crash loop" in said[-1] and "status 3" in said[-1]


def test_clean_exit_stays_stopped_and_router_or_etcd_loss_is_fatal():
    sup, clock, said, restarted, ch = _supervisor("prefill-0", "router", "etcd")
    sup.watch_node(ch["prefill-0"])
    sup.watch_essential(ch["etcd"])
    sup.watch_essential(ch["router"])
    ch["prefill-0"].die(0)
    for _ in range(5):
        clock.now += 5
        assert sup.poll() == []
    assert restarted == [] and "not restarting" in said[-1]
    ch["router"].die(-signal.SIGSEGV)
    assert sup.poll() == [ch["router"]]
    assert "router killed by SIGSEGV" in said[-1] and "stopping" in said[-1]
    assert exit_reason(2) == "exited with status 2"


def test_etcd_stopped_on_purpose_is_not_fatal_and_a_drained_node_can_be_watched_again():
    """LocalCluster.stop_etcd / start_etcd (maintenance, the soak's etcd outage) unwatch
    and rewatch etcd; start_again re-watches a node that drained (exit 0)."""
    sup, clock, said, restarted, ch = _supervisor("decode-0", "etcd")
    sup.watch_node(ch["decode-0"])
    sup.watch_essential(ch["etcd"])
    sup.unwatch_essential(ch["etcd"])
    ch["etcd"].die(0)
    clock.now += 5
    assert sup.poll() == []
    ch["etcd"].proc = FakeProc(7)                   # started again
    sup.watch_essential(ch["etcd"])
    ch["decode-0"].die(0)                          # drained: left stopped...
    clock.now += 5
    assert sup.poll() == [] and restarted == []
    ch["decode-0"].proc = FakeProc(9)              # ...until started again and re-watched
    sup.watch_node(ch["decode-0"])
    ch["decode-0"].die(-signal.SIGKILL)
    clock.now += 5
    sup.poll()
    clock.now += 1
    assert sup.poll() == [] and restarted == ["decode-0"]
    ch["etcd"].die(-signal.SIGKILL)                # watched again: its loss is fatal
    assert sup.poll() == [ch["etcd"]]


def _pids_of(ready_file: Path) -> list[int]:
    """The processes of this run's node (its --ready-file names it; other runs on the
    machine use the same node ids)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(ready_file).encode() in cmd and b"launch.cli" in cmd:
                pids.append(int(entry.name))
    return pids


def _complete(http: str, timeout: float = 30) -> dict:
    body = json.dumps({"model": MODEL, "prompt": "Hello there", "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{http}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class SteadyClient:
    """Completions one after another from a thread, keeping every answer and failure."""

    def __init__(self, http: str):
        self.http, self.answers, self.failures = http, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:     # a request may wait for the restart (the router's --queue-timeout)
                self.answers.append(_complete(self.http, timeout=120)["choices"][0]["text"])
            except OSError as exc:
                body = exc.read().decode() if hasattr(exc, "read") else ""
                self.failures.append(f"{exc} {body}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(150)


def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = predicate()
        except OSError:
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_pdserve_up_restarts_a_killed_decode_node_and_serves_again(tmp_path):
    folder = tiny_model_folder(tmp_path / "models")
    http_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "up", "--model", str(folder), "--http-port",
         str(http_port), "--grpc-port", str(free_port()), "--dtype", "float32",
         "--max-num-seqs", "4"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    said = lambda text: text in "".join(lines)   # noqa: E731
    try:
        _until(lambda: said("Ctrl-C stops everything") or proc.poll() is not None, 180,
               "pdserve up serving")
        assert said("Ctrl-C stops everything"), "".join(lines)
        run_dir = re.search(r"logs:\s+(\S+)", "".join(lines)).group(1)
        http = f"http://127.0.0.1:{http_port}"
        assert _complete(http)["choices"][0]["text"] is not None

        ready = Path(run_dir) / "decode-0.ready"
        (old_pid,) = _pids_of(ready)
        client = SteadyClient(http)          # requests keep coming through the restart
        _until(lambda: len(client.answers) >= 2, 60, "steady answers")
        killed_at = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        _until(lambda: said("decode-0 is serving again"), 120, "decode-0 back:\n"
               + "".join(lines))
        print(f"decode-0 serving again {time.monotonic() - killed_at:.1f} s after SIGKILL")
        (new_pid,) = _pids_of(ready)
        assert new_pid != old_pid and proc.poll() is None
        # the router takes the new incarnation from etcd: requests succeed again, and
        # those sent while the only decode node was down waited for it, none failed
        served = len(client.answers)
        _until(lambda: len(client.answers) >= served + 3, 60, "answers after the restart")
        client.stop()
        assert not client.failures, client.failures[:3]
        assert len(set(client.answers)) == 1, set(client.answers)     # greedy, one prompt
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        proc.wait(90)
        reader.join(10)
    log = "".join(lines)
    assert proc.returncode == 0, log
    assert "decode-0 (pid" in log and "killed by SIGKILL" in log, log
    assert "stopped." in log
