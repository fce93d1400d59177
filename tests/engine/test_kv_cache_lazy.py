"""The CPU KV cache is zero and costs memory only as it is used (engine/kv_cache.py)."""

import torch

from engine.kv_cache import KVCache


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_cpu_cache_is_zero_writable_and_not_resident_until_used():
    before = _rss_bytes()
    # 2 x 4 layers x [4 heads, 2048 blocks, 16, 64] float32 = 512 MiB
    cache = KVCache(4, 2048, 16, 4, 64, torch.float32, torch.device("cpu"))
    k, v = cache.layer(3)
    assert k.shape == (4, 2048, 16, 64) and k.dtype == torch.float32
    k[:, 5].fill_(2.0)                       # one block written, two read
    assert k[:, 5].eq(2.0).all() and not k[:, 6].any() and not v[:, 5].any()
    grown = _rss_bytes() - before
    assert grown < 64 << 20, f"a cache with one block used made {grown >> 20} MiB resident"
    # (reading a page maps it, so the whole-tensor checks come after the measurement)
    assert k.count_nonzero() == 4 * 16 * 64
    assert not v.any() and not cache.layer(2)[0].any()     # layers do not share memory
