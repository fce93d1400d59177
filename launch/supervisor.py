"""Keeps `pdserve up`'s node processes running: a node that dies is restarted with backoff
while the rest of the cluster keeps serving; the cluster stops only when it cannot go on.

- A node killed by a signal or exiting non-zero is restarted after a backoff that starts at
  `initial_backoff_s` and doubles up to `max_backoff_s`; a run of `stable_after_s` resets
  it. The new process registers in etcd under the same node id with a new incarnation, and
  the router's discovery watch takes it (router/node_pool.py: a new incarnation replaces
  the old one at once; the old lease expires with nothing left on it).
- A node exiting with status 0 was stopped on purpose (SIGTERM drains it and exits 0): it
  stays stopped.
- More than `max_crashes` crashes in a row, each within `stable_after_s` of its start, is
  a crash loop (a bad flag, a broken model, a port taken): restarting will not help.
- The router or etcd dying ends the cluster: nothing serves without them.

The supervisor is synchronous: `poll()` does one round and returns the children whose loss
is fatal; the owner's loop calls it (LocalCluster.supervise, polled by `pdserve up`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    stable_after_s: float = 30.0    # a run this long resets the backoff and the crash count
    max_crashes: int = 5            # quick crashes in a row before the cluster gives up


def exit_reason(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


@dataclass
class _Watch:
    child: object                   # launch.local_cluster.Child (name, proc, alive, ready)
    started_at: float
    backoff: float
    crashes: int = 0                # in a row, each soon after its start
    restarts: int = 0
    died_at: float | None = None
    restart_at: float | None = None
    stopped: bool = False           # exited 0: left stopped
    awaiting_ready: bool = False


class Supervisor:
    def __init__(self, restart: Callable[[object], None], policy: RestartPolicy | None = None,
                 notify: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic):
        self.restart = restart
        self.policy = policy or RestartPolicy()
        self.notify = notify
        self.clock = clock
        self._nodes: dict[str, _Watch] = {}
        self._essential: list = []
        self.fatal: list = []
        self.restart_times: list[float] = []   # died -> ready again, seconds (docs, tests)

    def watch_node(self, child) -> None:
        self._nodes[child.name] = _Watch(child, self.clock(), self.policy.initial_backoff_s)

    def watch_essential(self, child) -> None:
        self._essential.append(child)

    def unwatch_essential(self, child) -> None:
        """Stop watching `child` (it is being stopped on purpose, e.g. etcd maintenance)."""
        self._essential = [c for c in self._essential if c is not child]

    def poll(self) -> list:
        """One round: restart what is due; return the children whose loss ends the cluster
        (empty while it can go on)."""
        if self.fatal:
            return self.fatal
        for child in self._essential:
            if not child.alive():
                self.notify(f"{child.name} {exit_reason(child.proc.returncode)}; the cluster "
                            f"cannot serve without it, stopping (log: {child.log_path})")
                self.fatal = [child]
                return self.fatal
        now = self.clock()
        for w in self._nodes.values():
            if w.stopped:
                continue
            if w.child.alive():
                self._running(w, now)
            elif w.restart_at is None:
                self._died(w, now)
            elif now >= w.restart_at:
                w.restart_at, w.restarts = None, w.restarts + 1
                self.restart(w.child)
                w.started_at, w.awaiting_ready = self.clock(), True
                self.notify(f"{w.child.name} restarted (pid {w.child.proc.pid}, "
                            f"restart {w.restarts})")
            if self.fatal:
                break
        return self.fatal

    def _running(self, w: _Watch, now: float) -> None:
        if w.awaiting_ready and w.child.ready() is not None:
            w.awaiting_ready = False
            took = now - w.died_at
            self.restart_times.append(took)
            self.notify(f"{w.child.name} is serving again (pid {w.child.proc.pid}), "
                        f"{took:.1f} s after it died")
        if w.crashes and now - w.started_at >= self.policy.stable_after_s:
            w.crashes, w.backoff = 0, self.policy.initial_backoff_s

    def _died(self, w: _Watch, now: float) -> None:
        rc = w.child.proc.returncode
        w.died_at, w.awaiting_ready = now, False
        if rc == 0:
            w.stopped = True
            self.notify(f"{w.child.name} exited cleanly (status 0, stopped on purpose); "
                        f"not restarting it")
            return
        ran = now - w.started_at
        if ran >= self.policy.stable_after_s:
            w.crashes, w.backoff = 0, self.policy.initial_backoff_s
        w.crashes += 1
        reason = exit_reason(rc)
        if w.crashes > self.policy.max_crashes:
            self.notify(f"{w.child.name} {reason}, its {w.crashes}th crash in a row within "
                        f"{self.policy.stable_after_s:.0f} s of starting: a crash loop, "
                        f"stopping the cluster (log: {w.child.log_path})")
            self.fatal = [w.child]
            return
        w.restart_at = now + w.backoff
        self.notify(f"{w.child.name} (pid {w.child.proc.pid}) {reason} after {ran:.1f} s; "
                    f"restarting it in {w.backoff:.1f} s (log: {w.child.log_path})")
        w.backoff = min(w.backoff * 2, self.policy.max_backoff_s)
