"""Where a served load's CPU goes: CPU seconds (user + system) per process of a server's
process tree and of the load generator, read from /proc before and after each shape of
bench/serve.py. On a 2-core box every CPU-second the router, a node's gRPC threads or the
client spend is one the engine's OpenMP team does not get, so this table, next to the
throughput, says what a served request costs beyond the forward.

Processes are named by what they run: pdserve's `launch.cli <role>` children by role
(router, prefill, decode, aggregated; `up` is the supervisor), etcd, and vLLM's processes
by their title (its API server and `VLLM::EngineCore`)."""

from __future__ import annotations

import os
from collections import Counter

from bench.common import md_table

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
ROLES = ("router", "prefill", "decode", "aggregated", "up")


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def _tree(root: int) -> list[int]:
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.append(pid)
            todo += _children(pid)
    return seen


def _label(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return None
    if "launch.cli" in argv:
        rest = argv[argv.index("launch.cli") + 1:]
        if rest and rest[0] in ROLES:
            return rest[0]
    if any(os.path.basename(a) == "etcd" for a in argv[:1]):
        return "etcd"
    if "bench.serve_client" in " ".join(argv) or "serve_client.py" in " ".join(argv):
        return "client"
    if "EngineCore" in comm or any("EngineCore" in a for a in argv[:1]):
        return "vllm-engine"
    if any("vllm" in a for a in argv[:4]):
        return "vllm-api"
    return comm or None


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK      # utime, stime


def snapshot(*roots: int) -> dict[int, tuple[str, float]]:
    """pid -> (label, CPU seconds so far) over the process trees under `roots`."""
    out = {}
    for root in roots:
        for pid in _tree(root):
            label = _label(pid)
            if label is not None:
                out[pid] = (label, _cpu_s(pid))
    return out


def used(before: dict, after: dict) -> dict[str, float]:
    """label -> CPU seconds spent between two snapshots (a process that started in
    between counts from zero; one that ended in between is lost, so take `after` while
    the processes still run)."""
    spent: Counter = Counter()
    for pid, (label, cpu) in after.items():
        start = before.get(pid)
        spent[label] += cpu - (start[1] if start and start[0] == label else 0.0)
    return {k: round(v, 2) for k, v in spent.items() if v > 0.005}


def cpu_table(rows: list[dict]) -> str | None:
    """CPU seconds per 1,000 output tokens by process, one row per system and shape."""
    rows = [r for r in rows if r.get("cpu_s") and r.get("output_tokens")]
    if not rows:
        return None
    labels = list(dict.fromkeys(k for r in rows for k in sorted(r["cpu_s"],
                                                               key=lambda k: -r["cpu_s"][k])))
    cells = []
    for r in rows:
        per_k = 1e3 / r["output_tokens"]
        total = sum(r["cpu_s"].values())
        cells.append([r["system"], r["shape"], f"{total:.1f}", f"{total * per_k:.2f}",
                      *(f"{r['cpu_s'][k] * per_k:.2f}" if k in r["cpu_s"] else "-"
                        for k in labels)])
    return md_table(["system", "shape", "CPU s", "CPU s / 1k tok",
                     *(f"{k} / 1k tok" for k in labels)], cells)
