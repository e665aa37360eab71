"""The oracles can fail: each deliberately broken engine makes the equality tests fail.

An equality test (engine output == a reference run) or an invariant that passes on a
broken engine proves nothing. Here classic KV bugs are planted one at a time, and every
test that exercises the broken path must then fail: swap-in restoring zeros, each
token's K/V written one slot off, a freed block handed to two requests, a speculative
rollback that keeps its blocks, a tier load that corrupts K, end_session that keeps the
tier copies, a sliding window that keeps one block too many, a hybrid cache's sliding
group that drops a block its window still reaches. Each break is in the paged (or
hybrid) cache's paths, so the naive references stay sound.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import Phase
from hypothesis.stateful import initialize
from test_engine_fuzz import EngineMachine, engine_configs, run_machine
from test_reliability import (
    test_a_one_token_prompt_is_scheduled_once_per_step,
    test_static_batching_resumes_swapped_requests,
)
from test_scheduler import test_four_times_oversubscribed_completes_identically

import kvlab.engine.core
from kvlab.cache.allocator import BlockAllocator
from kvlab.cache.codecs import StoredKV
from kvlab.cache.paged import PagedCache
from kvlab.cache.pool import KVPool
from kvlab.cache.retention import WindowRetention
from kvlab.cache.tiers.connector import TierConnector


def swap_in_restores_zeros(monkeypatch) -> None:
    def restore(self, slots, saved):
        zeros = StoredKV({name: torch.zeros_like(t) for name, t in saved.tensors.items()})
        self.codec.load(slots, zeros)

    monkeypatch.setattr(KVPool, "restore", restore)


def slot_off_by_one(monkeypatch) -> None:
    build = kvlab.engine.core.build_attention_metadata

    def shifted(starts, query_lens, tables, block_size, device):
        meta = build(starts, query_lens, tables, block_size, device)
        if block_size < 64:  # paged engines only (the naive reference keeps its slots)
            meta.slot_mapping = torch.where(
                meta.positions > 0, meta.slot_mapping - 1, meta.slot_mapping
            )  # token p's K/V lands on token p - 1's slot
        return meta

    monkeypatch.setattr(kvlab.engine.core, "build_attention_metadata", shifted)


def freed_block_handed_out_twice(monkeypatch) -> None:
    decref = BlockAllocator.decref

    def twice(self, block, keep_cached=False):
        became_free = decref(self, block, keep_cached)
        if became_free:
            self.free_blocks.appendleft(block)  # handed out to the next two allocations
        return became_free

    monkeypatch.setattr(BlockAllocator, "decref", twice)


def rollback_keeps_its_blocks(monkeypatch) -> None:
    monkeypatch.setattr(PagedCache, "_trim", lambda self, seq: [])  # drafts' blocks stay


def tier_load_corrupts_k(monkeypatch) -> None:
    load = TierConnector._timed_load

    def corrupting(self, entry, layer):
        load(self, entry, layer)
        slots = self.cache.block_slots([entry[0]])
        self.cache.pool.k.view(torch.uint8)[:, slots] ^= 0x55  # every layer's K, flipped

    monkeypatch.setattr(TierConnector, "_timed_load", corrupting)


def end_session_keeps_tier_copies(monkeypatch) -> None:
    monkeypatch.setattr(TierConnector, "discard", lambda self, key: [])


def window_keeps_a_block_too_many(monkeypatch) -> None:
    drop = WindowRetention.drop
    monkeypatch.setattr(WindowRetention, "drop", lambda self, table, n: drop(self, table, n)[1:])


def window_reach_one_block_short(monkeypatch) -> None:
    """A sliding group's reach starts one block late: it drops a block its window still
    reads, and its own check_integrity, asking the same reach, agrees (the ledger does not)."""
    start = WindowRetention.recent_start

    def late(self, num_computed, window):
        return start(self, num_computed + self.block_size, window)

    monkeypatch.setattr(WindowRetention, "recent_start", late)


def oversubscribed(mode: str, chunked: bool):
    def run(model):
        test_four_times_oversubscribed_completes_identically(model, mode, chunked)

    run.__name__ = f"oversubscribed[{mode},{'chunked' if chunked else 'whole'}]"
    return run


def focused(focus: str | None, examples: int = 60, steps: int = 40):
    """The engine state machine, drawing only configs with `focus` (None: any)."""

    class Focused(EngineMachine):
        @initialize(config=engine_configs(focus=focus))
        def build(self, config):
            super().build(config)

    def run(model):  # finding the failure is enough; no shrinking
        run_machine(model, Focused, examples, steps, phases=[Phase.generate])

    run.__name__ = f"state_machine[{focus or 'any'}]"
    return run


def one_token_prompt(model):
    test_a_one_token_prompt_is_scheduled_once_per_step(model, "paged")


def static_swap(model):
    test_static_batching_resumes_swapped_requests(model)


# Each mutation, and the tests that exercise the path it breaks.
MATRIX = {
    swap_in_restores_zeros: [oversubscribed("swap", False), oversubscribed("swap", True),
                             static_swap, focused("swap")],
    slot_off_by_one: [oversubscribed("recompute", False), oversubscribed("swap", True),
                      one_token_prompt, focused(None)],
    freed_block_handed_out_twice: [oversubscribed("recompute", False),
                                   oversubscribed("recompute", True), focused(None)],
    rollback_keeps_its_blocks: [focused("speculation", 20)],
    tier_load_corrupts_k: [focused("tiers", 30)],
    end_session_keeps_tier_copies: [focused("tiers", 30)],
    window_keeps_a_block_too_many: [focused("window", 20)],
    window_reach_one_block_short: [focused("hybrid", 20)],
}  # fmt: skip
CASES = [(m, t) for m, tests in MATRIX.items() for t in tests]


@pytest.mark.parametrize(
    "mutation, equality_test", CASES, ids=[f"{m.__name__}-{t.__name__}" for m, t in CASES]
)
def test_the_equality_test_catches_the_broken_engine(tiny_model, mutation, equality_test):
    with pytest.MonkeyPatch.context() as patch:
        mutation(patch)
        with pytest.raises(Exception) as caught:  # noqa: PT011 - any failure counts
            with contextlib.redirect_stdout(None):
                equality_test(tiny_model)
    assert caught.type is not pytest.skip.Exception
