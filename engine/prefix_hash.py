"""The chained block hash of the prefix cache, torch-free so the router can compute the
same hashes the nodes publish (prefix-cache-aware routing) without importing the engine."""

from __future__ import annotations


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    # Tuples of ints hash deterministically across processes (no hash randomisation),
    # which lets nodes publish the hashes they hold and routers recompute them.
    return hash((parent if parent is not None else -1, tokens))


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Hashes of the full blocks of `token_ids`, in order, as BlockManager registers them."""
    hashes: list[int] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes
