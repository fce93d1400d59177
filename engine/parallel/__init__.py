"""Tensor parallelism on torch.distributed: the process group (tp_group.py), the sharding
of a loaded model across ranks (shard.py) and the ranks other than 0 (rank_worker.py)."""
