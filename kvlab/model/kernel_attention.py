"""The kernel path for ModelRunner: decode steps through kvlab.kernels, the rest in torch.

    runner.use_attention(KernelAttention(cache.block_size))

ModelRunner calls `attention_fn(q, layer, pool, meta, scale)` after writing the step's
K/V to the pool. KernelAttention sends a pure decode step (one new token per sequence)
over a codec the kernels know (the model's dtype, fp16, bf16, int8, fp8) to
`kvlab.kernels.paged_decode_attention`, which reads the pool's storage in place through
the block table; prefill steps, mixed steps and int4/kivi2 stay on `pooled_attention`.
On the CPU, with float K/V and the native kernel built, every step goes to
`kvlab.model.cpu_attention` instead: decodes through the native kernel, prompts after
cached tokens in two flash calls.

`kernel_write` is the same split for writes: `pool.write` through the Triton KV-write
kernel where it applies (no NaN/inf check, unlike the codec's torch path).

The block table is not in AttentionMetadata; it is read off `meta.context_slots`: the
slot of position j * block_size is table[j] * block_size. `block_size` must be the
cache's (for the naive cache, max_model_len); None uses block size 1 (each slot its own
block: correct for every cache, one table entry per token).
"""

from __future__ import annotations

import torch

from kvlab.cache.pool import KVPool
from kvlab.kernels.dispatch import CPU_CODECS
from kvlab.model.attention import pooled_attention
from kvlab.model.cpu_attention import cpu_attention
from kvlab.model.kernel_args import KERNEL_CODECS, pool_layer
from kvlab.model.metadata import AttentionMetadata


def block_tables_from(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """(B, ceil(S / block_size)) int32 block tables, read off meta.context_slots (B, S)."""
    return (meta.context_slots[:, ::block_size] // block_size).to(torch.int32)


class KernelAttention:
    """An attention_fn for ModelRunner that runs decode steps through the kernels.

    backend: None (Triton on CUDA, the native C kernel on the CPU where it built, else the
    torch reference; $KVLAB_KERNELS overrides), "triton", "cpu" or "torch". num_splits:
    None chooses split-K automatically.
    """

    def __init__(
        self,
        block_size: int | None = None,
        backend: str | None = None,
        num_splits: int | None = None,
    ):
        self.block_size = block_size or 1
        self.backend, self.num_splits = backend, num_splits
        self.decode_calls = 0  # layers that went through the kernels (for tests / notebooks)
        self._step: tuple | None = None  # (meta, block tables, context lens) of this step
        self._backend: str | None = None  # chosen on the first call

    def _choose(self, device: torch.device) -> str:
        """The backend for this runner's tensors (kvlab.kernels.choose_backend), once."""
        if self._backend is None:
            from kvlab.kernels import choose_backend  # imports triton: only when used

            self._backend = choose_backend(device, self.backend)
        return self._backend

    def handles(self, pool: KVPool, meta: AttentionMetadata) -> bool:
        """A decode step (one query row per sequence) over a codec the kernels read, with
        whole contexts (a sliding window's decodes take the reference)."""
        decode = meta.query_valid.shape[1] == 1 and meta.window is None
        return decode and pool.kv_codec in KERNEL_CODECS

    def __call__(
        self, q: torch.Tensor, layer: int, pool: KVPool, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if self._choose(q.device) == "cpu" and pool.kv_codec in CPU_CODECS:  # every step
            self.decode_calls += self.handles(pool, meta)
            return cpu_attention(q, layer, pool, meta, scale)
        if not self.handles(pool, meta):
            return pooled_attention(q, layer, pool, meta, scale)
        from kvlab.kernels import paged_decode_attention  # imports triton: only when used

        self.decode_calls += 1
        if self._step is None or self._step[0] is not meta:  # once per step, not per layer
            lens = meta.context_lens.to(torch.int32)
            self._step = (meta, block_tables_from(meta, self.block_size), lens)
        _, tables, lens = self._step
        return paged_decode_attention(
            q,  # (B, heads, head_dim): decode packs one row per sequence
            block_tables=tables,
            context_lens=lens,
            scale=scale,
            block_size=self.block_size,
            num_splits=self.num_splits,
            backend=self.backend,
            **pool_layer(pool, layer),
        )


def kernel_write(
    pool: KVPool,
    layer: int,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str | None = None,
) -> None:
    """pool.write(layer, slots, k, v), through kvlab.kernels.kv_write where it applies."""
    if pool.kv_codec not in KERNEL_CODECS:
        pool.write(layer, slots, k, v)
        return
    from kvlab.kernels import kv_write

    kv_write(k, v, slot_mapping=slots, backend=backend, **pool_layer(pool, layer))
