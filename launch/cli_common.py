"""What the subcommand modules share: CliError and flags that fall back to env variables."""

from __future__ import annotations

import argparse
import os
from typing import Any


class CliError(Exception):
    """A mistake the user can fix; the message is printed as one line, exit status 2."""


def env_argument(parser: argparse.ArgumentParser | Any, flag: str, env: str, default: Any = None,
                 type: Any = str, help: str = "", **kwargs: Any) -> None:
    """Add `flag` whose default comes from the environment variable `env` when it is set
    (the flag still wins). The help text names the variable."""
    raw = os.environ.get(env)
    value = default
    if raw is not None and raw != "":
        try:
            value = type(raw)
        except (TypeError, ValueError):
            raise CliError(f"environment variable {env}={raw!r} is not a valid value for "
                           f"{flag}") from None
    shown = f" (default: {default})" if default not in (None, "") else ""
    parser.add_argument(flag, type=type, default=value, help=f"{help} [env {env}]{shown}",
                        **kwargs)


def env_flag(parser: argparse.ArgumentParser | Any, flag: str, env: str, help: str = "") -> None:
    """A boolean switch that is also on when `env` is 1/true/yes."""
    on = os.environ.get(env, "").strip().lower() in ("1", "true", "yes", "on")
    parser.add_argument(flag, action="store_true", default=on, help=f"{help} [env {env}]")


def env_bool_argument(parser: argparse.ArgumentParser | Any, flag: str, env: str,
                      default: bool, help: str = "") -> None:
    """--x / --no-x whose default comes from `env` (1/true/yes/on or 0/false/no/off)."""
    raw = os.environ.get(env, "").strip().lower()
    value = default
    if raw in ("1", "true", "yes", "on"):
        value = True
    elif raw in ("0", "false", "no", "off"):
        value = False
    elif raw:
        raise CliError(f"environment variable {env}={raw!r} is not a valid value for {flag} "
                       f"(1/true/yes/on or 0/false/no/off)")
    parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value,
                        help=f"{help} [env {env}]")      # argparse adds the default


class _SecretList(argparse.Action):
    """Repeatable; each value may hold several comma-separated items. The first one given on
    the command line replaces what the env variable supplied (the flag wins, as for every
    other flag)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        items = [] if current is self.default else list(current)
        items += [v.strip() for v in values.split(",") if v.strip()]
        setattr(namespace, self.dest, items)


def env_secret_list_argument(parser: argparse.ArgumentParser | Any, flag: str, env: str,
                             help: str = "", **kwargs: Any) -> None:
    """A repeatable flag for secrets (API keys), default from `env` (comma-separated). The
    help never shows the values."""
    raw = os.environ.get(env, "")
    value = [v.strip() for v in raw.split(",") if v.strip()]
    parser.add_argument(flag, action=_SecretList, default=value, help=f"{help} [env {env}]",
                        **kwargs)


def add_tls_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """--tls-ca/--tls-cert/--tls-key: mutual TLS on the links between the cluster's
    processes (cluster/tls.py); all three or none."""
    g = parser.add_argument_group("cluster TLS (router <-> nodes, prefill -> decode)")
    env_argument(g, "--tls-ca", "PDSERVE_TLS_CA", default=None, metavar="PEM",
                 help="the cluster CA bundle: peers must show a certificate it signed")
    env_argument(g, "--tls-cert", "PDSERVE_TLS_CERT", default=None, metavar="PEM",
                 help="this process's certificate (signed by the cluster CA)")
    env_argument(g, "--tls-key", "PDSERVE_TLS_KEY", default=None, metavar="PEM",
                 help="this process's private key")


def tls_from_args(args: argparse.Namespace):
    """TlsConfig, or None for plaintext; CliError names what is missing."""
    from cluster.tls import TlsConfig

    try:
        return TlsConfig.from_args(args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def add_etcd_access_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """TLS to etcd and etcd's own user/password (cluster/discovery/etcd_access.py), the
    same on every process that talks to etcd."""
    g = parser.add_argument_group("etcd TLS and authentication")
    env_argument(g, "--etcd-ca", "PDSERVE_ETCD_CA", default=None, metavar="PEM",
                 help="dial etcd with TLS; its certificate must chain to this CA bundle "
                      "(an https:// endpoint turns TLS on too, with the system's CAs)")
    env_argument(g, "--etcd-cert", "PDSERVE_ETCD_CERT", default=None, metavar="PEM",
                 help="client certificate for etcd's --client-cert-auth (with --etcd-key)")
    env_argument(g, "--etcd-key", "PDSERVE_ETCD_KEY", default=None, metavar="PEM",
                 help="the private key of --etcd-cert")
    env_argument(g, "--etcd-user", "PDSERVE_ETCD_USER", default=None,
                 help="etcd user (with the password)")
    env_argument(g, "--etcd-password", "PDSERVE_ETCD_PASSWORD", default=None,
                 help="etcd password; give it in the env variable, from a Secret: flags "
                      "show in the process list")


def etcd_access_from_args(args: argparse.Namespace):
    """EtcdAccess from the --etcd-* flags; CliError names what is wrong."""
    from cluster.discovery.etcd_access import EtcdAccess

    try:
        return EtcdAccess(ca=args.etcd_ca, cert=args.etcd_cert, key=args.etcd_key,
                          user=args.etcd_user, password=args.etcd_password)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def add_tracing_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """OpenTelemetry tracing (cluster/tracing.py), for the router and every node."""
    env_argument(parser, "--otel-exporter", "PDSERVE_OTEL_EXPORTER", default="none",
                 choices=["none", "console", "otlp"],
                 help="export a trace per request (spans of routing, reservation, prefill, "
                      "KV push, admission, decode, streaming): console (stdout) or otlp "
                      "(OTLP/gRPC); needs pip install 'pdserve[tracing]'")
    env_argument(parser, "--otel-endpoint", "PDSERVE_OTEL_ENDPOINT", default=None,
                 metavar="URL", help="the OTLP collector (default: OpenTelemetry's "
                 "OTEL_EXPORTER_OTLP_ENDPOINT, else localhost:4317)")


def configure_tracing(args: argparse.Namespace, service: str) -> None:
    """Start exporting spans as --otel-exporter says; CliError when it cannot."""
    from cluster import tracing

    try:
        tracing.configure(service, args.otel_exporter, args.otel_endpoint)
    except ValueError as exc:
        raise CliError(str(exc)) from None
