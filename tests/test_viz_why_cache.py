"""Notebook 01's widget, driven from pytest: move the sliders, check the figure redraws."""

from __future__ import annotations

import pytest

from kvlab import texts
from kvlab.model.runner import ModelRunner
from kvlab.viz.why_cache import MODES, CacheLatencyExplorer


@pytest.fixture(scope="module")
def explorer(model) -> CacheLatencyExplorer:
    text_ids = model.tokenizer.encode(texts.heldout())[:64]
    return CacheLatencyExplorer(ModelRunner(model.hf_model), text_ids, prompt_len=8, new_tokens=8)


def traces(explorer: CacheLatencyExplorer) -> dict:
    return {trace.name: (list(trace.x), list(trace.y)) for trace in explorer.figure.data}


def check_traces(explorer: CacheLatencyExplorer, prompt_len: int, new_tokens: int) -> None:
    data = traces(explorer)
    assert set(data) == set(MODES)
    for x, y in data.values():
        assert len(x) == len(y) == new_tokens
        # The first generated token sits right after the prompt, then one per position.
        assert x == list(range(prompt_len, prompt_len + new_tokens))
        assert all(v > 0 for v in y)


def test_initial_figure_matches_sliders(explorer):
    check_traces(explorer, prompt_len=8, new_tokens=8)
    assert explorer.prompt_len.max == 64  # capped by the text given


def test_moving_sliders_redraws(explorer):
    before = traces(explorer)
    explorer.new_tokens.value = 16
    check_traces(explorer, prompt_len=8, new_tokens=16)
    explorer.prompt_len.value = 24
    check_traces(explorer, prompt_len=24, new_tokens=16)
    assert traces(explorer) != before
    # Both decoders produce the same greedy tokens at the new setting.
    frame = explorer.frame
    tokens = [frame[frame["mode"] == mode]["token"].tolist() for mode in MODES]
    assert tokens[0] == tokens[1]


def test_widget_holds_sliders_and_figure(explorer):
    box = explorer.widget()
    controls, figure = box.children
    assert figure is explorer.figure
    assert list(controls.children) == [explorer.prompt_len, explorer.new_tokens]
