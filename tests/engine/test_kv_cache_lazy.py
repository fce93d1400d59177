"""The CPU KV cache is zero and costs memory only as it is used (engine/kv_cache.py)."""

import torch

from engine.kv_cache import KVCache
from tests.smaps import mapping_of


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


def test_prefaulted_cache_is_zero_and_resident_from_the_start():
    """prefault_memory: every page mapped when the cache is made, so writing a block later
    takes no page fault; the contents are the same zeros."""
    import resource

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    before = _rss_bytes()
    # 2 x 2 layers x [4 heads, 1024 blocks, 16, 64] float32 = 64 MiB
    cache = KVCache(2, 1024, 16, 4, 64, torch.float32, torch.device("cpu"), prefault=True)
    assert _rss_bytes() - before > 60 << 20           # resident without a write
    k, v = cache.layer(1)
    f0 = faults()
    k.fill_(1.0)                                      # 16 MiB: 4,096 pages
    written = faults() - f0
    assert written < 4096 // 8, f"{written} faults writing a prefaulted layer"
    assert not v.any() and not cache.layer(0)[0].any()

    lazy = KVCache(1, 1024, 16, 4, 64, torch.float32, torch.device("cpu"))
    f0 = faults()
    lazy.layer(0)[0].fill_(1.0)
    assert faults() - f0 > 4096 // 2                  # the lazy cache faults as it goes


def _resident_bytes_of_mapping(address: int) -> tuple[int, int]:
    """(size, resident bytes) of this process's mapping that holds `address` (smaps)."""
    size, fields = mapping_of(address)
    return size, fields["Rss"] * 1024


def test_offline_llm_maps_its_cache_at_start_unless_told_not_to(tmp_path):
    """LLM (the offline API) prefaults its CPU cache by default, as nodes do; the option
    still turns it off. Checked on the cache's own mapping: resident before any request."""
    from engine import LLM
    from tests.tiny_models import make_tiny_model

    folder = make_tiny_model("llama-hd64-gqa3", tmp_path)[0]
    for prefault in (None, False):
        opts = {} if prefault is None else {"prefault_memory": prefault}
        llm = LLM(folder, dtype="float32", num_gpu_blocks=4096, **opts)
        assert llm.config.prefault_memory is (prefault is None)
        for t in llm.engine.kv_cache.layer(0):
            size, resident = _resident_bytes_of_mapping(t.data_ptr())
            assert size >= t.numel() * t.element_size()
            if prefault is None:
                assert resident == size, f"{resident >> 20} of {size >> 20} MiB resident"
            else:
                assert resident < size // 8, f"a lazy cache has {resident >> 20} MiB resident"
        del llm
