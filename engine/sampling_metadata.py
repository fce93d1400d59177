"""SamplingMetadata: one batch's SamplingParams packed into per-row tensors for the Sampler.

Built on the host once per step (the "prepare" stage), then moved to the device with
`to()`. The Python-level flags (all_greedy, no_top_k, ...) are decided here, on the host,
so the Sampler can skip whole kernels without ever reading a device tensor back (no sync).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, fields, replace
from itertools import chain

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float32; 0.0 rows are greedy
    top_k: torch.Tensor  # [N] int64; 0 = disabled (SamplingParams' -1 maps to 0)
    top_p: torch.Tensor  # [N] float32; 1.0 = disabled
    min_p: torch.Tensor  # [N] float32; 0.0 = disabled
    presence_penalty: torch.Tensor  # [N] float32
    frequency_penalty: torch.Tensor  # [N] float32
    repetition_penalty: torch.Tensor  # [N] float32
    # [N, Lp] / [N, Lo] int64 padded with vocab_size; None unless some row has penalties.
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    generators: dict[int, torch.Generator]  # row -> per-request generator (seeded requests)
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool
    max_num_logprobs: int | None  # None: no row wants logprobs; else max k over rows

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
    ) -> SamplingMetadata:
        """Pack a batch on the host: one Python pass over the rows, one zero-copy tensor per field.

        Greedy rows get top_k=0 / top_p=1 / min_p=0: those filters never move the argmax, and
        neutralising them lets an all-greedy-with-top-k batch skip the sort entirely.
        """
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == n):
            raise ValueError(
                f"batch size mismatch: {n} params, {len(prompt_token_ids)} prompts, "
                f"{len(output_token_ids)} outputs, {len(generators)} generators"
            )
        # Column-wise float32 / int64 arrays, wrapped by torch.frombuffer without a copy:
        # torch.tensor over Python lists costs ~10x more per element on the host.
        temperature, top_p, min_p = array("f"), array("f"), array("f")
        pres, freq, rep = array("f"), array("f"), array("f")
        top_k = array("q")
        penalised: list[bool] = []
        max_lp = -1
        for p in params:
            if p.temperature == 0.0:
                temperature.append(0.0)
                top_p.append(1.0)
                min_p.append(0.0)
                top_k.append(0)
            else:
                temperature.append(p.temperature)
                top_p.append(p.top_p)
                min_p.append(p.min_p)
                # top_k >= vocab keeps everything: treat it as disabled so it can skip the sort.
                k = p.top_k
                top_k.append(0 if k < 0 or k >= vocab_size else k)
            pres.append(p.presence_penalty)
            freq.append(p.frequency_penalty)
            rep.append(p.repetition_penalty)
            penalised.append(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                             or p.repetition_penalty != 1.0)
            if p.logprobs is not None and p.logprobs > max_lp:
                max_lp = p.logprobs
        num_greedy = temperature.count(0.0)

        no_penalties = not any(penalised)
        prompt_t = output_t = None
        if not no_penalties:
            # Rows without penalties contribute no tokens: their penalty is the identity anyway,
            # and a long-prompt neighbour should not make them cost scatter work.
            prompts = [t if pen else [] for t, pen in zip(prompt_token_ids, penalised, strict=True)]
            outputs = [t if pen else [] for t, pen in zip(output_token_ids, penalised, strict=True)]
            prompt_t = _pad(prompts, vocab_size)
            output_t = _pad(outputs, vocab_size)

        return cls(
            temperature=array_tensor(temperature, torch.float32),
            top_k=array_tensor(top_k, torch.int64),
            top_p=array_tensor(top_p, torch.float32),
            min_p=array_tensor(min_p, torch.float32),
            presence_penalty=array_tensor(pres, torch.float32),
            frequency_penalty=array_tensor(freq, torch.float32),
            repetition_penalty=array_tensor(rep, torch.float32),
            prompt_token_ids=prompt_t,
            output_token_ids=output_t,
            generators={i: g for i, g in enumerate(generators) if g is not None},
            all_greedy=num_greedy == n,
            all_random=num_greedy == 0,
            no_top_k=top_k.count(0) == n,
            no_top_p=top_p.count(1.0) == n,
            no_min_p=min_p.count(0.0) == n,
            no_penalties=no_penalties,
            max_num_logprobs=None if max_lp < 0 else max_lp,
        )

    def to(self, device: torch.device | str) -> SamplingMetadata:
        """Copy every tensor to `device` (non_blocking); generators and flags are shared.

        Generators must already live on `device`: a torch.Generator cannot be moved, and the
        Sampler hands each one to an op on that device.
        """
        moved = {}
        for fld in fields(self):
            value = getattr(self, fld.name)
            if isinstance(value, torch.Tensor):
                moved[fld.name] = value.to(device, non_blocking=True)
        return replace(self, **moved)


def array_tensor(buf: array, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy host tensor over an array."""
    # frombuffer shares the array's memory (and keeps it alive); it rejects empty buffers.
    return torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)


def _pad(rows: list[list[int]], pad: int) -> torch.Tensor:
    """Right-pad ragged token lists into [N, max_len] int64 without a per-row Python loop."""
    lens_list = [len(r) for r in rows]
    n, width = len(rows), max(lens_list, default=0)
    out = torch.full((n * width,), pad, dtype=torch.int64)
    flat = array_tensor(array("q", chain.from_iterable(rows)), torch.int64)
    if flat.numel():
        lens = array_tensor(array("q", lens_list), torch.int64)
        # Token j of the flat list belongs at j + (row * width - row's offset in the flat list).
        shift = torch.arange(n) * width - (torch.cumsum(lens, 0) - lens)
        out[torch.arange(flat.numel()) + torch.repeat_interleave(shift, lens)] = flat
    return out.view(n, width)
