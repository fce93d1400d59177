"""`pdserve router`: the OpenAI-compatible HTTP API and the gRPC Generate API in front of
the prefill and decode nodes found in etcd under /pdserve/<cluster>/. Tokenizes with the
model folder's tokenizer, picks nodes by --policy, replays a request on a healthy pair when a
node dies mid-stream. Stateless: run as many routers as you like against one cluster."""

from __future__ import annotations

import argparse

from launch.cli_common import (
    CliError,
    add_etcd_access_arguments,
    add_tls_arguments,
    add_tracing_arguments,
    env_argument,
    env_bool_argument,
    env_flag,
    env_secret_list_argument,
)

HELP = "run a router (OpenAI HTTP + gRPC API) in front of the nodes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from router.policies import DEFAULT_POLICY, POLICIES

    env_argument(p, "--http", "PDSERVE_HTTP", default="127.0.0.1:8000", metavar="HOST:PORT",
                 help="OpenAI-compatible HTTP listen address (port 0: any free port)")
    env_argument(p, "--grpc", "PDSERVE_GRPC", default="127.0.0.1:50051", metavar="HOST:PORT",
                 help="gRPC (pdserve.v1.Generation) listen address")
    env_argument(p, "--etcd", "PDSERVE_ETCD", default="127.0.0.1:2379",
                 metavar="HOST:PORT[,HOST:PORT]", help="etcd endpoints")
    env_argument(p, "--cluster", "PDSERVE_CLUSTER", default="default",
                 help="cluster name: the etcd prefix /pdserve/<cluster>/")
    env_argument(p, "--model", "PDSERVE_MODEL", default=None, metavar="DIR",
                 help="the HF model folder the nodes serve (tokenizer, chat template; "
                      "default: the prepared SmolLM2-135M-Instruct)")
    env_argument(p, "--served-model-name", "PDSERVE_SERVED_MODEL_NAME", default=None,
                 help="the `model` clients pass (default: the folder's name)")
    env_argument(p, "--policy", "PDSERVE_POLICY", default=DEFAULT_POLICY,
                 choices=sorted(POLICIES), help="routing policy")
    env_argument(p, "--max-model-len", "PDSERVE_MAX_MODEL_LEN", default=None, type=int,
                 help="reject prompts at or over this many tokens (default: the model's)")
    env_argument(p, "--max-attempts", "PDSERVE_MAX_ATTEMPTS", default=4, type=int,
                 help="node pairs tried per request, replays after a node failure included")
    env_argument(p, "--stall-timeout", "PDSERVE_STALL_TIMEOUT", default=60.0, type=float,
                 metavar="SECONDS",
                 help="a decode node that sends nothing for this long (once its prefill is "
                      "done) is taken as hung: dropped, and the request replayed elsewhere")
    env_argument(p, "--queue-timeout", "PDSERVE_QUEUE_TIMEOUT", default=30.0, type=float,
                 metavar="SECONDS",
                 help="when every decode node is full, a request waits this long for room "
                      "(in a FIFO queue) before it is answered 429")
    env_argument(p, "--queue-depth", "PDSERVE_QUEUE_DEPTH", default=1000, type=int,
                 metavar="N",
                 help="at most this many requests wait for room; the next is answered 429 "
                      "with Retry-After at once")
    env_argument(p, "--ready-file", "PDSERVE_READY_FILE", default=None, metavar="PATH",
                 help="write {\"http\": URL, \"grpc\": ADDR} here once serving")
    env_secret_list_argument(
        p, "--api-key", "PDSERVE_API_KEY", metavar="KEY",
        help="require this key from clients (HTTP `Authorization: Bearer KEY`, gRPC metadata "
             "`authorization: Bearer KEY`); repeat the flag or separate keys with commas for "
             "several; /health and gRPC health stay open (default: no key, open). Prefer the "
             "env variable: flags show in the process list")
    env_argument(p, "--rate-limit", "PDSERVE_RATE_LIMIT", default=None, metavar="RPS[:BURST]",
                 help="per API key: at most RPS calls a second, BURST at once (default: RPS "
                      "rounded up); over it HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED; "
                      "needs --api-key; counted per router process (default: no limit)")
    env_bool_argument(p, "--metrics", "PDSERVE_METRICS", default=True,
                      help="serve Prometheus /metrics on the HTTP port (open, without a key)")
    env_flag(p, "--grpc-reflection", "PDSERVE_GRPC_REFLECTION",
             help="enable gRPC server reflection (lists the API to clients; default: off)")
    env_argument(p, "--public-tls-cert", "PDSERVE_PUBLIC_TLS_CERT", default=None, metavar="PEM",
                 help="serve HTTPS and gRPC over TLS with this certificate (chain) for public "
                      "clients (default: plaintext, e.g. behind a TLS-terminating ingress)")
    env_argument(p, "--public-tls-key", "PDSERVE_PUBLIC_TLS_KEY", default=None, metavar="PEM",
                 help="the private key of --public-tls-cert")
    add_etcd_access_arguments(p)
    add_tls_arguments(p)
    add_tracing_arguments(p)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from launch.cli_common import configure_tracing, etcd_access_from_args, tls_from_args
    from router.public_tls import PublicTls
    from router.rate_limit import RateLimit
    from router.server import RouterConfig, serve

    model = args.model
    if model is None:
        from launch.default_model import prepare_default_model
        model = str(prepare_default_model(progress=False))
    try:
        config = RouterConfig(model=model, served_model_name=args.served_model_name,
                              http_listen=args.http, grpc_listen=args.grpc, etcd=args.etcd,
                              cluster=args.cluster, policy=args.policy,
                              max_model_len=args.max_model_len, max_attempts=args.max_attempts,
                              stall_timeout_s=args.stall_timeout,
                              queue_timeout_s=args.queue_timeout,
                              queue_depth=args.queue_depth, ready_file=args.ready_file,
                              api_keys=tuple(args.api_key), metrics=args.metrics,
                              rate_limit=(RateLimit.parse(args.rate_limit)
                                          if args.rate_limit else None),
                              grpc_reflection=args.grpc_reflection,
                              tls=tls_from_args(args),
                              etcd_access=etcd_access_from_args(args),
                              public_tls=PublicTls.from_args(args.public_tls_cert,
                                                             args.public_tls_key))
        configure_tracing(args, "pdserve-router")
        asyncio.run(serve(config))
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot start the router: {exc}") from None
    return 0
