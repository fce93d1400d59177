"""The load side of bench/serve.py: `vllm bench serve` (vLLM's own serving benchmark,
vllm/benchmarks/serve.py) run once per load shape against one server, in the peer venv:

    .venv-peer/bin/python bench/serve_client.py RUNS.json

RUNS.json is a list of {"key": ..., "argv": [...]}, each argv exactly what one would pass
to `vllm bench serve`. They run in one process, one after another, through the same
add_cli_args() + main() that the `vllm bench serve` subcommand calls: importing vLLM takes
~15 s of a 2-core machine, and paying that once per server instead of once per shape keeps
it off the measured servers' time. Progress lines for bench/serve.py start with "@@".
A shape that raises is reported (@@error) and the next one still runs.
Runs in the peer venv: it must not import the project.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

from vllm_cli import patch_vllm_version


def main() -> int:
    patch_vllm_version()
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    runs = json.loads(open(sys.argv[1]).read())
    errors = 0
    for i, run in enumerate(runs):
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        print(f"@@start {i} {run['key']}", flush=True)
        t = time.monotonic()
        try:
            bench_main(parser.parse_args(run["argv"]))
        except (Exception, SystemExit) as exc:   # argparse exits; report and go on
            errors += 1
            traceback.print_exc()
            message = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500]
            print(f"@@error {i} {message}", flush=True)
            continue
        print(f"@@done {i} {time.monotonic() - t:.1f}", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
