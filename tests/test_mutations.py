"""The oracles can fail: each deliberately broken engine makes the equality tests fail.

An equality test (engine output == a reference run) that passes on a broken engine proves
nothing. Here three classic KV bugs are planted one at a time, and every equality test that
exercises the broken path must then fail: swap-in restoring zeros, each token's K/V written
one slot off, a freed block handed to two requests. Each break is in the paged cache's
paths, so the naive references stay sound.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import initialize
from test_engine_fuzz import EngineMachine, Oracle, engine_configs
from test_reliability import (
    test_a_one_token_prompt_is_scheduled_once_per_step,
    test_static_batching_resumes_swapped_requests,
)
from test_scheduler import test_four_times_oversubscribed_completes_identically

import kvlab.engine.engine
from kvlab.cache.allocator import BlockAllocator
from kvlab.cache.codecs import StoredKV
from kvlab.cache.pool import KVPool


def swap_in_restores_zeros(monkeypatch) -> None:
    def restore(self, slots, saved):
        zeros = StoredKV({name: torch.zeros_like(t) for name, t in saved.tensors.items()})
        self.codec.load(slots, zeros)

    monkeypatch.setattr(KVPool, "restore", restore)


def slot_off_by_one(monkeypatch) -> None:
    build = kvlab.engine.engine.build_attention_metadata

    def shifted(starts, query_lens, tables, block_size, device):
        meta = build(starts, query_lens, tables, block_size, device)
        if block_size < 64:  # paged engines only (the naive reference keeps its slots)
            meta.slot_mapping = torch.where(
                meta.positions > 0, meta.slot_mapping - 1, meta.slot_mapping
            )  # token p's K/V lands on token p - 1's slot
        return meta

    monkeypatch.setattr(kvlab.engine.engine, "build_attention_metadata", shifted)


def freed_block_handed_out_twice(monkeypatch) -> None:
    decref = BlockAllocator.decref

    def twice(self, block, keep_cached=False):
        became_free = decref(self, block, keep_cached)
        if became_free:
            self.free_blocks.appendleft(block)  # handed out to the next two allocations
        return became_free

    monkeypatch.setattr(BlockAllocator, "decref", twice)


def oversubscribed(mode: str, chunked: bool):
    def run(model):
        test_four_times_oversubscribed_completes_identically(model, mode, chunked)

    run.__name__ = f"oversubscribed[{mode},{'chunked' if chunked else 'whole'}]"
    return run


class SwapMachine(EngineMachine):
    """The engine state machine drawing only pressured pools that swap."""

    @initialize(config=engine_configs(preemption="swap"))
    def build(self, config):
        super().build(config)


def state_machine(model, machine=EngineMachine):
    machine.model, machine.oracle = model, Oracle(model)
    machine.TestCase.settings = settings(
        max_examples=60,
        stateful_step_count=40,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],  # finding the failure is enough; no shrinking
        suppress_health_check=list(HealthCheck),
    )
    machine.TestCase().runTest()


def swapping_state_machine(model):
    state_machine(model, SwapMachine)


def one_token_prompt(model):
    test_a_one_token_prompt_is_scheduled_once_per_step(model, "paged")


def static_swap(model):
    test_static_batching_resumes_swapped_requests(model)


# Each mutation, and the equality tests that exercise the path it breaks.
MATRIX = {
    swap_in_restores_zeros: [oversubscribed("swap", False), oversubscribed("swap", True),
                             static_swap, swapping_state_machine],
    slot_off_by_one: [oversubscribed("recompute", False), oversubscribed("swap", True),
                      one_token_prompt, state_machine],
    freed_block_handed_out_twice: [oversubscribed("recompute", False),
                                   oversubscribed("recompute", True), state_machine],
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
