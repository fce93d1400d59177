"""Frozen engine configuration, validated once; the hot path receives values, not this."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"            # auto (the folder's torch_dtype) | float32 | bfloat16 | float16
    device: str = "cpu"            # cpu | cuda[:i] | npu[:i]
    block_size: int = 16
    num_gpu_blocks: int | None = None   # KV blocks; None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    # CPU: map the KV cache (kv_cache.zeroed) and a step's working heap (host_allocator.
    # touch_heap) at start, not at their first use; nodes and the offline LLM do by default
    prefault_memory: bool = False
    # CPU: the KV cache and the weights a decode step streams on 2 MB pages where the OS
    # gives them to memory that asks (engine/huge_pages.py); off: 4 KB pages, as before
    huge_pages: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None    # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    min_decoding_batch_size: int = 0    # pad decode batches up to this (graph buckets)
    attention_backend: str = "sdpa"
    seed: int = 0
    cpu_threads: int | None = None      # torch threads on a CPU device; None: one per core
    # graph-replayed decode (engine/executor/graph.py)
    enable_graph: bool = False
    graph_max_batch_size: int | None = None     # larger decode batches run eagerly;
                                                # None: max_num_seqs
    graph_batch_sizes: tuple[int, ...] | None = None  # buckets; None: 1,2,4,8,16,32,...
    graph_padding: bool = True                  # off: one graph per exact batch size
    graph_max_seq_len: int | None = None        # block-table width of the graphs (longer
                                                # sequences run eagerly); None: max_model_len
    graph_warmup_batch_sizes: tuple[int, ...] = ()    # capture these buckets at start
    # speculative decoding (docs/ARCHITECTURE.md, 'The execution trunk', step 8): None | "mtp";
    # the draft comes from the model folder (num_nextn_predict_layers >= 1) or from
    # speculative_model (a draft folder)
    speculative_method: str | None = None
    num_speculative_tokens: int = 1
    speculative_model: str | None = None
    # batch-invariant mode: a request's tokens (bf16 greedy included) are the same whatever
    # runs beside it, however its prompt is chunked and whether its prefix was cached; CPU
    # only, costs prefill speed (engine/layers/batch_invariant.py)
    batch_invariant: bool = False
    # tensor parallel: this many ranks on torch.distributed (engine/parallel/), rank 0 in
    # this process with the scheduler, the others in processes of their own
    tensor_parallel_size: int = 1
    # "HOST:PORT": the group's rendezvous, rank 0 listening on PORT, the other ranks started
    # apart (`pdserve tp-rank`: the workers of a multi-host group, e.g. a Kubernetes
    # LeaderWorkerSet); None: rank 0 spawns them on this machine
    tensor_parallel_store: str | None = None
    # MoE experts under tensor parallel: 1 (every rank computes every expert, as a dense
    # MLP's copy) or tensor_parallel_size (each rank its share, an all-reduce sums them)
    expert_parallel_size: int = 1

    def __post_init__(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(msg)

        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        need(self.device.split(":")[0] in ("cpu", "cuda", "npu"),
             f"device must be cpu, cuda[:i] or npu[:i], got {self.device!r}")
        need(isinstance(self.block_size, int) and 1 <= self.block_size <= 1024,
             f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        need(self.num_gpu_blocks is None or self.num_gpu_blocks >= 2,
             f"num_gpu_blocks must be >= 2 (block 0 is the padding block), "
             f"got {self.num_gpu_blocks!r}")
        need(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb must be > 0")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        need(self.max_model_len is None or self.max_model_len >= 2,
             f"max_model_len must be >= 2, got {self.max_model_len}")
        need(self.min_decoding_batch_size >= 0, "min_decoding_batch_size must be >= 0")
        need(self.cpu_threads is None or (isinstance(self.cpu_threads, int)
                                          and self.cpu_threads >= 1),
             f"cpu_threads must be an integer >= 1, got {self.cpu_threads!r}")
        self._validate_graph_options(need)
        need(self.speculative_method in (None, "mtp"),
             f"speculative_method must be None or 'mtp', got {self.speculative_method!r}")
        need(isinstance(self.num_speculative_tokens, int)
             and 1 <= self.num_speculative_tokens <= 16,
             f"num_speculative_tokens must be an integer in [1, 16], "
             f"got {self.num_speculative_tokens!r}")
        need(self.speculative_model is None or self.speculative_method is not None,
             "speculative_model needs speculative_method (e.g. 'mtp')")
        need(not self.batch_invariant or self.device.split(":")[0] == "cpu",
             f"batch_invariant runs on cpu only (its attention is the C++ paged kernel), "
             f"got device {self.device!r}")
        need(not (self.batch_invariant and self.speculative_method),
             "batch_invariant with speculative decoding is not supported yet")
        tp = self.tensor_parallel_size
        need(isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1,
             f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        ep = self.expert_parallel_size
        need(isinstance(ep, int) and not isinstance(ep, bool) and ep in (1, tp),
             f"expert_parallel_size must be 1 or tensor_parallel_size ({tp}), got {ep!r} "
             "(expert groups inside the tensor-parallel group are not supported yet)")
        store = self.tensor_parallel_store
        need(store is None or (tp > 1 and store.rpartition(":")[2].isdigit()),
             f"tensor_parallel_store must be HOST:PORT with tensor_parallel_size > 1, "
             f"got {store!r}")
        need(tp == 1 or not (self.speculative_method or self.enable_graph
                             or self.batch_invariant),
             "tensor_parallel_size > 1 runs eager decoding without speculative decoding or "
             "batch-invariant mode for now")
        need(self.enable_chunked_prefill or self.max_model_len is None
             or self.max_num_batched_tokens >= self.max_model_len,
             "without chunked prefill, max_num_batched_tokens must be >= max_model_len")

    def _validate_graph_options(self, need) -> None:
        def positive_ints(name: str) -> tuple[int, ...] | None:
            value = getattr(self, name)
            if value is None:
                return None
            value = tuple(value) if isinstance(value, list | tuple) else value
            need(isinstance(value, tuple) and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value),
                f"{name} must be a list of integers >= 1, got {value!r}")
            object.__setattr__(self, name, value)     # lists become tuples (frozen)
            return value

        sizes = positive_ints("graph_batch_sizes")
        need(sizes is None or len(sizes) > 0, "graph_batch_sizes must not be empty")
        positive_ints("graph_warmup_batch_sizes")
        need(self.graph_max_batch_size is None or (
            isinstance(self.graph_max_batch_size, int) and self.graph_max_batch_size >= 1),
            f"graph_max_batch_size must be >= 1, got {self.graph_max_batch_size!r}")
        need(self.graph_max_seq_len is None or (
            isinstance(self.graph_max_seq_len, int) and self.graph_max_seq_len >= 1),
            f"graph_max_seq_len must be >= 1, got {self.graph_max_seq_len!r}")
