"""`python -m launch.healthcheck`: the container image's HEALTHCHECK, one command for every role.

The image runs `pdserve ROLE ...` as PID 1, so this reads that command line
(/proc/1/cmdline), parses it with the pdserve CLI's own parser (the same env variables apply,
since a health check inherits the container's environment) and probes what that role serves:

- router: HTTP GET /health on --http (200 = it knows at least one prefill and one decode
  node, or one aggregated node);
- prefill / decode / aggregated: grpc.health.v1 Check("") on --listen (SERVING = loaded,
  registered and not draining);
- up: the local launcher's router, HTTP /health on --http-port;
- anything else (models prepare, generate, offline): nothing to probe, healthy.

A wildcard listen host (0.0.0.0, ::, empty) is probed on loopback. Exit status 0 = healthy,
1 = not (Docker's convention); one line on stdout says what was checked.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]", "*")


@dataclass(frozen=True)
class HealthTarget:
    kind: str        # "http" | "grpc" | "none"
    address: str     # host:port to probe ("" for kind "none")
    role: str        # the pdserve subcommand
    tls: Any = None  # a node's own TlsConfig: its port admits only cluster certificates

    def describe(self) -> str:
        if self.kind == "http":
            return f"{self.role}: GET http://{self.address}/health"
        if self.kind == "grpc":
            return f"{self.role}: grpc.health.v1 Check at {self.address}"
        return f"{self.role}: nothing to probe"


def pdserve_argv(cmdline: Sequence[str]) -> list[str] | None:
    """The arguments after `pdserve` in a process command line: `pdserve ARGS`,
    `python /venv/bin/pdserve ARGS` (a console script run by its shebang) or
    `python -m launch.cli ARGS`; None when the process is not pdserve."""
    for i, part in enumerate(cmdline):
        if os.path.basename(part) == "pdserve":
            return list(cmdline[i + 1:])
        if part == "-m" and i + 1 < len(cmdline) and cmdline[i + 1] == "launch.cli":
            return list(cmdline[i + 2:])
    return None


def probe_address(listen: str) -> str:
    """HOST:PORT to dial for a listen address: wildcard hosts become loopback."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a HOST:PORT listen address: {listen!r}")
    if host in WILDCARD_HOSTS:
        host = "[::1]" if host in ("::", "[::]") else "127.0.0.1"
    return f"{host}:{port}"


def target_for(args: argparse.Namespace) -> HealthTarget:
    role = args.command
    if role == "router":
        return HealthTarget("http", probe_address(args.http), role)
    if role in ("prefill", "decode", "aggregated"):
        from launch.cli_common import tls_from_args
        return HealthTarget("grpc", probe_address(args.listen), role, tls_from_args(args))
    if role == "up":
        return HealthTarget("http", f"127.0.0.1:{args.http_port}", role)
    return HealthTarget("none", "", role)


def target_from_argv(argv: Sequence[str]) -> HealthTarget:
    from launch.cli import build_parser

    return target_for(build_parser().parse_args(list(argv)))


def check_http(address: str, timeout: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout) as reply:
            return reply.getcode() == 200, f"HTTP {reply.getcode()}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"unreachable: {getattr(exc, 'reason', exc)}"


def check_grpc(address: str, timeout: float, tls=None) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (grpc.insecure_channel(address) if tls is None else grpc.secure_channel(
        address, tls.grpc_channel_credentials(), tls.grpc_channel_options()))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"gRPC {exc.code().name}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return name == "SERVING", name


CHECKS = {"http": check_http, "grpc": check_grpc}


def check(target: HealthTarget, timeout: float) -> tuple[bool, str]:
    if target.kind == "none":
        return True, "ok"
    if target.kind == "grpc":
        return check_grpc(target.address, timeout, target.tls)
    return CHECKS[target.kind](target.address, timeout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.healthcheck",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cmdline-file", type=Path, default=Path("/proc/1/cmdline"),
                        help="NUL-separated command line of the pdserve process")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per probe")
    opts = parser.parse_args(argv)
    try:
        cmdline = [p for p in opts.cmdline_file.read_bytes().decode().split("\0") if p]
    except OSError as exc:
        print(f"unhealthy: cannot read {opts.cmdline_file}: {exc}")
        return 1
    args = pdserve_argv(cmdline)
    if args is None:
        print(f"unhealthy: {opts.cmdline_file} is not a pdserve command: {' '.join(cmdline)}")
        return 1
    try:
        target = target_from_argv(args)
    except SystemExit:  # argparse already printed why
        print("unhealthy: cannot parse the pdserve command line")
        return 1
    except Exception as exc:  # noqa: BLE001 - CliError for a bad env value, ValueError
        print(f"unhealthy: {exc}")
        return 1
    healthy, detail = check(target, opts.timeout)
    print(f"{'healthy' if healthy else 'unhealthy'}: {target.describe()}: {detail}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
