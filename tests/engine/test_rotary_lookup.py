"""RotaryEmbedding.lookup gathers cos/sin once per forward and must never serve stale rows:
a persistent positions buffer refilled in place (graph replay) or an inference tensor."""

import torch

from engine.layers.rotary import RotaryEmbedding


def _reference(rot: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """HF's formula: x * cos + rotate_half(x) * sin, with the plain (unsigned) sin table."""
    half = rot.half
    signed = rot.sin_signed[positions]
    sin = torch.cat((-signed[:, :half], signed[:, half:]), dim=-1).unsqueeze(1)
    cos = rot.cos[positions].unsqueeze(1)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def test_rotation_equals_rotate_half_formula():
    rot = RotaryEmbedding(16, 64, 10000.0)
    pos = torch.tensor([0, 3, 7, 63])
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    rq, rk = rot(pos, q, k)
    assert torch.equal(rq, _reference(rot, pos, q))
    assert torch.equal(rk, _reference(rot, pos, k))


def test_lookup_is_shared_within_a_forward_and_refreshed_after_in_place_writes():
    rot = RotaryEmbedding(8, 32, 10000.0)
    buf = torch.tensor([1, 2, 3])
    cos1, _ = rot.lookup(buf, torch.float32)
    again, _ = rot.lookup(buf, torch.float32)
    assert again is cos1                      # same tensor, same version: one gather
    buf.copy_(torch.tensor([5, 6, 7]))        # a graph buffer refilled for the next replay
    cos2, _ = rot.lookup(buf, torch.float32)
    assert torch.equal(cos2.squeeze(1), rot.cos[torch.tensor([5, 6, 7])])


def test_inference_tensors_are_never_cached():
    rot = RotaryEmbedding(8, 32, 10000.0)
    with torch.inference_mode():
        buf = torch.tensor([1, 2])
        cos1, _ = rot.lookup(buf, torch.float32)
        buf.copy_(torch.tensor([9, 10]))      # inference tensors keep no version counter
        cos2, _ = rot.lookup(buf, torch.float32)
    assert not torch.equal(cos1, cos2)
    assert torch.equal(cos2.squeeze(1), rot.cos[torch.tensor([9, 10])])
