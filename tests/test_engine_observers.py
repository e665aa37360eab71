"""Step observers (kvlab.engine.observers): called at their points, in order, with what
the step computed; unsubscribed, never again; a point that does not exist is a ValueError;
and no part patches another instead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvlab
from kvlab.cache.base import KVCache
from kvlab.cache.paged import PagedCache
from kvlab.engine.observers import POINTS, StepObservers


def test_observers_see_each_step_s_points_in_order_and_its_rows_logits(tiny_model):
    engine = kvlab.Engine(tiny_model, kvlab.EngineConfig(cache="paged", block_size=4))
    calls, rows = [], []

    def computed(batch, logits):
        calls.append("after_compute")
        assert len(logits) == len(batch.seqs)
        rows.append([(seq.request_id, n, tuple(x.shape)) for (seq, n), x in zip(batch, logits)])

    engine.observers.subscribe("before_schedule", lambda: calls.append("before_schedule"))
    engine.observers.subscribe("after_compute", computed)
    stop = engine.observers.subscribe("after_step", lambda done: calls.append(len(done)))
    params = kvlab.SamplingParams(max_new_tokens=3, ignore_eos=True)
    outputs = engine.generate([[1, 2, 3, 4, 5], [6, 7]], params)
    steps = engine.telemetry.records
    assert len(calls) == 3 * len(steps)  # three points per step, in order
    assert set(calls[0::3]) == {"before_schedule"} and set(calls[1::3]) == {"after_compute"}
    assert calls[2::3] == [0] * (len(steps) - 1) + [2]  # both finish at the last step
    vocab = tiny_model.hf_model.config.vocab_size
    assert rows[0] == [(0, 5, (1, vocab)), (1, 2, (1, vocab))]  # both prompts, one row each
    assert all(n == 1 for step in rows[1:] for _, n, _ in step)  # then one token per decode
    assert [len(o.token_ids) for o in outputs] == [3, 3]

    stop()
    engine.generate([[1, 2]], kvlab.SamplingParams(max_new_tokens=1))
    assert all(c in ("before_schedule", "after_compute") for c in calls[3 * len(steps) :])


def test_a_point_that_does_not_exist_is_named():
    with pytest.raises(ValueError, match="no step point 'after_forward'; the points: "):
        StepObservers().subscribe("after_forward", print)
    assert POINTS == ("before_schedule", "after_compute", "after_step")


def test_no_part_patches_another_or_probes_the_cache():
    """Issue 49's rule, as its grep: outside the part that owns it, nothing in kvlab replaces
    an engine's step or compute or a runner's attention (they subscribe to observers or
    call `runner.use_attention`), probes the cache with getattr (capabilities say what a part
    can do), or asks `can_admit` (allocate_slots decides and takes); the paged cache holds
    its parts as members, not mixin bases."""
    owners = {"kvlab/model/runner.py"}  # the runner sets its own attention_fn
    pattern = re.compile(
        r"can_admit|getattr\(self\.cache|engine\.step = |_compute = |attention_fn = "
    )
    root = Path(kvlab.__file__).parent
    found = [
        f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if str(path.relative_to(root.parent)) not in owners
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "\n".join(found)
    assert PagedCache.__bases__ == (KVCache,)
