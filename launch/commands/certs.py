"""`pdserve certs`: make the cluster CA and leaf certificates for mutual TLS between the
router and the nodes (cluster/tls.py), e.g. to put in a Kubernetes Secret. With
--ca-cert/--ca-key an existing CA signs new leaves (rotating leaves without a new CA)."""

from __future__ import annotations

import argparse

from launch.cli_common import CliError

HELP = "make a cluster CA and leaf certificates for the nodes' mutual TLS"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder for ca.crt, ca.key, <name>.crt, <name>.key (keys 0600)")
    p.add_argument("--name", action="append", default=None, metavar="NAME",
                   help="a leaf to make (repeatable; default: router, prefill, decode)")
    p.add_argument("--host", action="append", default=[], metavar="HOST",
                   help="extra SAN (DNS name or IP) in every leaf; clients check the fixed "
                        "cluster name, so this is only for tools that dial by address")
    p.add_argument("--days", type=int, default=365, help="validity of what is made")
    p.add_argument("--ca-cert", default=None, metavar="PEM",
                   help="sign with this existing CA (with --ca-key) instead of a new one")
    p.add_argument("--ca-key", default=None, metavar="PEM")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cluster.tls import make_ca, write_cluster_certs

    if bool(args.ca_cert) != bool(args.ca_key):
        raise CliError("--ca-cert and --ca-key go together")
    if args.days < 1:
        raise CliError(f"--days must be >= 1, got {args.days}")
    try:
        ca = ((Path(args.ca_cert).read_bytes(), Path(args.ca_key).read_bytes())
              if args.ca_cert else make_ca(days=args.days))
        made = write_cluster_certs(args.out, args.name or ["router", "prefill", "decode"],
                                   hosts=args.host, days=args.days, ca=ca)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot make the certificates: {exc}") from None
    for name, tls in made.items():
        print(f"{name}: --tls-ca {tls.ca} --tls-cert {tls.cert} --tls-key {tls.key}")
    return 0
