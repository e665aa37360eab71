"""Notebook 12's disaggregated experiment on the tiny model: a 1P:2D row, its figures, and
the link-time arithmetic."""

from __future__ import annotations

import pytest

from kvlab.experiments import disagg
from kvlab.viz.parallel import latency_figure, pool_figure


def test_pool_row_matches_colocated_and_moves_the_prompts_kv(tiny_model):
    trace = disagg.interference_trace(n_chat=2, n_long=1, chat_tokens=4, long_tokens=2,
                                      gap_s=0.05, long_chars=300)  # fmt: skip
    rows = disagg.colocated_vs_disaggregated(tiny_model, trace, decode_engines=(2,))
    names = ["colocated", "colocated+chunked", "disaggregated 1P:2D"]
    assert list(rows) == names and all(r["identical_to_colocated"] for r in rows.values())
    cfg = tiny_model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32
    pool = rows["disaggregated 1P:2D"]
    assert pool["bytes_moved"] == pool["prompt_tokens_moved"] * per_token
    assert pool["prompt_tokens_moved"] > 0 and pool["transfers_rejected"] == 0
    assert sum(pool["routed"]) == len(trace) and len(pool["routed"]) == 2
    assert 0 < pool["prefill_engine_steps"] <= len(trace) and pool["prefill_engine_s"] > 0
    bars = pool_figure(rows)
    assert list(bars.data[0].x) == ["1P:2D · engine 0", "1P:2D · engine 1"]
    assert list(bars.data[0].y) == pool["routed"] and len(bars.data) == 3
    assert list(latency_figure(rows).data[0].x) == names


def test_link_ms():
    assert disagg.link_ms(25_000_000, 25) == pytest.approx(1.0)
    assert disagg.link_ms(46_080 * 1000, 100) == pytest.approx(0.4608)
