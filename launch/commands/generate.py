"""`pdserve generate "PROMPT"`: one request to a router's gRPC API (pdserve.v1.Generation),
printing the text (as it arrives with --stream) and a line with the token count and finish
reason on stderr."""

from __future__ import annotations

import argparse
import sys

from launch.cli_common import CliError, env_argument

HELP = "send one prompt to a router over gRPC and print the answer"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text (tokenized by the router, no chat template)")
    env_argument(p, "--router", "PDSERVE_ROUTER", default="127.0.0.1:50051",
                 metavar="HOST:PORT", help="the router's gRPC address")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--model", default="", help="model name (default: the cluster's only one)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds")
    env_argument(p, "--api-key", "PDSERVE_API_KEY", default=None, metavar="KEY",
                 help="the router's API key, sent as `authorization: Bearer KEY` (of a "
                      "comma-separated list, the first)")
    env_argument(p, "--router-ca", "PDSERVE_ROUTER_CA", default=None, metavar="PEM",
                 help="connect over TLS, trusting this CA for the router's certificate "
                      "(a router with --public-tls-cert)")


def run(args: argparse.Namespace) -> int:
    import grpc

    from router.client import Completion, GenerationClient

    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature,
                    top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
    out = Completion()
    try:
        key = next((k.strip() for k in (args.api_key or "").split(",") if k.strip()), None)
        with GenerationClient(args.router, timeout=args.timeout, api_key=key,
                              tls_ca=args.router_ca) as client:
            for chunk in client.stream(args.prompt, model=args.model, **sampling):
                out.add(chunk)
                if args.stream:
                    print(chunk.text, end="", flush=True)
    except grpc.RpcError as exc:
        raise CliError(f"{args.router}: {exc.code().name}: {exc.details()}") from None
    if args.stream:
        print(flush=True)
    else:
        print(out.text, flush=True)
    usage = out.usage or {}
    print(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}, prompt tokens: "
          f"{usage.get('prompt_tokens', '?')}, request {out.request_id}]", file=sys.stderr)
    return 0
