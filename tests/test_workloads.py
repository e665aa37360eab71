"""Workloads: determinism by seed, the doc-QA shape, Poisson arrivals, salts and JSONL files."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import texts
from kvlab.workloads import (
    WORKLOADS,
    Request,
    chat,
    doc_qa,
    load_workload,
    poisson_arrivals,
    read_jsonl,
    summary,
    uniform_chat,
    with_salts,
    write_jsonl,
)


@pytest.mark.parametrize("make", [doc_qa, chat])
def test_same_seed_same_requests_other_seed_different(make):
    assert make(seed=3) == make(seed=3)
    assert make(seed=3) != make(seed=4)
    assert make(seed=3, rate=2.0) == make(seed=3, rate=2.0)


def test_doc_qa_shape():
    requests = doc_qa(32)
    head = texts.preamble() + "\n\n"
    assert len(requests) == 32
    assert all(r.prompt.startswith(head) and "\n\nQuestion: " in r.prompt for r in requests)
    bodies = {r.prompt[len(head) :].split("\n\nQuestion: ")[0] for r in requests}
    assert bodies == set(texts.documents().values())  # n >= 16 uses every document
    budgets = [r.max_new_tokens for r in requests]
    short = [b for b in budgets if 8 <= b <= 24]
    long = [b for b in budgets if 64 <= b <= 128]
    assert len(short) + len(long) == 32 and len(long) == round(32 * 0.3)
    assert all(r.arrival_s == 0 for r in requests)


def test_doc_qa_prompt_token_lengths(model):
    encode = model.tokenizer.encode
    assert 250 <= len(encode(texts.preamble())) <= 350
    lengths = [len(encode(r.prompt)) for r in doc_qa(32)]
    assert min(lengths) < 500 and max(lengths) > 1800


def test_chat_shapes():
    requests = chat(16, seed=1, max_new_tokens=(5, 7))
    assert len({r.prompt for r in requests}) == 16  # without replacement
    assert set(texts.chat_prompts()) >= {r.prompt for r in requests}
    assert all(5 <= r.max_new_tokens <= 7 for r in requests)
    assert len(chat(100)) == 100
    uniform = uniform_chat(4, max_new_tokens=9)
    assert [r.prompt for r in uniform] == texts.chat_prompts()[:4]
    assert {r.max_new_tokens for r in uniform} == {9}


def test_poisson_arrivals():
    rate = 4.0
    requests = poisson_arrivals(uniform_chat(64) * 64, rate, seed=0)
    times = [r.arrival_s for r in requests]
    assert times[0] == 0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.1)
    assert poisson_arrivals(requests, rate, seed=1) != requests
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(requests, 0)


def test_with_salts():
    requests = uniform_chat(6)
    assert [r.salt for r in with_salts(requests, ["a", "b"])] == ["a", "b"] * 3
    shuffled = [r.salt for r in with_salts(requests, ["a", "b"], seed=5)]
    assert sorted(shuffled) == ["a"] * 3 + ["b"] * 3
    assert shuffled == [r.salt for r in with_salts(requests, ["a", "b"], seed=5)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt="", max_new_tokens=1), "prompt"),
        (dict(prompt=[], max_new_tokens=1), "prompt"),
        (dict(prompt="hi", max_new_tokens=0), "max_new_tokens=0 must be >= 1"),
        (dict(prompt="hi", max_new_tokens=1, arrival_s=-1.0), "arrival_s=-1.0 must be >= 0"),
    ],
)
def test_request_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Request(**kwargs)


def test_jsonl_round_trip(tmp_path):
    requests = with_salts(doc_qa(8, rate=3.0), ["t1", "t2"]) + [
        Request([1, 2, 3], 5, arrival_s=9.5, priority=2),
        Request("plain", 1),
    ]
    path = tmp_path / "w.jsonl"
    write_jsonl(requests, path)
    assert read_jsonl(path) == requests
    assert load_workload(path) == requests and load_workload(str(path)) == requests
    assert path.read_text().splitlines()[-1] == '{"prompt": "plain", "max_new_tokens": 1}'


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.builds(
            Request,
            prompt=st.one_of(
                st.text(min_size=1), st.lists(st.integers(0, 50_000), min_size=1, max_size=20)
            ),
            max_new_tokens=st.integers(1, 4096),
            arrival_s=st.floats(0, 1e6),
            salt=st.none() | st.text(),
            priority=st.integers(-10, 10),
        ),
        max_size=5,
    )
)
def test_jsonl_round_trip_property(tmp_path_factory, requests):
    path = tmp_path_factory.mktemp("prop") / "w.jsonl"
    write_jsonl(requests, path)
    assert read_jsonl(path) == requests


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", "bad JSON"),
        ("[1, 2]", "JSON object"),
        ('{"prompt": "hi"}', "missing field 'max_new_tokens'"),
        ('{"prompt": "hi", "max_new_tokens": "4"}', "'max_new_tokens' must be an integer"),
        ('{"prompt": [1, "x"], "max_new_tokens": 4}', "'prompt' must be"),
        ('{"prompt": "hi", "max_new_tokens": 4, "tenant": "a"}', "unknown field"),
        ('{"prompt": "hi", "max_new_tokens": 0}', "must be >= 1"),
    ],
)
def test_read_jsonl_errors_name_the_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "max_new_tokens": 2}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=f"line 3: .*{match}"):
        read_jsonl(path)


def test_load_workload_and_summary():
    assert set(WORKLOADS) == {"doc-qa", "chat", "uniform-chat"}
    assert load_workload("chat", n=3, seed=2) == chat(n=3, seed=2)
    with pytest.raises(ValueError, match="doc-qa"):
        load_workload("nope")
    stats = summary([Request("a b c", 4), Request([1, 2], 6, arrival_s=2.0)])
    assert stats == {
        "n": 2,
        "prompt_words_min": 2,
        "prompt_words_mean": 2.5,
        "prompt_words_max": 3,
        "total_max_new_tokens": 10,
        "last_arrival_s": 2.0,
    }
    assert summary([])["n"] == 0
