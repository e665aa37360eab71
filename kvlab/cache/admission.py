"""Admission for the paged cache: when a request may start, and what it is promised.

Two policies, named by `EngineConfig.admission` and registered in `ADMISSIONS`:

- reserve: a request is admitted only if the blocks it could ever need fit beside what
  running sequences could still claim (`future_blocks`: growth to
  ceil(min(prompt + max_new_tokens, max_model_len) / block_size), one copy of a shared
  block it will write, and the tails of its n - 1 samples not yet forked). Blocks are
  taken lazily, so memory is only *held* as tokens arrive, but nobody ever runs out.
- watermark: a request is admitted when the blocks of its first step's tokens (its
  prompt, or the first chunk of it) fit and `watermark` of the pool stays free for
  running sequences to grow into (waived when none runs). Later chunks and decodes take
  blocks as they run, as in vLLM V1; when blocks run out the scheduler preempts.

A cached block a prefix hit would reuse is taken out of the LRU pool when the request is
admitted, so it counts as taken (`pinned`) in both.
"""

from __future__ import annotations

from typing import ClassVar

from kvlab.cache.base import KVCache
from kvlab.cache.prefix import PrefixMatch
from kvlab.registry import Registry
from kvlab.sequence import Sequence
from kvlab.units import ceil_div


class AdmissionPolicy:
    """Decides whether a request fits now, and what running requests are promised."""

    name: ClassVar[str]  # set by ADMISSIONS.register
    takes_first_step: ClassVar[bool] = False  # admission takes the first step's blocks

    def __init__(self, cache: KVCache, watermark: float):
        self.cache = cache

    def fits(self, seq: Sequence, match: PrefixMatch, alone: bool, chunk: int | None) -> bool:
        """Whether `seq`, reusing `match`, may start now (`alone`: nothing runs; `chunk`:
        the most tokens its first step computes, None: all)."""
        raise NotImplementedError

    def promised(self) -> int:
        """Blocks promised to running sequences that an admission must leave them."""
        return 0

    def headroom(self, alone: bool) -> int:
        """Blocks kept free for running sequences to grow into."""
        return 0

    def resume_blocks(self, seq: Sequence, held: int) -> int:
        """Blocks `seq` must find to run again holding `held` blocks of KV written in from
        outside (swap-in, a disaggregated arrival): those, and what this policy would
        promise it."""
        return held

    def check_group(self, seq: Sequence) -> None:
        """Raise ValueError if the request could never be admitted under this policy."""


ADMISSIONS: Registry[type[AdmissionPolicy]] = Registry("admission policy", "admission")


def worst_case_blocks(cache: KVCache, seq: Sequence) -> int:
    """Blocks `seq` holds at its longest: prompt + max_new_tokens, within max_model_len."""
    tokens = min(len(seq.prompt_ids) + seq.params.max_new_tokens, cache.max_model_len)
    return ceil_div(tokens, cache.block_size)


def unforked_blocks(cache: KVCache, seq: Sequence) -> int:
    """Blocks the n - 1 samples not yet forked from `seq` may claim: each shares the
    prompt's full blocks and grows its own tail; one more for the copy of a shared, partly
    filled last prompt block (every sharer but the last writer copies it)."""
    if seq.params.n == 1 or seq.parent_id is not None or seq.first_token_s is not None:
        return 0
    prompt = len(seq.prompt_ids)
    tail = worst_case_blocks(cache, seq) - prompt // cache.block_size
    return (seq.params.n - 1) * tail + (prompt % cache.block_size != 0)


def first_step_end(cache: KVCache, seq: Sequence, match: PrefixMatch, chunk: int | None):
    """Tokens `seq` holds after its first step: the prefix hit, then `chunk` more (None:
    every token it has)."""
    return tokens_after_first_step(
        seq, len(match.blocks) * cache.block_size + match.partial_tokens, chunk
    )


def tokens_after_first_step(seq: Sequence, hit: int, chunk: int | None) -> int:
    """`hit` tokens from a prefix cache, then `chunk` more (None: every token it has)."""
    return seq.num_tokens if chunk is None else min(seq.num_tokens, hit + chunk)


def available(cache: KVCache, match: PrefixMatch) -> int:
    """Blocks an admission reusing `match` can take: free and evictable cached ones, less
    the cached ones the match takes out of the LRU pool (its blocks, and a partial hit's
    source while it is copied)."""
    blocks = match.blocks + ([match.partial_block] if match.partial_block is not None else [])
    pinned = sum(1 for b in blocks if b in cache.allocator.cached)
    return cache.allocator.num_available - pinned


@ADMISSIONS.register("reserve")
class ReserveAdmission(AdmissionPolicy):
    def fits(self, seq, match, alone, chunk) -> bool:
        cache = self.cache
        need = worst_case_blocks(cache, seq) - len(match.blocks) + unforked_blocks(cache, seq)
        return need <= available(cache, match) - self.promised()

    def promised(self) -> int:
        return sum(self.future_blocks(seq) for seq in self.cache.sequences.values())

    def resume_blocks(self, seq: Sequence, held: int) -> int:
        """Its worst case, as at admission: once it runs, it is promised the rest."""
        return max(held, worst_case_blocks(self.cache, seq)) + unforked_blocks(self.cache, seq)

    def future_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` may still take: growth to its worst case, a copy of the shared
        block its next write lands in, and its unforked samples' tails."""
        cache = self.cache
        grow = max(0, worst_case_blocks(cache, seq) - len(cache.tables[seq.request_id]))
        return grow + cache.must_copy(seq) + unforked_blocks(cache, seq)

    def check_group(self, seq: Sequence) -> None:
        cache = self.cache
        group = worst_case_blocks(cache, seq) + unforked_blocks(cache, seq)
        if group > cache.num_blocks:
            raise ValueError(
                f"request with SamplingParams.n={seq.params.n} needs {group} blocks of "
                f"{cache.block_size} tokens for all its samples under reserve admission, but "
                f"the KV budget holds only {cache.num_blocks} blocks"
            )


@ADMISSIONS.register("watermark")
class WatermarkAdmission(AdmissionPolicy):
    takes_first_step = True  # the next admission in the same step sees them gone

    def __init__(self, cache: KVCache, watermark: float):
        super().__init__(cache, watermark)
        self.watermark_blocks = int(watermark * cache.num_blocks)

    def fits(self, seq, match, alone, chunk) -> bool:
        cache = self.cache
        need = ceil_div(first_step_end(cache, seq, match, chunk), cache.block_size)
        return need - len(match.blocks) <= available(cache, match) - self.headroom(alone)

    def headroom(self, alone: bool) -> int:
        return 0 if alone else self.watermark_blocks
