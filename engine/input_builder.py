"""BatchInputBuilder: a scheduled batch -> host ForwardInput
(docs/ARCHITECTURE.md, 'The execution trunk', step 2).

build_forward_input
  process_sequences            per-sequence host vectors (thread pool above a threshold,
                               per-thread BuilderState merged by offset)
    extract_tokens_and_positions   prefill takes [n_kv_cache_tokens, seq_len) (chunked:
                                   a prefix of it), decode the last token
    setup_kv_cache_info            slot_mapping, block_tables, paged-KV triple
    sampling selector              the last token's row, when it is computed this step
  padding_decode_batch_size    pad a decode batch up to min_decoding_batch_size
  state_to_forward_input       host vectors -> ForwardInput (CPU tensors)

Unlike the design the trunk follows, the builder does not advance n_kv_cache_tokens: the
scheduler does so after the step, from what was actually computed (and, with speculation,
accepted).
"""

from __future__ import annotations

from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.block_manager import PADDING_BLOCK_ID
from engine.forward_input import AttentionMetadata, ForwardInput
from engine.sampling_metadata import SamplingMetadata, array_tensor
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence


@dataclass
class BuilderState:
    flatten_tokens_vec: list[int] = field(default_factory=list)
    flatten_positions_vec: list[int] = field(default_factory=list)
    new_token_slot_ids: list[int] = field(default_factory=list)
    block_tables_vec: list[list[int]] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    q_seq_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    last_page_lens: list[int] = field(default_factory=list)
    selected_token_idxes: list[int] = field(default_factory=list)   # local offsets
    selected_seqs: list[Sequence] = field(default_factory=list)


class BatchInputBuilder:
    def __init__(self, block_size: int, vocab_size: int, min_decoding_batch_size: int = 0,
                 num_threads: int = 0, parallel_threshold: int = 512):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.min_decoding_batch_size = min_decoding_batch_size
        self.parallel_threshold = parallel_threshold
        # Under the GIL threads only help when per-sequence work is large; measured in
        # bench/offline_throughput.py, so it is off unless asked for.
        self._pool = ThreadPoolExecutor(num_threads) if num_threads > 1 else None
        self._num_threads = num_threads
        self._last_sampling: tuple[list[int], SamplingMetadata] | None = None

    def build_forward_input(self, sched: SchedulerOutput) -> ForwardInput:
        decodes, prefills = [], []
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            if n == 1 and seq.num_uncomputed_tokens == 1:
                decodes.append((seq, n))
            else:
                prefills.append((seq, n))
        items = decodes + prefills
        state = self.process_sequences(items)
        num_padding = 0
        if not prefills:
            num_padding = self.padding_decode_batch_size(state, len(decodes))
        return self.state_to_forward_input(state, len(decodes), len(prefills), num_padding)

    # ---- 2.1 process_sequences -----------------------------------------------------
    def process_sequences(self, items: list[tuple[Sequence, int]]) -> BuilderState:
        if self._pool is None or len(items) < self.parallel_threshold:
            state = BuilderState()
            for seq, n in items:
                self.process_single_sequence(state, seq, n)
            return state
        step = -(-len(items) // self._num_threads)
        parts = [items[i:i + step] for i in range(0, len(items), step)]
        states = list(self._pool.map(self._process_part, parts))
        return self._merge(states)

    def _process_part(self, items: list[tuple[Sequence, int]]) -> BuilderState:
        state = BuilderState()
        for seq, n in items:
            self.process_single_sequence(state, seq, n)
        return state

    @staticmethod
    def _merge(states: list[BuilderState]) -> BuilderState:
        merged = BuilderState()
        offset = 0
        for s in states:
            for name in ("flatten_tokens_vec", "flatten_positions_vec", "new_token_slot_ids",
                         "block_tables_vec", "seq_lens", "q_seq_lens", "context_lens",
                         "last_page_lens", "selected_seqs"):
                getattr(merged, name).extend(getattr(s, name))
            merged.selected_token_idxes.extend(i + offset for i in s.selected_token_idxes)
            offset += len(s.flatten_tokens_vec)
        return merged

    def process_single_sequence(self, state: BuilderState, seq: Sequence, n: int) -> None:
        start = seq.num_cached_tokens
        self.extract_tokens_and_positions(state, seq, start, start + n)
        self.setup_kv_cache_info(state, seq, start, start + n)
        if start + n == len(seq):   # the newest token is computed: sample after it
            state.selected_token_idxes.append(len(state.flatten_tokens_vec) - 1)
            state.selected_seqs.append(seq)

    @staticmethod
    def extract_tokens_and_positions(state: BuilderState, seq: Sequence, start: int,
                                     end: int) -> None:
        if end - start == 1:
            state.flatten_tokens_vec.append(seq.token_ids[start])
            state.flatten_positions_vec.append(start)
        else:
            state.flatten_tokens_vec.extend(seq.token_ids[start:end])
            state.flatten_positions_vec.extend(range(start, end))

    def setup_kv_cache_info(self, state: BuilderState, seq: Sequence, start: int,
                            end: int) -> None:
        bs, table = self.block_size, seq.block_table
        if end - start == 1:
            state.new_token_slot_ids.append(table[start // bs] * bs + start % bs)
        else:
            state.new_token_slot_ids.extend(
                table[p // bs] * bs + p % bs for p in range(start, end))
        num_blocks = -(-end // bs)
        state.block_tables_vec.append(_table_array(seq)[:num_blocks])
        state.seq_lens.append(end)
        state.q_seq_lens.append(end - start)
        state.context_lens.append(start)
        state.last_page_lens.append(end - (num_blocks - 1) * bs)

    # ---- 2.2 padding_decode_batch_size ---------------------------------------------
    def padding_decode_batch_size(self, state: BuilderState, num_decodes: int) -> int:
        """Pad a decode batch with rows that write to the padding block and read nothing
        real: token 0 at position 0, slot 0 of block 0, KV length 1."""
        pad = self.min_decoding_batch_size - num_decodes
        if pad <= 0:
            return 0
        state.flatten_tokens_vec.extend([0] * pad)
        state.flatten_positions_vec.extend([0] * pad)
        state.new_token_slot_ids.extend([PADDING_BLOCK_ID * self.block_size] * pad)
        state.block_tables_vec.extend([array("i", [PADDING_BLOCK_ID])] * pad)
        state.seq_lens.extend([1] * pad)
        state.q_seq_lens.extend([1] * pad)
        state.context_lens.extend([0] * pad)
        state.last_page_lens.extend([1] * pad)
        return pad

    # ---- 2.3 state_to_forward_input ------------------------------------------------
    def state_to_forward_input(self, state: BuilderState, num_decodes: int,
                               num_prefills: int, num_padding: int) -> ForwardInput:
        tables = state.block_tables_vec
        width = max((len(t) for t in tables), default=0)
        # One flat int32 buffer, padded row by row: torch.tensor over nested lists costs
        # ~100x more per element than array() + frombuffer.
        flat_tables, indices = array("i"), array("i")
        pad_row = array("i", [PADDING_BLOCK_ID]) * width
        for t in tables:      # arrays: each extend is a memcpy
            flat_tables.extend(t)
            flat_tables.extend(pad_row[:width - len(t)])
            indices.extend(t)
        block_tables = array_tensor(flat_tables, torch.int32).reshape(len(tables), width)
        blocks_per_seq = [len(t) for t in tables]
        attn = AttentionMetadata(
            slot_mapping=array_tensor(array("q", state.new_token_slot_ids), torch.int64),
            seq_lens=array_tensor(array("i", state.seq_lens), torch.int32),
            query_start_loc=array_tensor(array("i", cumsum0(state.q_seq_lens)), torch.int32),
            block_tables=block_tables,
            paged_kv_indptr=array_tensor(array("i", cumsum0(blocks_per_seq)), torch.int32),
            paged_kv_indices=array_tensor(indices, torch.int32),
            paged_kv_last_page_len=array_tensor(array("i", state.last_page_lens), torch.int32),
            num_decodes=num_decodes, num_prefills=num_prefills,
            num_decode_tokens=num_decodes, num_padding=num_padding,
            query_lens_host=state.q_seq_lens, context_lens_host=state.context_lens,
            seq_lens_host=state.seq_lens,
        )
        selected = state.selected_seqs
        sampling = None
        if selected:
            sampling = self._sampling_metadata(selected)
        return ForwardInput(
            token_ids=array_tensor(array("q", state.flatten_tokens_vec), torch.int64),
            positions=array_tensor(array("q", state.flatten_positions_vec), torch.int64),
            attn=attn,
            selected_token_idxes=array_tensor(array("q", state.selected_token_idxes), torch.int64),
            sampling=sampling,
            selected_seq_ids=[s.seq_id for s in selected],
        )


    def _sampling_metadata(self, selected: list[Sequence]) -> SamplingMetadata:
        """Penalty-free batches with the same sequences in the same order (steady decode)
        reuse the previous step's metadata: its tensors depend on the params alone."""
        if any(s.params.has_penalties for s in selected):
            return SamplingMetadata.build(
                [s.params for s in selected], [s.prompt_token_ids for s in selected],
                [s.output_token_ids for s in selected], [s.generator for s in selected],
                self.vocab_size)
        key = [s.seq_id for s in selected]
        if self._last_sampling is not None and self._last_sampling[0] == key:
            return self._last_sampling[1]
        empty = [[]] * len(selected)    # token lists are only read for penalties
        meta = SamplingMetadata.build([s.params for s in selected], empty, empty,
                                      [s.generator for s in selected], self.vocab_size)
        self._last_sampling = (key, meta)
        return meta


def _table_array(seq: Sequence) -> array:
    """The sequence's block table as an int32 array, cached across steps.

    A list compare (C-level, identical small ints) is ~10x cheaper than converting the
    list again; the table changes only every block_size tokens, on preemption or on a
    speculative rollback, and then the copy is rebuilt."""
    table = seq.block_table
    cached = getattr(seq, "_table_cache", None)
    if cached is not None and cached[0] == table:
        return cached[1]
    arr = array("i", table)
    seq._table_cache = (list(table), arr)
    return arr


def cumsum0(values: list[int]) -> list[int]:
    out, total = [0], 0
    for v in values:
        total += v
        out.append(total)
    return out
