"""Notebook 03's helpers and widget, driven from pytest on a tiny live workload."""

from __future__ import annotations

import pandas as pd
import pytest

from kvlab import texts
from kvlab.build import Engine
from kvlab.config import EngineConfig, SamplingParams
from kvlab.experiments import sharing
from kvlab.viz import prefix as viz


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    """Token-id prompts: a shared 37-token preamble (not block-aligned), distinct tails."""
    head = model.tokenizer.encode(texts.preamble())[:37]
    return [head + model.tokenizer.encode(q) for q in texts.questions()[:4]]


def test_format_table_and_shared_pages():
    assert viz.format_table([0, 1, 2, 7, 9, 10]) == "0-2, 7, 9-10"
    assert viz.format_table([5]) == "5"
    assert viz.format_table([]) == "(empty)"
    assert viz.shared_pages({"A": [0, 1, 2, 3], "B": [0, 1, 4], "C": [4]}) == [0, 1, 4]
    assert sharing.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def test_preamble_prompts_share_the_preamble():
    prompts = sharing.preamble_prompts(50)
    assert len(set(prompts)) == 50
    assert all(p.startswith(texts.preamble()) for p in prompts)


def test_block_table_figure_draws_shared_pages():
    tables = {"A": [0, 1, 2, 3], "B": [0, 1, 4]}
    fig = viz.block_table_figure(tables, block_size=16)
    pages = fig.data[-1]
    assert list(pages.x) == [0, 1, 2, 3, 4]
    assert [c == viz.SHARED_COLOR for c in pages.marker.color] == [1, 1, 0, 0, 0]
    markers = [t for t in fig.data if t.mode == "markers"][:2]
    assert [len(t.x) for t in markers] == [4, 3]
    # A's lines into shared pages: logical 0 -> page 0 and 1 -> 1.
    shared_lines = [t for t in fig.data if t.mode == "lines" and t.line.color == viz.SHARED_COLOR]
    assert list(shared_lines[0].x) == [0, 0, None, 1, 1, None]


def test_serve_sharing_hits_after_the_first(model, prompts):
    config = EngineConfig(cache="paged", block_size=8, prefix_caching="hash", max_model_len=128)
    engine = Engine(model, config)
    outputs = sharing.serve_sharing(engine, prompts, SamplingParams(max_new_tokens=2))
    assert [o.metrics.prefix_hit_tokens for o in outputs] == [0, 32, 32, 32]


def test_sharing_explorer_redraws_on_new_settings(model, prompts):
    explorer = viz.SharingExplorer(model, prompts, requests=1, block_size=16, max_new_tokens=2)
    assert explorer.requests.max == len(prompts)

    def data():
        return [(list(t.x), list(t.y)) for t in explorer.figure.data]

    before = data()
    explorer.requests.value = 3
    after = data()
    assert after != before
    table = explorer.table()
    assert list(table["requests"]) == [1, 1, 3, 3]
    row = table.set_index(["requests", "mode"]).loc[3]
    assert (
        row.loc["with sharing", "tokens computed"]
        == row.loc["with sharing", "prompt tokens"] - 2 * 32
    )
    assert (
        row.loc["without sharing", "tokens computed"] == row.loc["without sharing", "prompt tokens"]
    )
    assert row.loc["with sharing", "peak blocks"] < row.loc["without sharing", "peak blocks"]
    # The figure's "tokens computed" panel shows the measured rows.
    with_line = explorer.figure.data[0]
    assert list(with_line.x) == [1, 3]
    assert list(with_line.y) == list(table[table["mode"] == "with sharing"]["tokens computed"])

    explorer.block_size.value = 8
    assert data() != after
    assert list(explorer.table()["block size"]) == [8, 8]
    assert "block size 8" in explorer.figure.layout.title.text

    controls, figure = explorer.widget().children
    assert figure is explorer.figure
    assert list(controls.children) == [explorer.requests, explorer.block_size]


def test_index_hits_hash_vs_radix(model, prompts):
    hits = sharing.index_hits(model, prompts[:3], block_sizes=(16,))
    assert list(hits["hash/16"]) == [0, 32, 32]
    shared = list(hits["shared with earlier"])
    assert list(hits["radix/16"]) == shared and min(shared[1:]) >= 37


def test_fork_vs_separate_saves_blocks(model, prompts):
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_new_tokens=4, ignore_eos=True)
    summary, stats = sharing.fork_vs_separate(model, prompts[0], params, max_model_len=128)
    fork, separate = summary.values()
    assert fork["samples"] == separate["samples"] == 3
    assert fork["peak blocks"] < separate["peak blocks"]
    assert fork["copy-on-write copies"] == 2 and separate["copy-on-write copies"] == 0
    fig = viz.blocks_figure(stats, "test")
    assert [len(t.x) for t in fig.data] == [len(s) for s in stats.values()]


def test_index_savings_against_no_sharing(tiny_model, prompts):
    rows = sharing.index_savings(tiny_model, prompts[:3], max_new_tokens=2, max_model_len=128)
    off, hashed, radix = rows[None], rows["hash"], rows["radix"]
    assert "computed reduction" not in off and off["tokens computed"] == off["prompt tokens"]
    # Request 0 is prefilled alone; 1 and 2 reuse its two full blocks of the 37 shared tokens.
    assert hashed["tokens computed"] == off["prompt tokens"] - 2 * 32
    assert hashed["computed reduction"] == round(2 * 32 / off["prompt tokens"], 4)
    assert radix["tokens computed"] < hashed["tokens computed"]  # also the partial block's run
    assert hashed["identical outputs"] is True and radix["identical outputs"] is True
    again, _ = sharing.measure_sharing(tiny_model, prompts[:3], "hash", 16, 2, 128)
    assert again == {k: v for k, v in hashed.items() if k in again} and len(again) == 7


def test_warm_vs_cold_hits_the_shared_blocks(tiny_model, prompts):
    ttft = sharing.warm_vs_cold(tiny_model, prompts[:2], max_model_len=128)
    assert ttft["warm_hit_tokens"] == 32  # two full blocks of the 37 shared tokens
    assert ttft["cold_s"] > 0 and ttft["warm_s"] > 0
    # The seconds are rounded to 0.1 ms and the ratio (from the unrounded seconds) to 0.001,
    # so the ratio lies between the extremes the rounded seconds allow.
    cold, warm, half = ttft["cold_s"], ttft["warm_s"], 0.00005
    assert (warm - half) / (cold + half) - 0.0005 <= ttft["warm_over_cold"]
    assert ttft["warm_over_cold"] <= (warm + half) / (cold - half) + 0.0005


def _text_px(text: str, font_size: float) -> float:
    """A generous estimate of a label's width in pixels (0.6 em per character)."""
    return 0.6 * font_size * len(text)


def test_sharing_figure_labels_do_not_overlap():
    """At plotly's default 700 px width each x-axis title fits under its own panel and the
    subplot titles keep apart (the three axes once shared one long title, drawn three
    times on top of each other)."""
    frame = pd.DataFrame(
        [
            {"mode": mode, "requests": n, "tokens computed": 1, "hit rate %": 0, "peak blocks": 1}
            for n in (1, 2, 4)
            for mode in sharing.MODES
        ]
    )
    fig = viz.sharing_figure(frame)
    layout = fig.layout
    margin = layout.margin
    plot_px = 700 - (margin.l if margin.l is not None else 80) - (margin.r or 80)
    if layout.legend.orientation != "h":  # a vertical legend takes the right edge
        plot_px -= 150
    axes = [layout.xaxis, layout.xaxis2, layout.xaxis3]
    for axis in axes:
        width = (axis.domain[1] - axis.domain[0]) * plot_px
        assert _text_px(axis.title.text, 14) < width, (axis.title.text, width)
    titles = sorted(layout.annotations, key=lambda a: a.x)
    assert [a.text for a in titles] == [t for _, t in viz.SHARING_PANELS]
    for left, right in zip(titles, titles[1:]):
        gap = (right.x - left.x) * plot_px
        widths = [_text_px(a.text, a.font.size) for a in (left, right)]
        assert sum(widths) / 2 < gap, (left.text, right.text)


def test_explorer_title_counts_the_slider_value(tiny_model, prompts):
    """The explorer's headline names the slider's request count (a learner saw one more)
    and the tokens measured for it."""
    explorer = viz.SharingExplorer(tiny_model, prompts * 2, requests=1, max_new_tokens=1)
    for n in (6, 7, 6, 2):
        explorer.requests.value = n
        computed = explorer.table().set_index(["requests", "mode"]).loc[n]["tokens computed"]
        assert explorer.figure.layout.title.text == (
            f"block size 16, {n} requests:<br>{computed['with sharing']} prompt tokens "
            f"computed with sharing, {computed['without sharing']} without"
        )
    rows = {"with sharing": {"requests": 6}, "without sharing": {"requests": 7}}
    with pytest.raises(ValueError, match="different request counts"):
        viz.explorer_title(16, rows)


def test_explorer_never_shows_the_last_count_while_measuring(tiny_model, prompts, monkeypatch):
    """Serving a new setting takes seconds, and the slider shows its new value at once:
    meanwhile the headline names that value (measuring), not the previous count's tokens
    (moving 7 -> 6 used to leave "7 requests computed ..." beside a slider at 6)."""
    explorer = viz.SharingExplorer(tiny_model, prompts * 2, requests=7, max_new_tokens=1)
    assert explorer.figure.layout.title.text.startswith("block size 16, 7 requests:")
    seen = []
    measure = viz.measure_sharing

    def spy(*args, **kwargs):
        seen.append(explorer.figure.layout.title.text)
        return measure(*args, **kwargs)

    monkeypatch.setattr(viz, "measure_sharing", spy)
    explorer.requests.value = 6
    assert seen and all(t == "block size 16, 6 requests: measuring ..." for t in seen), seen
    assert explorer.figure.layout.title.text.startswith("block size 16, 6 requests:<br>")
    seen.clear()
    explorer.requests.value = 7  # measured before: redrawn at once, nothing served
    assert seen == [] and explorer.figure.layout.title.text.startswith("block size 16, 7 req")
