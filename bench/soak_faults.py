"""The soak's faults, one at a time on a supervised LocalCluster, and what it watches.

Each fault is a generator that does its harm, then yields while it waits (for a process
to exit, a pause to end, the cluster to serve again); the control loop advances it once
a tick, between supervision rounds, so nothing here blocks supervision for long. A
fault is recovered when every node runs, is ready and is listed by the router again.

- sigkill-{prefill,decode}: SIGKILL; the supervisor restarts the node (launch/supervisor.py)
- sigterm-{prefill,decode}: SIGTERM (a drain); once it exits 0 it is started again, as a
  rolling update would (the supervisor leaves a clean exit stopped)
- sigstop-prefill: SIGSTOP for a few seconds (a hung node; etcd drops it), then SIGCONT
- etcd-outage: etcd stopped for `etcd_down_s`, then started on the same port and data
"""

from __future__ import annotations

import random
import re
import signal
import ssl
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

KINDS = ("sigterm-decode", "sigterm-prefill", "sigkill-decode", "sigkill-prefill",
         "sigstop-prefill", "etcd-outage")
RECOVERY_LIMIT_S = 180.0
# etcd compacts only after 5 minutes up (its revision compactor's period restarts with the
# process): an outage is drawn only once etcd has run this long, as a real etcd would.
# Restarted every 1-5 min (the first 30-min soak), it never compacted after its first 10
# minutes and its database grew from 0.6 to 6.8 MB (3,491 revisions kept).
ETCD_UP_S = 330.0


@dataclass
class FaultRecord:
    kind: str
    at: float                       # seconds since the soak began
    target: str = ""
    detail: str = ""
    recovered_after: float | None = None
    error: str | None = None


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def etcd_db_bytes(etcd) -> dict[str, int] | None:
    """etcd's database size (file), the part in use, its revision and the last compacted
    one, from its /metrics (a launch.etcd_server.EtcdServer: with TLS, asked with etcd's
    own certificate)."""
    context = None
    if etcd.tls is not None:
        context = ssl.create_default_context(cafile=etcd.tls.ca)
        context.load_cert_chain(etcd.tls.cert, etcd.tls.key)
    try:
        with urllib.request.urlopen(f"{etcd.client_url}/metrics", timeout=2,
                                    context=context) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out = {}
    for key, name in (("total", "etcd_mvcc_db_total_size_in_bytes"),
                      ("in_use", "etcd_mvcc_db_total_size_in_use_in_bytes"),
                      ("revision", "etcd_debugging_mvcc_current_revision"),
                      ("compacted", "etcd_debugging_mvcc_compact_revision")):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        if m:
            out[key] = int(float(m.group(1)))
    return out or None


def router_nodes(http_url: str) -> set[str] | None:
    """The node ids in the router's pool (its per-node gauges), None if it did not answer."""
    try:
        with urllib.request.urlopen(f"{http_url}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    return set(re.findall(r'^pdserve_router_node_inflight_requests\{node="([^"]+)"', text,
                          re.M))


@dataclass
class Faults:
    """Injects faults drawn from `kinds` (or `schedule`, in order, then none), with a random
    gap after each recovery."""
    cluster: object                 # launch.local_cluster.LocalCluster, supervised
    t0: float
    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    schedule: list[str] | None = None
    gap_s: tuple[float, float] = (20.0, 50.0)
    first_at_s: float = 30.0
    stop_s: tuple[float, float] = (3.0, 10.0)
    etcd_down_s: float = 30.0
    records: list[FaultRecord] = field(default_factory=list)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self._current: Iterator | None = None
        self._next_at = self.t0 + self.first_at_s
        self._stopped: list = []        # SIGSTOPped nodes, continued by close()
        self._etcd_down = False
        self._etcd_started = self.t0    # (about: etcd started with the cluster)
        self.finishing = False          # set: no new fault begins
        self._lock = threading.Lock()   # finish() (the load's thread) vs step()

    @property
    def busy(self) -> bool:
        return self._current is not None

    @property
    def pending(self) -> bool:
        """A fault is under way, or scheduled ones have not all run."""
        return self.busy or (self.schedule is not None
                             and len(self.records) < len(self.schedule))

    def finish(self) -> bool:
        """No new fault begins from now on; returns whether one is still under way."""
        with self._lock:
            self.finishing = True
            return self.busy

    def step(self, now: float) -> None:
        if self._current is None:
            if now < self._next_at or self.finishing:
                return
            if not self.serving():          # a fault begins only on a whole cluster
                self._next_at = now + 1.0
                return
            with self._lock:
                kind = None if self.finishing else self._draw()
                if kind is None:        # none left (schedule, finishing), or etcd too young
                    self._next_at = (now + 5.0 if self.kinds and self.schedule is None
                                     and not self.finishing else float("inf"))
                    return
                record = FaultRecord(kind, round(now - self.t0, 1))
                self.records.append(record)
                self._current = self._run(record)
        try:
            next(self._current)
        except StopIteration:
            self._current = None
            self._next_at = time.monotonic() + self.rng.uniform(*self.gap_s)

    def close(self) -> None:
        """Undo what a fault in progress left (a stopped node, etcd down)."""
        self._current = None
        for node in self._stopped:
            node.signal(signal.SIGCONT)
        self._stopped.clear()
        if self._etcd_down:
            self.cluster.start_etcd()
            self._etcd_down = False

    def _draw(self) -> str | None:
        if self.schedule is not None:
            done = len(self.records)
            return self.schedule[done] if done < len(self.schedule) else None
        kinds = [k for k in self.kinds if k != "etcd-outage"
                 or time.monotonic() - self._etcd_started >= ETCD_UP_S]
        return self.rng.choice(kinds) if kinds else None

    # ---- the faults ----------------------------------------------------------------------
    def _run(self, record: FaultRecord) -> Iterator[None]:
        began = time.monotonic()
        kind, _, role = record.kind.partition("-")
        harm = {"sigkill": self._sigkill, "sigterm": self._sigterm, "sigstop": self._sigstop,
                "etcd": self._etcd}[kind]
        yield from harm(record, role)
        while not self.serving():
            if time.monotonic() - began > RECOVERY_LIMIT_S:
                record.error = (f"not serving again within {RECOVERY_LIMIT_S:.0f} s: "
                                f"{self.not_serving()}")
                return
            yield
        record.recovered_after = round(time.monotonic() - began, 1)

    def _pick(self, record: FaultRecord, role: str):
        nodes = [n for n in self.cluster.nodes if n.role == role and n.alive() and n.ready()]
        node = self.rng.choice(nodes)
        record.target = f"{node.name} (pid {node.proc.pid})"
        return node

    def _sigkill(self, record: FaultRecord, role: str) -> Iterator[None]:
        node = self._pick(record, role)
        killed = node.proc
        node.signal(signal.SIGKILL)
        while killed.poll() is None:    # until it is gone: its ready file and the router's
            yield                       # entry still name it; the supervisor restarts it
        record.detail = "restarted by the supervisor"

    def _sigterm(self, record: FaultRecord, role: str) -> Iterator[None]:
        node = self._pick(record, role)
        began = time.monotonic()
        node.signal(signal.SIGTERM)
        while node.alive():
            yield
        rc = node.proc.returncode
        record.detail = f"drained in {time.monotonic() - began:.1f} s, exit {rc}"
        if rc != 0:         # the supervisor restarts a crash itself
            record.error = f"{node.name} exited {rc} after SIGTERM (a clean drain exits 0)"
            return
        self.cluster.start_again(node)

    def _sigstop(self, record: FaultRecord, role: str) -> Iterator[None]:
        node = self._pick(record, role)
        pause = self.rng.uniform(*self.stop_s)
        record.detail = f"stopped {pause:.1f} s"
        node.signal(signal.SIGSTOP)
        self._stopped.append(node)
        until = time.monotonic() + pause
        while time.monotonic() < until:
            yield
        node.signal(signal.SIGCONT)
        self._stopped.remove(node)

    def _etcd(self, record: FaultRecord, role: str) -> Iterator[None]:
        record.target = f"etcd (pid {self.cluster.etcd.proc.pid})"
        record.detail = f"down {self.etcd_down_s:.0f} s"
        self._etcd_down = True
        self.cluster.stop_etcd()
        until = time.monotonic() + self.etcd_down_s
        while time.monotonic() < until:
            yield
        self.cluster.start_etcd()
        self._etcd_down = False
        self._etcd_started = time.monotonic()

    # ---- health --------------------------------------------------------------------------
    def not_serving(self) -> list[str]:
        """Nodes that are not running, not ready, or not in the router's pool."""
        listed = router_nodes(self.cluster.http_url) or set()
        return [n.name for n in self.cluster.nodes
                if not (n.alive() and n.ready() and n.name in listed)]

    def serving(self) -> bool:
        return not self.not_serving()


@dataclass
class Incarnation:
    name: str
    pid: int
    born: float                     # first seen (seconds since the soak began)
    samples: list[tuple[float, int]] = field(default_factory=list)     # (t, RSS kB)


class Watch:
    """RSS of every node and router process (a restarted node is a new incarnation, with
    its own baseline) and the etcd database size, sampled every few seconds."""

    def __init__(self, cluster, t0: float):
        self.cluster = cluster
        self.t0 = t0
        self.incarnations: dict[int, Incarnation] = {}
        self.etcd: list[tuple[float, dict[str, int]]] = []

    def sample(self, now: float) -> None:
        t = round(now - self.t0, 1)
        for child in [*self.cluster.nodes, self.cluster.router]:
            if not child.alive():
                continue
            pid = child.proc.pid
            kb = rss_kb(pid)
            if kb is None:
                continue
            inc = self.incarnations.setdefault(pid, Incarnation(child.name, pid, t))
            inc.samples.append((t, kb))
        if self.cluster.etcd.proc is not None:
            size = etcd_db_bytes(self.cluster.etcd)
            if size is not None:
                self.etcd.append((t, size))

    def rss_report(self, warmup_s: float, limit: float) -> list[dict]:
        """Per incarnation: RSS at warm-up (`warmup_s` after it was first seen) and at its
        last sample; drift judged against `limit` when it lived past the warm-up."""
        rows = []
        for inc in self.incarnations.values():
            base = next(((t, kb) for t, kb in inc.samples if t >= inc.born + warmup_s), None)
            end_t, end_kb = inc.samples[-1]
            row = {"process": inc.name, "pid": inc.pid, "born_s": inc.born,
                   "first_mb": round(inc.samples[0][1] / 1024, 1),
                   "end_s": end_t, "end_mb": round(end_kb / 1024, 1),
                   "max_mb": round(max(kb for _, kb in inc.samples) / 1024, 1)}
            if base is not None and end_t > base[0]:
                drift = (end_kb - base[1]) / base[1]
                row.update(baseline_s=base[0], baseline_mb=round(base[1] / 1024, 1),
                           drift=round(drift, 4), within=drift <= limit)
            rows.append(row)
        return rows

    def etcd_report(self, warmup_s: float) -> dict:
        """The database file at warm-up and at the end, and its largest size in each half
        of the run after warm-up (it is flat when the second half's is no larger), with a
        sample a minute for the record."""
        if not self.etcd:
            return {}
        after = [(t, s) for t, s in self.etcd if t >= warmup_s] or self.etcd
        mid = (after[0][0] + after[-1][0]) / 2
        largest = lambda rows: max((s.get("total", 0) for _, s in rows), default=0)  # noqa: E731
        series, last = [], -60.0
        for t, s in self.etcd:
            if t - last >= 60:
                series.append((t, s))
                last = t
        return {"first": self.etcd[0][1], "baseline_s": after[0][0], "baseline": after[0][1],
                "end": self.etcd[-1][1],
                "max_first_half": largest([r for r in after if r[0] < mid]),
                "max_second_half": largest([r for r in after if r[0] >= mid]),
                "samples": len(self.etcd), "per_minute": series}

