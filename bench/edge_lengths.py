"""Every prompt length against a running cluster: the check of the edge-prompt issue.

    python -m bench.edge_lengths --http http://127.0.0.1:8000 --grpc 127.0.0.1:50051 \\
        [--api-key KEY] [--max-length 100] [--max-tokens 5] [--tls-ca run/tls/ca.crt]

Sends prompts of 1 .. --max-length tokens (each the one before plus a token, so from the
second on the prefix is in the nodes' prefix caches and the prefill computes one token),
one request at a time, over HTTP /v1/completions and over the gRPC API, greedy with
ignore_eos; reports every length that did not return --max-tokens tokens or where HTTP and
gRPC disagree, and exits 1 if any did. The prompt's token ids come from the model's own
tokenizer on a fixed text (the router's /v1/models names the model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from aiohttp import ClientSession

TEXT = ("Prefill and decode nodes share the work of serving a language model: the prefill "
        "node computes the prompt's keys and values and pushes them to the decode node, "
        "which generates the answer one token at a time while the router streams it back "
        "to the client. ") * 8


async def run(args) -> int:
    from engine.tokenizer import load_tokenizer
    from router.client import AsyncGenerationClient

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with ClientSession(headers=headers) as http:
        async with http.get(args.http + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        ids = load_tokenizer(args.model_dir).encode(TEXT) if args.model_dir else None
        if ids is None or len(ids) < args.max_length:
            ids = list(range(100, 100 + args.max_length))
        body = dict(model=model, max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                    return_token_ids=True)
        bad = []
        async with AsyncGenerationClient(args.grpc, timeout=120, api_key=args.api_key,
                                         tls_ca=args.tls_ca) as grpc_client:
            for n in range(1, args.max_length + 1):
                prompt = ids[:n]
                async with http.post(args.http + "/v1/completions",
                                     json=dict(body, prompt=prompt)) as resp:
                    text = await resp.text()
                if resp.status != 200:
                    bad.append(f"{n} tokens over HTTP: {resp.status} {text[:300]}")
                    continue
                got = json.loads(text)["choices"][0]["token_ids"]
                try:
                    out = await grpc_client.generate(prompt, max_tokens=args.max_tokens,
                                                     temperature=0.0, ignore_eos=True)
                except Exception as exc:  # noqa: BLE001 - reported, then the next length
                    bad.append(f"{n} tokens over gRPC: {exc}")
                    continue
                if len(got) != args.max_tokens:
                    bad.append(f"{n} tokens over HTTP: {len(got)} tokens back")
                if list(out.token_ids) != got:
                    bad.append(f"{n} tokens: gRPC {list(out.token_ids)} != HTTP {got}")
                print(f"\r{n}/{args.max_length} lengths, {len(bad)} bad", end="",
                      file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for line in bad:
        print(line)
    print(f"{args.max_length - len({b.split(' ')[0] for b in bad})} of {args.max_length} "
          f"prompt lengths gave {args.max_tokens} tokens over HTTP and gRPC alike")
    return 1 if bad else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--http", default="http://127.0.0.1:8000")
    p.add_argument("--grpc", default="127.0.0.1:50051")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tls-ca", default=None, help="CA of the router's public TLS, if any")
    p.add_argument("--model-dir", default=None, help="the model folder (its tokenizer "
                   "makes the prompts; default: token ids 100, 101, ...)")
    p.add_argument("--max-length", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=5)
    sys.exit(asyncio.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
