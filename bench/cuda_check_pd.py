"""The `pd` section of bench/cuda_check.py: PD PUSH on the device.

For each model (tests/tiny_models.py), in float32: tests/pd_harness.PdPair (an
in-process prefill node and decode node, their gRPC service methods called directly),
both nodes' engines on the device, the KV pushed once over the in-process transport and
once over the raw-TCP data plane (loopback sockets), with the decode node eager and with
`enable_graph=True`. 8 prompts, sent concurrently as a router would, greedy. Counts the
sequences whose tokens equal HF `generate`'s and a single-node LLM's on the same device,
and checks that both block pools return to their starting counts.

The nodes import protos/*_pb2_grpc.py, generated for grpcio>=1.85.1; the GPU machine's
image had grpcio 1.84.0 (2026-12), whose import of them fails. Carry wheels there (the
device README's recipe: grpcio==1.85.3 protobuf==7.36.2 into .whl, installed with
`pip install --target /tmp/site` and PYTHONPATH=/tmp/site before the run).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model, random_prompts
from tests.tiny_tokenizer import add_tiny_tokenizer

PD_MODELS = "llama-untied-hd32-llama3rope,qwen3-qknorm-hd24"


def _opts(device: str, graph: bool = False) -> dict:
    return dict(device=device, dtype="float32", block_size=16, num_gpu_blocks=128,
                max_num_seqs=8, enable_graph=graph)


async def _pd_tokens(folder: Path, prompts: list[list[int]], device: str, tcp: bool,
                     graph: bool, max_new: int) -> tuple[list[list[int]], dict]:
    from tests.pd_harness import PdPair
    params = SamplingParams(max_tokens=max_new, temperature=0.0)
    pair = PdPair(folder, _opts(device), _opts(device, graph), tcp=tcp)
    pair.start()
    start = pair.free_blocks()
    try:
        outs = await asyncio.gather(*[pair.generate(f"r{i}", p, params)
                                      for i, p in enumerate(prompts)])
        stats = pair.decode.engine.stats()
    finally:
        await pair.stop()
    info = {"blocks_returned": pair.free_blocks() == start,
            "reservations_left": len(pair.decode.receiver.reservations),
            "decode_graph_replays": stats.get("graph_replays"),
            "decode_graph_fallbacks": stats.get("graph_fallbacks")}
    return [list(o[0]) for o in outs], info


def pd_check(root: Path, device: str, names: list[str], hf_tokens, max_new: int) -> list[dict]:
    """hf_tokens(model, prompts, device) -> HF greedy tokens (cuda_check's)."""
    rows = []
    for name in names:
        folder, hf = make_tiny_model(name, root)
        add_tiny_tokenizer(folder)
        hf = hf.to(device)
        prompts = random_prompts(8, [5, 17, 33, 64], hf.config.vocab_size, seed=1)
        ref = hf_tokens(hf, prompts, device)
        del hf
        llm = LLM(folder, **_opts(device))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=max_new, temperature=0.0))
        single = [list(o.outputs[0].token_ids) for o in outs]
        del llm
        for tcp, graph in itertools.product((False, True), (False, True)):
            toks, info = asyncio.run(_pd_tokens(folder, prompts, device, tcp, graph, max_new))
            row = {"model": name, "transport": "tcp" if tcp else "inproc",
                   "decode_graph": graph, "prompts": len(prompts),
                   "eq_hf": sum(a == b for a, b in zip(toks, ref, strict=True)),
                   "eq_single_node": sum(a == b for a, b in zip(toks, single, strict=True)),
                   "single_node_eq_hf": sum(a == b for a, b in zip(single, ref, strict=True)),
                   "new_tokens": sum(map(len, toks)), **info}
            if row["eq_hf"] < len(prompts) or row["eq_single_node"] < len(prompts):
                row["first_diff"] = next(
                    {"prompt": i, "pd": t, "hf": r, "single": s}
                    for i, (t, r, s) in enumerate(zip(toks, ref, single, strict=True))
                    if t != r or t != s)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows
