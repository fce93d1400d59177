"""`pdserve up` with the prefill node(s) pinned to one CPU and the decode node(s) to
another (bench/serve.py --pin):

    .venv/bin/python -m bench.serve_pinned_up --prefill-cpus 0 --decode-cpus 1 [up flags]

`pdserve up` has no per-node command prefix: LocalCluster builds every node's command in
`_node_cmd` (launch/local_cluster.py), restarts included. This wraps that one method so a
node starts as `taskset -c CPUS <node command>` and otherwise runs `pdserve up` unchanged
(same flags, readiness, banner, Ctrl-C). taskset execs the node, so the PID LocalCluster
records and signals is the node's own; and torch sizes its thread pool from the affinity
mask, so a node pinned to one CPU runs one compute thread instead of two fighting over it.
etcd and the router are not pinned.
"""

from __future__ import annotations

import argparse
import shutil
import sys


def pin_nodes(cpus_by_role: dict[str, str]) -> None:
    from launch.local_cluster import LocalCluster

    taskset = shutil.which("taskset")
    if taskset is None:
        raise SystemExit("taskset (util-linux) is not on PATH")
    node_cmd = LocalCluster._node_cmd

    def pinned(self, role: str, name: str, ready):
        cmd = node_cmd(self, role, name, ready)
        cpus = cpus_by_role.get(role)
        return [taskset, "-c", cpus, *cmd] if cpus else cmd

    LocalCluster._node_cmd = pinned


def main(argv: list[str] | None = None) -> int:
    from launch.cli import main as pdserve_main

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill-cpus", default="0", help="taskset -c list for prefill nodes")
    ap.add_argument("--decode-cpus", default="1", help="taskset -c list for decode nodes")
    ap.add_argument("--aggregated-cpus", default=None,
                    help="taskset -c list for aggregated nodes (default: not pinned)")
    args, up_args = ap.parse_known_args(argv)
    pin_nodes({"prefill": args.prefill_cpus, "decode": args.decode_cpus,
               "aggregated": args.aggregated_cpus})
    # pinned nodes have cores of their own: taking turns would only make them wait
    return pdserve_main(["up", "--no-core-share", *up_args])


if __name__ == "__main__":
    sys.exit(main())
