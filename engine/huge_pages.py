"""Host memory on transparent huge pages (2 MB) for what a CPU decode step streams: the KV
cache and the linears' packed weight copies.

Why: a decode step reads every weight once and each running sequence's K/V once, hundreds
of MB a step, through 4 KB pages. Measured on a 2-core AMX Xeon VM (SmolLM2-135M bf16,
docs/perf/HISTORY.md, "Huge pages"): the 30 layers' decode linears at 64 rows 18.5 -> 16.1
ms a step with their packed weights on huge pages; decode attention over 64 x 300-700
tokens 49.7 -> 45 ms with the cache's blocks scattered (as decode growth leaves them) and
38 -> 37 ms with them in order; a batch-64 decode step at 400-token contexts 61.4 -> 56.3
ms with both.

How: Linux gives huge pages to private anonymous memory advised MADV_HUGEPAGE when its
transparent_hugepage mode is `madvise` (the usual default) or `always`. Shared anonymous
memory (what Python's `mmap.mmap(-1, n)` maps) is shmem and takes none; nor does memory
from malloc here, which host_allocator.py keeps in the brk heap. So the cache is mapped
privately and advised, and after load the packed copies (and the large dense weights: the
embedding, a float32 model's linears) are copied into one advised mapping of their own
(HugePageArena, engine/models/loader.py). Where the OS has no huge pages (mode `never`,
another OS) the same mappings stay on 4 KB pages: nothing fails.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGN = 4096        # each tensor moved starts on a page of its own (oneDNN, AMX loads)


def mode(path: Path = MODE_FILE) -> str:
    """The OS's transparent huge page mode (`always`, `madvise`, `never`), or `none` where
    it has none to say (not Linux, or a kernel built without them)."""
    try:
        text = path.read_text()
    except OSError:
        return "none"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "none"


def advised() -> bool:
    """Whether memory advised MADV_HUGEPAGE gets huge pages here."""
    return mode() in ("always", "madvise")


def anonymous_mapping(nbytes: int, huge_pages: bool) -> mmap.mmap:
    """A private anonymous mapping of `nbytes` zero bytes, resident only once written;
    advised to take huge pages when `huge_pages` (and the OS has the advice)."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:         # a kernel without transparent huge pages
            pass
    return buf


class HugePageArena:
    """One mapping advised to take huge pages, filled with copies of tensors in turn, each
    on a page boundary; the mapping lives as long as any copy. Sized up front (its pages
    are resident only once written), so a caller that drops each original as it is copied
    holds one extra tensor at a time, not a second model."""

    def __init__(self, nbytes: int):
        self.size = max(ALIGN, self.footprint(nbytes))
        self._raw = torch.frombuffer(anonymous_mapping(self.size, huge_pages=True),
                                     dtype=torch.uint8)
        self.used = 0

    @staticmethod
    def footprint(nbytes: int) -> int:
        """What a tensor of `nbytes` takes in an arena: whole pages."""
        return -(-nbytes // ALIGN) * ALIGN

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` (a contiguous CPU tensor) in the arena."""
        if not (t.device.type == "cpu" and t.is_contiguous()):
            raise ValueError(f"HugePageArena takes contiguous CPU tensors, got {t.device} "
                             f"with strides {t.stride()}")
        n = t.numel() * t.element_size()
        if self.used + self.footprint(n) > self.size:
            raise ValueError(f"HugePageArena of {self.size} bytes is full: {self.used} used, "
                             f"{n} more asked")
        dst = self._raw[self.used:self.used + n].view(t.dtype).view(t.shape)
        dst.copy_(t)
        self.used += self.footprint(n)
        return dst
