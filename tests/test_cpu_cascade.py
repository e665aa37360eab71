"""Cascade attention (kernels/cpu_cascade.py): decodes that share a prefix attend to it once
on AMX tiles, then each to its own positions, against test_cpu_decode's fp32 reference.

The cases share whole blocks of a paged pool (blocks in random order, every slot no
sequence reads NaN), with prefixes that end inside and at the end of a block, a shared part
of one position, and sequences whose own part is one position. The kernel runs only where
the CPU has AMX-BF16; the rule that picks it, the prior merge of the decode kernel and the
decode group are checked on any CPU with the native kernels.
"""

from __future__ import annotations

import pytest
import torch
from kvlab.kernels import cpu_cascade, cpu_kernels_available, cpu_paged_decode_attention
from kvlab.kernels.cpu_cascade import (
    MIN_REREAD,
    MIN_SHARED,
    cascade_pays,
    cpu_cascade_decode_attention,
)
from kvlab.kernels.cpu_decode import decode_members
from kvlab.kernels.cpu_prefill import amx_ready
from test_cpu_decode import BLOCK, reference

from kvlab.checks.cpu_kernels import shared_prefix_case
from kvlab.model.metadata import build_attention_metadata

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="no native kernels")
needs_amx = pytest.mark.skipif(
    not (cpu_kernels_available() and amx_ready()), reason="needs a CPU with AMX-BF16"
)


def shared_case(batch, shared_blocks, own, seed=0):
    """SmolLM2's attention shape, every sequence's first `shared_blocks` blocks the same
    (kvlab.checks.cpu_kernels.shared_prefix_case: unused slots NaN)."""
    return shared_prefix_case(batch, shared_blocks * BLOCK, own, seed=seed)


@needs_amx
@pytest.mark.parametrize(
    "batch, shared_blocks, own, shared",
    [(8, 20, 40, 320), (8, 20, 40, 313), (33, 3, 1, 1), (12, 40, 300, 640), (5, 2, 500, 32)],
)
def test_matches_the_reference(batch, shared_blocks, own, shared):
    q, k, v, slots, lens = shared_case(batch, shared_blocks, own, seed=batch + own)
    shared = min(shared, int(lens.min()) - 1)
    out = cpu_cascade_decode_attention(q, k, v, slots, lens, 0.125, shared)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(
        out.float(), reference(q, k, v, slots, lens, 0.125), atol=2e-2, rtol=0
    )


@needs_amx
def test_refuses_a_prefix_the_sequences_do_not_share():
    q, k, v, slots, lens = shared_case(8, 4, 20)
    lens = lens.clamp(min=4 * BLOCK + 2)  # each sequence's first own slot is read too
    with pytest.raises(ValueError, match="not the same"):
        cpu_cascade_decode_attention(q, k, v, slots, lens, 0.125, 4 * BLOCK + 1)
    with pytest.raises(ValueError, match="min\\(lens\\)"):
        cpu_cascade_decode_attention(q, k, v, slots, lens, 0.125, int(lens.min()))
    with pytest.raises(ValueError, match="bf16"):
        cpu_cascade_decode_attention(q.float(), k.float(), v.float(), slots, lens, 0.125, 16)


@needs_kernels
def test_a_prior_merges_as_positions_that_came_first():
    """The decode kernel's prior: attention over positions 0..P-1 given as (out, lse),
    then the kernel over P..len-1, equals the kernel over all of them (fp32)."""
    q, k, v, slots, lens = shared_case(6, 10, 300, seed=3)
    q, k, v = q.float(), k.float(), v.float()
    p = 100
    scores = torch.stack([
        torch.einsum("hd,nhd->hn", q[b], k[slots[b, :p]].repeat_interleave(3, dim=1))
        for b in range(6)
    ]) * 0.125  # (B, heads, P)  # fmt: skip
    values = [v[slots[b, :p]].repeat_interleave(3, dim=1) for b in range(6)]
    prior_out = torch.stack(
        [torch.einsum("hn,nhd->hd", s.softmax(-1), x) for s, x in zip(scores, values)]
    )
    prior = (prior_out.contiguous(), scores.logsumexp(-1).contiguous())
    out = cpu_paged_decode_attention(q, k, v, slots[:, p:], lens - p, 0.125, prior=prior)
    torch.testing.assert_close(out, reference(q, k, v, slots, lens, 0.125), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="prior"):
        cpu_paged_decode_attention(
            q, k, v, slots[:, p:], lens - p, 0.125, prior=(prior[0], prior[0])
        )


@needs_kernels
def test_the_rule_takes_a_prefix_the_decode_kernel_would_read_again_often_in_bf16_only():
    def pays(batch: int, shared: int, dtype=torch.bfloat16) -> bool:
        q, k = torch.zeros(batch, 9, 64, dtype=dtype), torch.zeros(4, 3, 64, dtype=dtype)
        return cascade_pays(q, k, shared)

    members = decode_members()  # the decode kernel's MAX_MEMBERS, from the library
    assert members >= 1
    assert pays(2 * members, MIN_REREAD) == amx_ready()  # the prefix read twice
    assert not pays(2 * members, MIN_REREAD - 1)
    assert not pays(members, 4096)  # one decode task serves them all
    assert pays(4 * members, MIN_SHARED) == amx_ready()
    assert not pays(1024, MIN_SHARED - 1)
    assert not pays(2 * members, 4096, torch.float32)


@needs_amx
def test_the_rule_follows_the_decode_kernels_members(monkeypatch):
    """The rule reads how many sequences a decode task serves from the library: were it
    4, 8 sequences would read the prefix again where 16 would not."""
    q, k = torch.zeros(8, 9, 64, dtype=torch.bfloat16), torch.zeros(4, 3, 64, dtype=torch.bfloat16)
    assert not cascade_pays(q, k, 4096)
    monkeypatch.setattr(cpu_cascade, "decode_members", lambda: 4)
    assert cascade_pays(q, k, 4096)


def test_the_decode_group_holds_every_decode_and_their_shared_prefix():
    """Decodes of three lengths (the reference splits them into groups by length) and a
    prompt: one decode group, each row's slots and length as its own group had them, the
    shared prefix the blocks they share (capped so each keeps a position of its own)."""
    tables = [[7, 8, 1], [7, 8, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11]]
    starts, query_lens = [40, 100, 33, 0], [1, 1, 1, 20]
    meta = build_attention_metadata(starts, query_lens, tables, BLOCK, torch.device("cpu"))
    assert sum(g.lens is not None for g in meta.groups) >= 2  # split by length
    group = meta.decode_group()
    assert group is meta.decode_group()  # built once
    assert group.rows.tolist() == [0, 1, 2]  # in row order
    by_row = dict(zip(group.rows.tolist(), range(3)))
    for b, row in enumerate([0, 1, 2]):
        i = by_row[row]
        n = starts[b] + 1
        assert int(group.lens[i]) == n
        expected = [tables[b][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        assert group.slots[i, :n].tolist() == expected
    assert group.shared_positions() == 2 * BLOCK
    one = build_attention_metadata([40], [1], [[7, 8, 1]], BLOCK, torch.device("cpu"))
    alone = one.decode_group()
    assert torch.equal(alone.slots, one.groups[0].slots) and alone.lens.tolist() == [41]
    assert alone.shared_positions() == 0
    prompt = build_attention_metadata([0], [20], [[10, 11]], BLOCK, torch.device("cpu"))
    assert prompt.decode_group() is None
