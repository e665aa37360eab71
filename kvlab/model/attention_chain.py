"""The attention a runner calls, built once from the engine's config.

    attention = build_attention(config, block_size, scores)

The torch reference (kvlab.model.attention), the kernels path (kernel_attention.py) or
batch-invariant attention (invariant.py); wrapped, when a retention policy observes
attention (H2O), by the statistics it collects (scored_attention.py). Every one has the
signature of `pooled_attention`: (q, layer, pool, meta, scale) -> (T, heads, head_dim).
"""

from __future__ import annotations

import torch

from kvlab.config import EngineConfig
from kvlab.model.attention import pooled_attention
from kvlab.model.runner import AttentionFn


def build_attention(
    config: EngineConfig, block_size: int, scores: torch.Tensor | None = None
) -> AttentionFn:
    """The attention function `config` asks for; `scores` (num_blocks,): where a
    retention policy collects the attention mass each block receives, or None."""
    if config.batch_invariant:
        from kvlab.model.invariant import InvariantAttention

        attention = InvariantAttention(kernels=config.attention == "kernels")
    elif config.attention == "kernels":
        from kvlab.model.kernel_attention import KernelAttention

        attention = KernelAttention(block_size)
    else:
        attention = pooled_attention
    if scores is not None:
        from kvlab.model.scored_attention import ScoredAttention

        attention = ScoredAttention(attention, scores, block_size)
    return attention
