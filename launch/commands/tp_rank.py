"""`pdserve tp-rank`: one rank (1..N-1) of a tensor-parallel group whose rank 0 is a node
started elsewhere with `--tensor-parallel-size N --tensor-parallel-store HOST:PORT`: it
loads the model, cuts its shard, joins the group at HOST:PORT and runs every forward the
node broadcasts, until the node stops (exit 0) or the group breaks (exit 1). For groups
that span hosts, e.g. the workers of a Kubernetes LeaderWorkerSet
(deploy/k8s/components/leaderworkerset); on one machine a node spawns its ranks itself."""

from __future__ import annotations

import argparse

from launch.cli_common import CliError, env_argument
from launch.commands.node_options import add_engine_arguments

HELP = "run one rank of a tensor-parallel node's group (multi-host groups)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env_argument(parser, "--rank", "PDSERVE_TP_RANK", default=None, type=int, metavar="R",
                 help="this rank, 1..N-1 (rank 0 is the node); a LeaderWorkerSet gives "
                      "LWS_WORKER_INDEX")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from launch.commands.node_options import engine_config_from_args

    if args.rank is None:
        raise CliError("--rank is required [PDSERVE_TP_RANK]")
    try:
        config = engine_config_from_args(args)
        from engine.parallel.rank_worker import run_rank
        run_rank(args.rank, config)
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(str(exc)) from None
    return 0
