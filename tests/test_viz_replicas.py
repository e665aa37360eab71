"""Notebook 14's parts (kvlab.viz.replicas) on the tiny model: a fleet in threads behind real
HTTP, the routing app driven as a learner drives it (its slider), the index table, the
policy bars and the disagreement table."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")
pytest.importorskip("fastapi")

from kvlab.config import EngineConfig  # noqa: E402
from kvlab.route.sessions import tenant_sessions  # noqa: E402
from kvlab.viz import replicas as viz  # noqa: E402


def test_fleet_app_table_and_bars(tiny_model):
    sessions = tenant_sessions(3, turns=2, tenants=1, max_doc_chars=600)
    with viz.ThreadFleet(tiny_model, n=2, budget_tokens=512) as fleet:
        app = viz.RoutingApp(fleet.router)
        turns = fleet.run(sessions, "precise", on_decision=app.add, max_tokens=2, concurrency=2)
        assert len(turns) == len(app.entries) == 6
        dots = app.figure.data[0]
        assert list(dots.x) == list(range(6)) and set(dots.y) <= {"r0", "r1"}
        assert app.slider.max == 5 and app.slider.value == 5
        shown = app.figure._widget_data  # what a front end opened now draws first
        assert list(shown[0]["x"]) == list(range(6)) and list(shown[1]["x"]) == [5]
        app.slider.value = 0  # the learner picks the first request: its scores show
        first = app.entries[0]
        assert list(app.figure.data[1].x) == [0] and list(app.figure.data[1].y) == [
            first["replica"]
        ]
        assert list(app.figure.data[2].y) == [first["scores"].get(n, 0) for n in ("r0", "r1")]
        assert first["reason"] in app.figure.layout.title.text
        fleet.quiet()
        table = viz.index_table(fleet.router, tiny_model.tokenizer, per_replica=2)
        assert len(table) >= 2 and set(table["replica"]) <= {"r0", "r1"}
        assert table.iloc[1]["parent"] == table.iloc[0]["hash"]
        results, _ = viz.compare_policies(fleet, sessions[:2], ["round-robin", "precise"],
                                          max_tokens=2, concurrency=1)  # fmt: skip
        assert list(results.index) == ["round-robin", "precise"]
        figure = viz.policy_bars(results)
        assert list(figure.data[0].x) == ["round-robin", "precise"]
        assert list(figure.data[0].y) == list(results["hit_rate"])
        assert viz.index_figure(fleet.router).data


def test_disagreement_shows_what_the_router_cannot_find(tiny_model):
    odd = [
        viz.REPLICA,
        EngineConfig(cache="paged", prefix_caching="hash", block_size=32,
                     prefix_caching_hash_algo="sha256_cbor"),
        EngineConfig(cache="paged", prefix_caching="hash", block_size=16,
                     prefix_caching_hash_algo="sha256_cbor", prefix_caching_hash_seed="0"),
    ]  # fmt: skip
    with viz.ThreadFleet(tiny_model, configs=odd, budget_tokens=512) as fleet:
        table = viz.disagreement(fleet, list(range(100, 180)))
    assert table["blocks it reported"].tolist() == [5, 2, 5]  # 80 tokens computed
    # the last token always runs: a request can hit the full blocks of its first 79
    assert table["blocks the router finds"].tolist() == [4, 0, 0]
    assert table["router's block size"].tolist() == [16, 16, 16]
