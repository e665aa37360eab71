"""Decode ITL with KV on the device, streamed back from the host tier, and held in host
memory (kvlab.experiments.tier_decode), on the tiny model."""

from __future__ import annotations

import pytest

from kvlab.experiments import tier_decode
from kvlab.experiments.tier_decode import CASES, DecodeSetup, HostResident, decode_itl

SETUP = DecodeSetup(new_tokens=5, stagger=2, pool_tokens=1024)


def prompts(n: int = 3) -> list[list[int]]:
    """Prompts of 3-4 full blocks whose first block is the same (a shared system prompt)."""
    head = list(range(200, 216))
    return [head + [300 + 7 * i + j % 50 for j in range(34 + 5 * i)] for i in range(n)]


def usable(prompt: list[int]) -> int:
    """Full blocks of a prompt that a prefix hit may reuse (its last token always runs)."""
    return (len(prompt) - 1) // 16


@pytest.fixture(scope="module")
def result(tiny_model):
    return decode_itl(tiny_model, prompts(), SETUP)


def test_every_case_gives_the_same_greedy_tokens(result):
    assert result["identical"]
    assert all(len(t) == SETUP.new_tokens for t in result["tokens"]["device"])
    assert result["tokens"]["held in host"] == result["tokens"]["device"]
    assert result["tokens"]["streamed from host"] == result["tokens"]["device"]


def test_streaming_loads_every_usable_prompt_block_back(result):
    streamed = [r for r in result["rows"] if r["case"] == "streamed from host"]
    # each request arrives on its own step, and that step loads its blocks; the shared
    # first block is loaded once, by the first request, and found on the device after
    loads = [r["loaded_blocks"] for r in streamed if r["loaded_blocks"]]
    assert loads == [usable(p) - (i > 0) for i, p in enumerate(prompts())]
    assert result["loaded_blocks"] == sum(loads)
    assert not any(r["loaded_blocks"] for r in result["rows"] if r["case"] != "streamed from host")
    # loads happen in the arrival steps only; the later arrivals land mid-decode
    assert [r["arrives"] for r in streamed] == [bool(r["loaded_blocks"]) for r in streamed]
    assert result["summary"]["streamed: arrival steps (loads)"]["steps"] == len(prompts()) - 1
    assert result["summary"]["device: arrival steps"]["steps"] == len(prompts()) - 1


def test_itl_rows_per_step_are_present_and_positive(result):
    for case in CASES:
        rows = [r for r in result["rows"] if r["case"] == case]
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
        assert all(r["itl_s"] > 0 for r in rows)
        decode = [r for r in rows if r["decode_rows"]]
        # request 0 decodes every step after its first; the last request's tokens end it
        assert len(decode) == len(rows) - 1
        assert result["summary"][case]["steps"] == len(decode)
        assert result["summary"][case]["p90_ms"] >= result["summary"][case]["median_ms"] > 0
    held = [r for r in result["rows"] if r["case"] == "held in host" and r["decode_rows"]]
    assert all(r["copied_bytes"] > 0 and 0 < r["copy_s"] < r["itl_s"] for r in held)
    assert not any(r["copied_bytes"] for r in result["rows"] if r["case"] != "held in host")


def test_held_case_copies_the_whole_context_every_step(result):
    block = result["block_bytes"]
    held = [r for r in result["rows"] if r["case"] == "held in host" and r["decode_rows"]]
    # at least one block in and one block out per running sequence
    assert all(r["copied_bytes"] >= 2 * block * r["decode_rows"] for r in held)
    assert result["bytes_per_step"] % block == 0
    assert result["projection_s"][25] == pytest.approx(result["bytes_per_step"] / 25e9)
    assert result["projection_s"][100] == pytest.approx(result["projection_s"][25] / 4)


def test_held_case_reads_what_it_copied_in(tiny_model, monkeypatch):
    """Without the copy in, the device blocks hold NaN (evict): the tokens change."""
    monkeypatch.setattr(HostResident, "load", lambda self, running: 0)
    broken = decode_itl(tiny_model, prompts(2), SETUP)
    assert broken["tokens"]["held in host"] != broken["tokens"]["device"]
    assert not broken["identical"]


def test_setup_names_the_bad_field():
    with pytest.raises(ValueError, match="stagger=0"):
        DecodeSetup(stagger=0)


def test_table_has_a_row_per_case(result):
    table = tier_decode.itl_table(result)
    assert list(table.index[:3]) == list(CASES)
    assert {"median_ms", "p90_ms", "steps"} <= set(table.columns)


def test_figure_draws_a_line_per_case_and_rings_the_loads(result):
    from kvlab.viz.tiers import itl_figure

    figure = itl_figure(result)
    names = [trace.name for trace in figure.data]
    assert names[:3] == list(CASES) and "loads" in names[3]
    decode = [r for r in result["rows"] if r["case"] == "device" and r["decode_rows"]]
    assert list(figure.data[0].x) == [r["step"] for r in decode]
    assert len(figure.data[3].x) == result["summary"]["streamed: arrival steps (loads)"]["steps"]
    assert figure.layout.xaxis.title.text and figure.layout.yaxis.title.text
