"""The tier figures and the snapshot they draw, on the tiny model."""

from __future__ import annotations

import pytest

from kvlab.experiments import tiers as tier_exp
from kvlab.multiturn import chat_sessions
from kvlab.viz import tiers as viz


@pytest.fixture(scope="module")
def trace(tiny_model):
    sessions = chat_sessions(n=3, turns=2, max_doc_chars=1200)
    configs = tier_exp.tier_configs(22)
    configs = {k: configs[k] for k in ("device only", "host+disk")}
    return tier_exp.compare_tiering(tiny_model, sessions, pool_tokens=352, max_new_tokens=4,
                                    max_model_len=1024, configs=configs, end_after=True,
                                    observe="host+disk", every=2)  # fmt: skip


def test_snapshots_follow_sessions_down_the_tiers(trace):
    frames = trace["frames"]
    assert frames and all(label.startswith("step ") for label, _ in frames)
    tiers_seen = {row["tier"] for _, rows in frames for row in rows}
    assert {"device (cached)", "host"} <= tiers_seen
    sessions_seen = {row["session"] for _, rows in frames for row in rows}
    assert {"user-00", "user-01", "user-02"} <= sessions_seen
    # every session ended after its last turn: the last frame holds none of theirs below
    _, last = frames[-1]
    assert not [
        r for r in last if r["tier"] in ("host", "disk") and r["session"].startswith("user")
    ]


def test_figures_draw_what_they_are_given(trace):
    figure = viz.hierarchy_figure(trace["frames"])
    assert len(figure.frames) == len(trace["frames"])
    fullest = max(len(rows) for _, rows in trace["frames"])  # it opens on the fullest frame
    assert len(figure.data[0].x) == fullest > 0
    opened = figure.layout.sliders[0].active
    assert len(trace["frames"][opened][1]) == fullest
    widest = max(
        len([r for r in rows if r["tier"] == t])
        for _, rows in trace["frames"]
        for t in viz.TIER_ROWS
    )
    assert list(figure.layout.xaxis.range) == [-0.5, widest - 0.5]  # every frame's blocks fit
    bars = viz.recompute_figure(trace)
    assert list(bars.data[0].x) == ["device only", "host+disk"]
    assert list(bars.data[0].y) == [trace["configs"][c]["computed_tokens"] for c in bars.data[0].x]
    medians = {"device": 0.01, "host": 0.02, "disk": 0.03, "recompute": 0.2}
    ttft = {"prompt_tokens": 100, "repeats": 3, "ttft_median_s": medians}
    assert list(viz.ttft_figure(ttft).data[0].y) == pytest.approx([10, 20, 30, 200])
    table = tier_exp.policy_table(trace)
    assert list(table.index) == ["device only", "host+disk"] and table["identical"].all()
    with pytest.raises(ValueError, match="frames is empty"):
        viz.hierarchy_figure([])
