"""The manifests against the code: every `pdserve ...` container is parsed by the pdserve CLI's
own parser (launch.cli.build_parser) with the environment the pod would have, and what the
parsed flags say (ports, hosts, drain timeout, model folder, etcd endpoints, device) is
compared with the container's ports, probes, grace period, volumes and the Services.

Each check returns a list of problems (strings naming the object and the flag), so tests
can assert "no problems" and negative tests can assert the problem they planted is found.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
from collections.abc import Iterator
from pathlib import PurePosixPath

# the node subcommands a manifest may run: every discovery role is one
from cluster.discovery.records import ROLES as NODE_ROLES
from tests.deploy.manifests import SAMPLE_POD_IP, ContainerView, find, one

WILDCARD = ("0.0.0.0", "::", "[::]", "")
# Env variables pdserve reads that are not flags (launch/default_model.py).
NON_FLAG_ENV = frozenset({"PDSERVE_CACHE_DIR"})
_ENV_IN_HELP = re.compile(r"\[env (PDSERVE_[A-Z0-9_]+)\]")
# What each accelerator device flag needs from the scheduler.
DEVICE_RESOURCES = {"cuda": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}
DRAIN_MARGIN_S = 5


class CliRejected(ValueError):
    """The pdserve CLI refuses a container's command line or environment."""


@contextlib.contextmanager
def pdserve_environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ holding exactly the container's PDSERVE_* variables (the parser reads
    them when it is built), restored afterwards."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("PDSERVE_")}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.startswith("PDSERVE_")})
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("PDSERVE_")]:
            del os.environ[key]
        os.environ.update(saved)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    raise CliRejected(f"pdserve has no subcommand {name!r}")


def _all_actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_actions(sub)


def parse_pdserve(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    """Parse `pdserve ARGV` as the container would run it; CliRejected says why not."""
    from launch.cli import build_parser
    from launch.cli_common import CliError

    if argv[:1] != ["pdserve"] or len(argv) < 2:
        raise CliRejected(f"not a pdserve command: {argv}")
    with pdserve_environment(env):
        try:
            parser = build_parser()
        except CliError as exc:       # a bad value in an env variable
            raise CliRejected(str(exc)) from None
        sub = _subparser(parser, argv[1])
        actions = list(_all_actions(sub))
        known = {m for a in actions for m in _ENV_IN_HELP.findall(a.help or "")}
        unknown = sorted(k for k in env if k.startswith("PDSERVE_")
                         and k not in known and k not in NON_FLAG_ENV)
        if unknown:
            raise CliRejected(f"`pdserve {argv[1]}` reads no env variable "
                              f"{', '.join(unknown)} (it reads: {', '.join(sorted(known))})")
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                args = parser.parse_args(argv[1:])
        except SystemExit:
            lines = errors.getvalue().strip().splitlines()
            raise CliRejected(f"pdserve rejects {' '.join(argv[1:])!r}: "
                              f"{lines[-1] if lines else 'usage error'}") from None
    # argparse checks `choices` only for values given on the command line, not for defaults
    # that came from env variables: check those too.
    for action in actions:
        value = getattr(args, action.dest, None)
        if action.choices is not None and value is not None and not isinstance(
                action, argparse._SubParsersAction) and value not in action.choices:
            raise CliRejected(f"{action.option_strings[0]}={value!r} is not one of "
                              f"{sorted(action.choices)}")
    return args


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not port.isdigit():
        raise CliRejected(f"not a HOST:PORT address: {address!r}")
    return host, int(port)


def router_http_routes() -> set[str]:
    """GET paths the router's HTTP app serves (from the app itself)."""
    from router.http_server import make_app

    return {r.resource.canonical for r in make_app(None).router.routes() if r.method == "GET"}


def _prestop_seconds(c: ContainerView) -> int:
    hook = c.container.get("lifecycle", {}).get("preStop", {})
    return int(hook.get("sleep", {}).get("seconds", 0))


def _check_probe_ports(c: ContainerView, served: set[int]) -> list[str]:
    problems = []
    for kind, probe in c.probes().items():
        for handler in ("httpGet", "tcpSocket", "grpc"):
            if handler in probe:
                port = c.resolve_port(probe[handler]["port"])
                if port not in served:
                    problems.append(f"{c.where}: {kind} {handler} port "
                                    f"{probe[handler]['port']!r} is not a port pdserve "
                                    f"listens on ({sorted(served)})")
    return problems


def _check_listen(c: ContainerView, flag: str, address: str) -> list[str]:
    host, port = split_address(address)
    problems = []
    if host not in WILDCARD:
        problems.append(f"{c.where}: {flag} {address} listens on {host!r} only; other pods "
                        f"cannot reach it (use 0.0.0.0)")
    if port not in c.container_ports():
        problems.append(f"{c.where}: {flag} port {port} is not a containerPort "
                        f"({sorted(c.container_ports())})")
    return problems


def check_router(c: ContainerView, args: argparse.Namespace) -> list[str]:
    from router.server import RouterConfig

    problems = _check_listen(c, "--http", args.http) + _check_listen(c, "--grpc", args.grpc)
    served = {split_address(args.http)[1], split_address(args.grpc)[1]}
    problems += _check_probe_ports(c, served)
    routes = router_http_routes()
    for kind, probe in c.probes().items():
        path = probe.get("httpGet", {}).get("path")
        if path is not None and path not in routes:
            problems.append(f"{c.where}: {kind} GET {path} is not a router route "
                            f"({sorted(routes)})")
    scrape = c.pod.get("metadata", {}).get("annotations", {})
    if scrape.get("prometheus.io/scrape") == "true" and (
            scrape.get("prometheus.io/port") != str(split_address(args.http)[1])
            or scrape.get("prometheus.io/path") not in routes):
        problems.append(f"{c.where}: the prometheus.io annotations ({scrape}) do not name "
                        f"the --http port and a route")
    if c.container.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/health":
        problems.append(f"{c.where}: readinessProbe must be GET /health (ready = nodes known)")
    drain = next(f.default for f in dataclasses.fields(RouterConfig) if f.name == "drain_timeout")
    problems += _check_grace(c, drain, "the router's drain_timeout")
    return problems


def _check_grace(c: ContainerView, drain_s: float, what: str) -> list[str]:
    grace = c.spec.get("terminationGracePeriodSeconds", 30)
    need = _prestop_seconds(c) + drain_s + DRAIN_MARGIN_S
    if grace < need:
        return [f"{c.where}: terminationGracePeriodSeconds {grace} < preStop "
                f"{_prestop_seconds(c)} + {what} {drain_s:g} + {DRAIN_MARGIN_S}"]
    return []


def check_node(c: ContainerView, args: argparse.Namespace) -> list[str]:
    role = args.command
    problems = _check_listen(c, "--listen", args.listen)
    port = split_address(args.listen)[1]
    problems += _check_probe_ports(c, {port})
    ready = c.container.get("readinessProbe", {})
    # with cluster TLS the port admits only cluster certificates: the image's health check
    # (launch.healthcheck, the node's own certificate) replaces the kubelet's grpc probe
    tls = bool(args.tls_cert)
    healthcheck = ready.get("exec", {}).get("command") == ["python", "-m", "launch.healthcheck"]
    if not (healthcheck if tls else ready.get("grpc", {}).get("port") == port):
        problems.append(f"{c.where}: readinessProbe must be the gRPC health check on the "
                        f"--listen port {port}"
                        + (" (with TLS: `python -m launch.healthcheck`)" if tls else ""))
    if "grpc" in c.container.get("livenessProbe", {}):
        problems.append(f"{c.where}: livenessProbe uses gRPC health, which is NOT_SERVING "
                        f"while draining: the node would be killed mid-drain")
    if args.advertise is None:
        problems.append(f"{c.where}: no --advertise: the node would advertise 127.0.0.1")
    else:
        host, adv_port = split_address(args.advertise)
        if host != SAMPLE_POD_IP or adv_port != port:
            problems.append(f"{c.where}: --advertise {args.advertise} is not the pod IP and "
                            f"the --listen port {port}")
    if args.node_id is None or not args.node_id.startswith(c.workload["metadata"]["name"]):
        problems.append(f"{c.where}: --node-id {args.node_id!r} is not the pod name")
    problems += _check_grace(c, args.drain_timeout, "--drain-timeout")
    problems += _check_node_metrics(c, args)
    if role == "decode":
        problems += _check_kv_tcp(c, args)
    device = args.device.split(":")[0]
    limits = c.container.get("resources", {}).get("limits", {})
    for dev, resource in DEVICE_RESOURCES.items():
        if (device == dev) != (resource in limits):
            problems.append(f"{c.where}: --device {args.device} but limits "
                            f"{resource}={limits.get(resource)}")
    if role not in NODE_ROLES:
        problems.append(f"{c.where}: unexpected node role {role}")
    return problems


def node_metrics_port(args: argparse.Namespace) -> int | None:
    """The port of a node's /metrics listener (--metrics-listen); None when it is off."""
    value = str(args.metrics_listen).strip().lower()
    if value in ("", "none", "off"):
        return None
    return split_address(args.metrics_listen)[1]


def _check_node_metrics(c: ContainerView, args: argparse.Namespace) -> list[str]:
    """A node whose pod asks to be scraped serves /metrics on the annotated port, on a
    containerPort other pods can reach."""
    scrape = c.pod.get("metadata", {}).get("annotations", {})
    wanted = scrape.get("prometheus.io/scrape") == "true"
    port = node_metrics_port(args)
    if port is None:
        return [f"{c.where}: prometheus.io/scrape is true but --metrics-listen is off"
                ] if wanted else []
    problems = _check_listen(c, "--metrics-listen", args.metrics_listen)
    if wanted and (scrape.get("prometheus.io/port") != str(port)
                   or scrape.get("prometheus.io/path") != "/metrics"):
        problems.append(f"{c.where}: the prometheus.io annotations ({scrape}) do not name "
                        f"the --metrics-listen port {port} and /metrics")
    return problems


def kv_tcp_port(args: argparse.Namespace) -> int | None:
    """The decode node's raw-TCP KV data plane port; None when it is off."""
    value = str(args.kv_tcp_listen).strip().lower()
    if value in ("", "none", "off"):
        return None
    if value == "auto":
        return 0
    return split_address(args.kv_tcp_listen)[1]


def _check_kv_tcp(c: ContainerView, args: argparse.Namespace) -> list[str]:
    port = kv_tcp_port(args)
    if port is None:
        return []
    if port == 0:
        return [f"{c.where}: --kv-tcp-listen {args.kv_tcp_listen} picks a random port, which "
                f"no containerPort or NetworkPolicy can name; give it a fixed port"]
    return _check_listen(c, "--kv-tcp-listen", args.kv_tcp_listen)


def check_model_mount(c: ContainerView, folder: str, writable: bool) -> list[str]:
    """`folder` lies on the model PVC, mounted read-only (serving) or writable (prepare)."""
    path = PurePosixPath(folder)
    for mount_path, mount, volume in c.mounts():
        if path == PurePosixPath(mount_path) or PurePosixPath(mount_path) in path.parents:
            if "persistentVolumeClaim" not in volume:
                return [f"{c.where}: model {folder} is on volume {volume['name']}, not a PVC"]
            read_only = bool(mount.get("readOnly"))
            if writable and read_only:
                return [f"{c.where}: {folder} must be writable"]
            if not writable and not read_only:
                return [f"{c.where}: the model volume should be mounted readOnly"]
            return []
    return [f"{c.where}: model folder {folder} is on no volume (mounts: "
            f"{[m for m, _, _ in c.mounts()]})"]


def check_etcd(c: ContainerView, args: argparse.Namespace, objects: list[dict]) -> list[str]:
    """Endpoints naming an in-cluster Service must hit its client port."""
    if not find(objects, "StatefulSet", "pdserve-etcd"):
        return []                                     # external etcd: nothing to compare
    problems = []
    for endpoint in str(args.etcd).split(","):
        host, port = split_address(endpoint.strip())
        services = find(objects, "Service", host.split(".")[0])
        if not services:
            problems.append(f"{c.where}: --etcd {endpoint}: no Service {host!r}")
        elif port not in {p["port"] for p in services[0]["spec"]["ports"]}:
            problems.append(f"{c.where}: --etcd {endpoint}: Service {host} has no port {port}")
    return problems


# Secrets a flag could carry: never on the command line (it shows in the process list and in
# the manifest) nor in a ConfigMap; only from a Secret (valueFrom.secretKeyRef).
SECRET_ENV = {"--etcd-password": "PDSERVE_ETCD_PASSWORD", "--api-key": "PDSERVE_API_KEY"}


def check_secrets(c: ContainerView) -> list[str]:
    problems = []
    for flag, env in SECRET_ENV.items():
        if any(a == flag or a.startswith(f"{flag}=") for a in c.argv):
            problems.append(f"{c.where}: {flag} on the command line; give {env} from a "
                            f"Secret (secretKeyRef)")
        items = [e for e in c.container.get("env", []) if e["name"] == env]
        from_secret = bool(items) and "secretKeyRef" in items[-1].get("valueFrom", {})
        if env in c.env and not from_secret:
            problems.append(f"{c.where}: {env} is not from a Secret (secretKeyRef)")
    return problems


def runtime_config_problems(c: ContainerView, args: argparse.Namespace) -> list[str]:
    """What the command builds from its flags before serving (the same validation a pod
    would hit at start): EngineConfig for nodes, RouterConfig for the router."""
    try:
        if args.command in NODE_ROLES and args.model is not None:
            from launch.commands.node_options import engine_config_from_args

            engine_config_from_args(args)
        elif args.command == "router":
            from router.server import RouterConfig

            RouterConfig(model=args.model or "", served_model_name=args.served_model_name,
                         http_listen=args.http, grpc_listen=args.grpc, etcd=args.etcd,
                         cluster=args.cluster, policy=args.policy,
                         max_model_len=args.max_model_len, max_attempts=args.max_attempts,
                         ready_file=args.ready_file)
    except ValueError as exc:
        return [f"{c.where}: `pdserve {args.command}` would refuse to start: {exc}"]
    return []


def check_container(c: ContainerView, objects: list[dict]) -> tuple[argparse.Namespace,
                                                                    list[str]]:
    """Parse one pdserve container and check it; CliRejected if the CLI refuses it."""
    args = parse_pdserve(c.argv, c.env)
    problems: list[str] = runtime_config_problems(c, args)
    if args.command == "router":
        problems += check_router(c, args)
    elif args.command in NODE_ROLES:
        problems += check_node(c, args)
    if args.command in ("router", *NODE_ROLES):
        problems += check_etcd(c, args, objects) + check_secrets(c)
        if args.model is None:
            problems.append(f"{c.where}: no --model/PDSERVE_MODEL (it would try to convert "
                            f"the default model into a read-only cache)")
        else:
            problems += check_model_mount(c, args.model, writable=False)
    if args.command == "models" and args.models_command == "prepare":
        from launch.default_model import model_dir

        folder = str(model_dir(args.cache_dir))
        problems += check_model_mount(c, str(args.cache_dir), writable=True)
        served = one(objects, "ConfigMap", _cluster_configmap(objects))["data"]
        if served.get("PDSERVE_MODEL") != folder:
            problems.append(f"{c.where}: prepares {folder} but PDSERVE_MODEL is "
                            f"{served.get('PDSERVE_MODEL')}")
    return args, problems


def _cluster_configmap(objects: list[dict]) -> str:
    names = [o["metadata"]["name"] for o in find(objects, "ConfigMap")
             if o["metadata"]["name"].startswith("pdserve-cluster")]
    if len(names) != 1:
        raise LookupError(f"expected one pdserve-cluster ConfigMap, found {names}")
    return names[0]
