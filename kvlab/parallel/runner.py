"""ShardedRunner: the model runner on one rank's slice of every layer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvlab.cache.pool import KVPool
from kvlab.cache.spec import KVSpec
from kvlab.model.linear import Linears
from kvlab.model.metadata import AttentionMetadata
from kvlab.model.runner import FusedModel, LayerWeights, ModelRunner
from kvlab.parallel.shard import check_tensor_parallel, kv_heads_per_rank, shard_layer


class ShardedRunner(ModelRunner):
    """Rank `rank` of `tp`: its query heads, their KV heads and its MLP channels.

    Embedding, norms and LM head are replicated (they are small); every rank computes the
    logits, rank 0's are used. On rank 0, `forward` first sends the step to the workers
    (`leader`, kvlab.parallel.worker.TensorParallel), so every rank runs the same forward
    and meets at the all-reduces; a rank that dies meanwhile raises EngineDead.
    """

    def __init__(self, hf_model: torch.nn.Module, rank: int, tp: int, leader=None):
        self.rank, self.tp, self.leader = rank, tp, leader
        super().__init__(hf_model)  # slices the layers (`_weights`) with the model's heads
        self.num_heads = self.num_heads // tp
        self.num_kv_heads = kv_heads_per_rank(tp, self.num_kv_heads)
        self.kv_spec = KVSpec(len(self.layers), self.num_kv_heads, self.head_dim)
        self.all_reduces = 0  # collectives this rank has joined (2 per layer per forward)

    def _weights(self, fused: FusedModel) -> tuple[list[LayerWeights], Linears]:
        """This rank's slice of every layer, and matmuls over the slices only (the whole
        model's are never packed here)."""
        heads, kv_heads = self.num_heads, self.num_kv_heads  # the whole model's, so far
        check_tensor_parallel(self.tp, heads, kv_heads)
        layers = [
            shard_layer(w, self.rank, self.tp, heads, kv_heads, self.head_dim) for w in fused.layers
        ]
        return layers, self.pack(layers)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial)  # sum over ranks, in place
        self.all_reduces += 1
        return partial

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        pool: KVPool,
        all_logits: bool = False,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        pool = getattr(pool, "local", pool)
        if self.leader is None:  # ranks 1 .. tp - 1: rank 0's message brought them here
            return super().forward(input_ids, meta, pool, all_logits, logits_at)
        with self.leader.watch():  # rank 0: the workers run the same step
            self.leader.send(("forward", input_ids, meta, all_logits, logits_at))
            return super().forward(input_ids, meta, pool, all_logits, logits_at)
