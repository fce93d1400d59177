"""The servers bench/serve.py loads, and their lives: each is started fresh as a child
process in its own session, waited for until its /health answers 200, loaded, and stopped:
SIGINT (both `pdserve up` and `vllm serve` shut down in order on it), then SIGTERM and
SIGKILL to its process group, then SIGKILL to any process it started that is still alive
(pdserve up's nodes run in sessions of their own, so a process-group kill misses them if
the launcher itself had to be killed). Processes are only ever signalled by the PIDs
recorded here, and only if their start time still matches (no reused PID is hit).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench import vllm_setups

ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = vllm_setups.PEER_PYTHON


@dataclass(frozen=True)
class System:
    name: str
    kind: str                     # "pdserve" | "vllm"
    up_args: tuple[str, ...] = ()   # pdserve: extra `pdserve up` flags
    env: tuple[tuple[str, str], ...] = ()   # vllm: extra environment
    pinned: bool = False          # pdserve: prefill node on CPU 0, decode node on CPU 1
    what: str = ""


def all_systems(n_cpus: int) -> dict[str, System]:
    """Every system bench/serve.py can load; a vLLM setup whose libraries are missing
    (bench/vllm_setups.py) is left out, and the run says so."""
    return {
        "pd": System("pd", "pdserve", what="pdserve up: 1 prefill + 1 decode node"),
        "pd-mtp": System("pd-mtp", "pdserve", ("--speculative-method", "mtp",
                                               "--num-speculative-tokens", "1"),
                         what="PD with MTP speculative decoding (k=1, the shipped head)"),
        "pd-graph": System("pd-graph", "pdserve", ("--enable-graph",),
                           what="PD with --enable-graph (on CPU: the graph path's bucketing, "
                                "padding and binding, replay = an eager rerun)"),
        "aggregated": System("aggregated", "pdserve", ("--aggregated",),
                             what="pdserve up --aggregated: one node prefills and decodes"),
        "pd-pinned": System("pd-pinned", "pdserve", pinned=True,
                            what="PD, prefill node on CPU 0 and decode node on CPU 1"),
        **{name: System(name, "vllm", env=tuple(vllm_setups.env(name, n_cpus).items()),
                        what=f"vllm serve, {vllm_setups.WHAT[name]}")
           for name in vllm_setups.NAMES if vllm_setups.missing(name) is None},
    }


@dataclass
class Settings:
    model: str          # pdserve's folder
    plain_model: str    # the same without mtp*.safetensors (vLLM would load them as weights)
    served_name: str
    dtype: str
    max_num_seqs: int
    kv_gb: float
    insecure: bool = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: System, s: Settings, port: int) -> tuple[list[str], dict]:
    """(argv, extra environment) that starts `system` serving HTTP on 127.0.0.1:port."""
    if system.kind == "vllm":
        cmd = [str(PEER_PYTHON), str(ROOT / "bench" / "vllm_cli.py"), "serve", s.plain_model,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", s.dtype,
               "--served-model-name", s.served_name, "--max-num-seqs", str(s.max_num_seqs),
               "--uvicorn-log-level", "warning"]
        # KV space in GiB: vLLM's CPU backend sizes its cache from this, not from memory
        return cmd, {"VLLM_CPU_KVCACHE_SPACE": f"{s.kv_gb:g}", **dict(system.env)}
    launcher = (["-m", "bench.serve_pinned_up", "--prefill-cpus", "0", "--decode-cpus", "1"]
                if system.pinned else ["-m", "launch.cli", "up"])
    cmd = [sys.executable, *launcher, "--model", s.model, "--dtype", s.dtype,
           "--max-num-seqs", str(s.max_num_seqs), "--kv-cache-memory-gb", f"{s.kv_gb:g}",
           "--http-port", str(port), "--grpc-port", str(free_port()), *system.up_args]
    if s.insecure:
        cmd.append("--insecure")
    # vLLM queues a request for as long as it takes; pdserve's router answers 429 after
    # --queue-timeout (30 s) when every decode slot is taken. `pdserve up` has no router
    # flags, but the router reads PDSERVE_QUEUE_TIMEOUT, so the same patience is given here.
    return cmd, {"PDSERVE_QUEUE_TIMEOUT": "600"}


def _start_time(pid: int) -> str | None:
    """The process's start time (its identity beside the PID); None if gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] == "Z" else fields[19]


def descendants(pid: int) -> dict[int, str]:
    """{pid: start time} of every live process below pid (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        start = _start_time(p)
        if start is not None:
            found[p] = start
            todo += children.get(p, [])
    return found


@dataclass
class Server:
    system: System
    settings: Settings
    log_path: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_s: float | None = None
    command: list[str] = field(default_factory=list)
    _seen: dict[int, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        self.port = free_port()
        self.command, env = server_command(self.system, self.settings, self.port)
        self.started_at = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, env={**os.environ, **env},
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def _remember_children(self) -> None:
        if self.proc is not None:
            self._seen.update(descendants(self.proc.pid))

    def wait_healthy(self, timeout: float) -> float:
        """Seconds from start until /health answered 200; RuntimeError if the server
        exited or did not get there in time (the log's tail in the message)."""
        deadline = self.started_at + timeout
        next_note = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system.name} exited ({self.proc.returncode}) "
                                   f"before serving; log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.getcode() == 200:
                        self.ready_s = time.monotonic() - self.started_at
                        self._remember_children()
                        return self.ready_s
            except OSError:
                pass
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"{self.system.name}: /health not 200 within "
                                   f"{timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")
            if now > next_note:
                print(f"   ... {self.system.name} starting ({now - self.started_at:.0f} s)",
                      flush=True)
                next_note = now + 30
            self._remember_children()
            time.sleep(0.5)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 60.0) -> list[int]:
        """Stop the server and everything it started; returns the PIDs that had to be
        killed after the orderly shutdown (empty when it went cleanly)."""
        if self.proc is None:
            return []
        self._remember_children()
        forced: list[int] = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                    forced.append(self.proc.pid)
                    try:
                        os.killpg(self.proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        self.proc.wait(wait)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        # children in other sessions (pdserve's nodes) or left behind by a forced stop
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_start_time(p) == st
                                                  for p, st in self._seen.items()):
            time.sleep(0.5)
        for pid, start in self._seen.items():
            if _start_time(pid) == start:
                forced.append(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return forced
