"""Fault isolation: one request whose forward or sampling raises fails alone.

A step runs one forward for every row of its batch, so an exception there does not say
whose it is. `run_isolated` retries the batch in halves, by request, until each failing
part is one request: that request fails (finish_reason "error", the message on its
output); every other row keeps the logits of the part it ran in. Rows never attend to
each other, so running them in parts computes the same tokens, at the cost of extra
forwards only when something failed.

Two things need care:
- A request admitted in this step may share blocks that another row published ahead of
  computing them (a same-step burst over one prefix). If that publisher fails, those
  blocks were never written, so the sharers (`tainted`) are preempted to recompute
  instead of going on with what they read.
- `EngineDead` (a dead worker process) and `IntegrityError` (a broken engine invariant,
  not a request's fault) are never isolated: nothing can go on.

Sampling is isolated per row by `sample_isolated`: a batched draw that raises is redone
row by row from the generators' states before it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlab.integrity import EngineDead, IntegrityError
from kvlab.sequence import Sequence

Failure = tuple[Sequence, str]  # a row that failed alone, and why
NEVER_ISOLATED = (EngineDead, IntegrityError)  # not one request's fault: the step raises


def group_of(seq: Sequence) -> int:
    """The request a row belongs to (n > 1: its samples share the parent's id)."""
    return seq.request_id if seq.parent_id is None else seq.parent_id


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def run_isolated(attempt: Callable, batch) -> tuple[object, list, list[Failure]]:
    """Run `attempt(batch)` (-> one logits tensor per row); where it raises, retry in
    halves by request. Returns (the batch of rows that ran, with the tokens each computed;
    their logits, in its order; the rows that failed alone)."""
    done, failed = _run(attempt, batch)
    if not failed:
        return batch, [done[id(s)][1] for s in batch.seqs], []
    rows = [i for i, s in enumerate(batch.seqs) if id(s) in done]
    ran = batch.subset(rows, [done[id(batch.seqs[i])][0] for i in rows])
    return ran, [done[id(s)][1] for s in ran.seqs], failed


def _run(attempt: Callable, batch) -> tuple[dict, list[Failure]]:
    """(id(seq) -> (tokens it computed, its logits), failures) of `batch`, bisected."""
    try:
        logits = attempt(batch)
        return {id(s): (n, row) for (s, n), row in zip(batch, logits)}, []
    except NEVER_ISOLATED:
        raise
    except Exception as error:
        groups = list(dict.fromkeys(group_of(s) for s in batch.seqs))
        if len(groups) == 1:
            return {}, [(seq, describe(error)) for seq in batch.seqs]
        done, failed = {}, []
        for half in (groups[: len(groups) // 2], groups[len(groups) // 2 :]):
            rows = [i for i, s in enumerate(batch.seqs) if group_of(s) in half]
            got, lost = _run(attempt, batch.subset(rows))
            done.update(got)
            failed += lost
        return done, failed


def tainted(cache, failed: list[Sequence], rows: list[Sequence]) -> list[Sequence]:
    """Rows that share a block a failed (or tainted) row was to compute in this step:
    what they read there was never written. Most recently admitted first."""
    if not cache.shares_prefixes:
        return []
    unwritten, out = set(), []
    pending = list(failed)
    while pending:
        seq = pending.pop()
        table = cache.block_table(seq) if seq.request_id in cache.sequences else []
        unwritten.update(table[seq.num_computed // cache.block_size :])
        for row in rows:
            if row not in out and row not in failed and unwritten & set(cache.block_table(row)):
                out.append(row)
                pending.append(row)
    return sorted(out, key=lambda s: -s.admit_order)


def sample_isolated(sample: Callable, logits: torch.Tensor, seqs: list[Sequence]):
    """sample(logits, seqs), or on an exception row by row from the generators' states
    before the batched draw. Returns (tokens by row, failures)."""
    states = [s.generator.get_state() if s.generator is not None else None for s in seqs]
    try:
        return dict(enumerate(sample(logits, seqs))), []
    except NEVER_ISOLATED:
        raise
    except Exception:
        tokens, failed = {}, []
        for row, (seq, state) in enumerate(zip(seqs, states)):
            if state is not None:
                seq.generator.set_state(state)
            try:
                [tokens[row]] = sample(logits[row : row + 1], [seq])
            except Exception as error:
                failed.append((seq, describe(error)))
        return tokens, failed
