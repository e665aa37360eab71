"""Tensor parallelism for real: the runner as `tensor_parallel_size` processes.

Megatron-style, as vLLM shards a Llama: each rank holds its slice of the attention heads
(Q/K/V rows, O columns) and of the MLP (gate/up rows, down columns), computes its part of
every layer, and two all-reduces per layer (after O and after down) sum the parts. Each
rank stores the K/V of *its* KV heads in its own pool, over the one block table the
scheduler on rank 0 decides: per-rank KV is total / tp until tp exceeds the KV heads,
after which each KV head is replicated on tp / kv_heads ranks and per-rank KV stops
shrinking (the embedded model: 9 query heads, 3 KV heads, tp in {1, 3, 9}).

    shard.py    which heads and MLP rows a rank holds; its slice of the weights
    runner.py   ShardedRunner: ModelRunner on a slice, all-reducing row-parallel outputs
    pool.py     DistributedPool: rank 0's pool, mirroring every block copy / swap / poison
                on the other ranks
    worker.py   the worker processes (torch.distributed: gloo on CPU) and their loop
"""

from kvlab.parallel.shard import check_tensor_parallel, kv_heads_per_rank


def start_tensor_parallel(model, tp: int):
    """Rank 0's handle on `tp` ranks running `model` (kvlab.parallel.worker.TensorParallel:
    its `runner`, `attach(pool)` and `close()`), once the heads split evenly."""
    from kvlab.parallel.worker import TensorParallel

    cfg = model.config
    check_tensor_parallel(tp, cfg.num_attention_heads, cfg.num_key_value_heads)
    return TensorParallel(model, tp)


__all__ = ["check_tensor_parallel", "kv_heads_per_rank", "start_tensor_parallel"]
