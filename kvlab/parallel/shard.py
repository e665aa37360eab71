"""Which slice of each layer a tensor-parallel rank holds."""

from __future__ import annotations

import torch

from kvlab.model.runner import LayerWeights


def check_tensor_parallel(tp: int, num_heads: int, num_kv_heads: int) -> None:
    """Raise ValueError unless `tp` ranks can split the heads: tp divides the query
    heads, and either tp divides the KV heads or the KV heads divide tp (replication)."""
    if tp < 1:
        raise ValueError(f"EngineConfig.tensor_parallel_size={tp} must be >= 1")
    if num_heads % tp:
        choices = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"EngineConfig.tensor_parallel_size={tp} must divide the model's {num_heads} "
            f"attention heads: choose one of {choices}"
        )
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"EngineConfig.tensor_parallel_size={tp} and the model's {num_kv_heads} KV heads: "
            "one must divide the other"
        )


def kv_heads_per_rank(tp: int, num_kv_heads: int) -> int:
    """KV heads each rank stores: kv_heads / tp, and at least 1 (replicated past that)."""
    return max(1, num_kv_heads // tp)


def kv_head_range(rank: int, tp: int, num_kv_heads: int) -> range:
    """The KV heads rank `rank` stores (contiguous; shared by tp / kv_heads ranks past tp =
    kv_heads)."""
    per = kv_heads_per_rank(tp, num_kv_heads)
    first = rank * num_kv_heads // tp if tp > num_kv_heads else rank * per
    return range(first, first + per)


def mlp_range(rank: int, tp: int, intermediate: int) -> range:
    """The MLP channels of `rank`: tp nearly equal runs (intermediate need not divide)."""
    bounds = [i * intermediate // tp for i in range(tp + 1)]
    return range(bounds[rank], bounds[rank + 1])


def shard_layer(
    w: LayerWeights, rank: int, tp: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> LayerWeights:
    """Rank `rank`'s slice: its query heads, their KV heads, its MLP channels."""
    per_q = num_heads // tp
    q_rows = torch.arange(rank * per_q * head_dim, (rank + 1) * per_q * head_dim)
    kv = kv_head_range(rank, tp, num_kv_heads)
    kv_rows = torch.arange(kv.start * head_dim, kv.stop * head_dim)
    k_base, v_base = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    qkv_rows = torch.cat([q_rows, k_base + kv_rows, v_base + kv_rows])
    intermediate = w.down.shape[1]
    mlp = mlp_range(rank, tp, intermediate)
    gate_up_rows = torch.cat(
        [torch.arange(mlp.start, mlp.stop), intermediate + torch.arange(mlp.start, mlp.stop)]
    )
    return LayerWeights(
        input_norm=w.input_norm,
        qkv=w.qkv[qkv_rows].contiguous(),  # ((per_q + 2 * per_kv) * head_dim, hidden)
        qkv_bias=None if w.qkv_bias is None else w.qkv_bias[qkv_rows].contiguous(),
        o=w.o[:, q_rows].contiguous(),  # (hidden, per_q * head_dim)
        post_norm=w.post_norm,
        gate_up=w.gate_up[gate_up_rows].contiguous(),  # (2 * channels, hidden)
        down=w.down[:, mlp.start : mlp.stop].contiguous(),  # (hidden, channels)
    )
