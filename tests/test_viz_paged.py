"""Notebook 02's figures and widgets, driven from pytest on a tiny live workload."""

from __future__ import annotations

import pytest

import kvlab
from kvlab import workloads
from kvlab.viz.paged import BlockMapExplorer, BlockSizeExplorer, memory_panels, occupancy_table


@pytest.fixture(scope="module")
def requests() -> list[workloads.Request]:
    return workloads.chat(n=3, max_new_tokens=(4, 4))


@pytest.fixture(scope="module")
def engines(model, requests) -> dict[str, kvlab.Engine]:
    """Naive and paged engines that served the same requests, block maps recorded."""
    out = {}
    for cache in ("naive", "paged"):
        config = kvlab.EngineConfig(
            cache=cache,
            block_size=8,
            max_model_len=128,
            kv_budget_tokens=2 * 128,
            record_block_map=True,
        )
        out[cache] = kvlab.Engine(model, config)
        out[cache].run(requests, ignore_eos=True)
    return out


def test_summary_and_memory_figure(engines):
    stats = {name: engine.stats() for name, engine in engines.items()}
    table = occupancy_table(stats)
    assert list(table.index) == ["naive", "paged"]
    assert table.loc["naive", "peak running"] == 2  # two 128-token regions
    assert table.loc["paged", "peak running"] == 3
    assert table.loc["naive", "blocks"] == 2 and table.loc["paged", "blocks"] == 32
    assert table.loc["paged", "mean waste %"] < table.loc["naive", "mean waste %"]
    fig = memory_panels(stats, x="step")
    names = [trace.name for trace in fig.data]
    assert names == [f"{c} {k}" for c in stats for k in ("reserved", "live", "waste %", "running")]
    running = fig.data[names.index("paged running")]
    assert list(running.y) == stats["paged"]["running"].tolist()


def cells(explorer: BlockMapExplorer) -> dict[int, str]:
    """Hover text of every drawn (owned) block, by block id."""
    trace = explorer.figure.data[0]
    out = {}
    for r, (zrow, trow) in enumerate(zip(trace.z, trace.customdata)):
        for c, (z, text) in enumerate(zip(zrow, trow)):
            if z is not None:
                out[r * explorer.per_row + c] = text
    return out


def test_block_map_slider_redraws(engines):
    engine = engines["paged"]
    explorer = BlockMapExplorer(engine, blocks_per_row=8)
    stats, maps = engine.stats(), engine.telemetry.block_maps
    assert explorer.rows == 4 and explorer.slider.max == len(maps) == len(stats)
    busiest = explorer.slider.value
    assert len(cells(explorer)) == stats["blocks_used"].max()
    explorer.slider.value = 1  # after the first prefill
    first = cells(explorer)
    assert len(first) == stats["blocks_used"].iloc[0]
    for block, text in first.items():
        assert text == f"block {block}<br>request {maps[0][block]}"
    assert f"step 1 (prefill): {len(first)} of 32 blocks" in explorer.figure.layout.title.text
    explorer.slider.value = len(maps)  # the last step frees everything
    assert cells(explorer) == {}
    assert busiest != len(maps)


def test_block_map_labels_owners_and_marks_reused_blocks(model):
    """Every owned block carries its request's number (a static copy shows it without
    hover), and a "*" once another request held it at an earlier recorded step: C's last
    block is one of A's, handed out again after A finished."""
    config = kvlab.EngineConfig(
        cache="paged", block_size=4, max_model_len=32, kv_budget_tokens=32, record_block_map=True
    )
    engine = kvlab.Engine(model, config)
    ids = list(range(10, 24))
    a = engine.add_request(ids[:6], kvlab.SamplingParams(2, ignore_eos=True), chat=False)
    b = engine.add_request(ids[:9], kvlab.SamplingParams(6, ignore_eos=True), chat=False)
    engine.step()  # A and B's prefill (the map records A's blocks)
    engine.step()  # a decode: A finishes and frees its blocks
    c = engine.add_request(ids[:14], kvlab.SamplingParams(2, ignore_eos=True), chat=False)
    engine.step()  # C's prefill takes one of A's blocks
    explorer, maps = BlockMapExplorer(engine, blocks_per_row=4), engine.telemetry.block_maps
    explorer.slider.value = 3
    labels = [x for row in explorer.figure.data[0].text for x in row]
    (again,) = explorer.reused[2]
    assert maps[0][again] == a and maps[2][again] == c and labels[again] == f"{c}*"
    for block, owner in enumerate(maps[2]):
        if block != again:
            assert labels[block] == ("" if owner < 0 else str(owner))
    assert b in maps[2] and "1 reused" in explorer.figure.layout.title.text
    explorer.slider.value = 1
    assert explorer.reused[0] == set() and "*" not in "".join(
        x for row in explorer.figure.data[0].text for x in row
    )


def test_block_map_needs_recorded_maps(model):
    engine = kvlab.Engine(model, kvlab.EngineConfig(cache="paged", kv_budget_tokens=64))
    with pytest.raises(ValueError, match="record_block_map=True"):
        BlockMapExplorer(engine)


def test_block_size_dropdown_adds_points(model, requests):
    explorer = BlockSizeExplorer(model, requests, budget_tokens=512, block_size=4)
    bars = explorer.figure.data
    assert list(bars[0].x) == ["4"] and len(bars[1].y) == 1
    explorer.dropdown.value = 128
    assert list(bars[0].x) == list(bars[1].x) == ["4", "128"]
    waste, entries = list(bars[0].y), list(bars[1].y)
    assert waste[0] < waste[1]  # big blocks leave big tails empty ...
    assert entries[0] > entries[1] == 1  # ... but a whole sequence fits in one
    results = dict(explorer.results)
    explorer.dropdown.value = 4  # measured already: no new run, same points
    assert explorer.results == results and list(bars[0].x) == ["4", "128"]
    assert list(explorer.table().index) == [4, 128]


def test_a_shown_app_carries_its_figure_as_it_stands(engines):
    """The state a front end draws first is the figure as the app left it (its title, its
    cells): the edits made before it is shown, sent as one-off messages, are not needed."""
    explorer = BlockMapExplorer(engines["paged"], blocks_per_row=8)
    figure = explorer.figure
    assert "title" not in figure._widget_layout  # the title came after the widget was made
    (shown,) = [w for w in explorer.widget().children if w is figure]
    assert shown._widget_layout["title"]["text"] == figure.layout.title.text
    assert shown._widget_data[0]["z"] == [list(row) for row in figure.data[0].z]
    explorer.slider.value = 1  # shown again after a move, it carries the move
    explorer.widget()
    assert figure._widget_layout["title"]["text"].startswith("step 1 ")
