"""Speculative decoding: draft tokens cheaply, verify them in the model's one forward.

Each step, a decoding sequence computes its pending token and up to k drafted ones
(`SpeculativeConfig.num_speculative_tokens`) in the same batched forward as everyone
else's decodes and prefills. The logits at each of those positions say which drafts the
model agrees with (`verify.py`); the accepted ones and one more token from the model are
emitted, and the cache rewinds past the rejected ones: `num_computed` drops back and the
blocks that only held rejected drafts return to the free list (`KVCache.rewind`). Drafts
are never published to the prefix index: only verified tokens are.

A proposer is one file registered in `PROPOSERS` (the interface is `base.Proposer`):
"ngram" (prompt lookup, no draft model) and "layers" (a self-speculative draft made of
the model's first layers, which reads and writes the target's own KV pool).
"""

from __future__ import annotations

# isort: off
from kvlab.speculative.base import Proposer
from kvlab.speculative.registry import PROPOSERS
from kvlab.speculative import ngram  # noqa: F401  (registers "ngram")
from kvlab.speculative import layers  # noqa: F401  (registers "layers")
# isort: on

__all__ = ["PROPOSERS", "Proposer"]
