"""kvlab.course: the library's lines shown in the notebooks, and exercises that check themselves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from show_source_outputs import is_stale, notebooks, shown

from kvlab.cache.spec import KVSpec
from kvlab.course import EXERCISES, ask, show_source
from kvlab.course import exercises as _registered  # noqa: F401
from kvlab.course.answers import render

ROOT = Path(__file__).parents[1]
NOTEBOOKS = ROOT / "notebooks"


def test_show_source_shows_the_lines_with_their_file_and_numbers():
    shown = show_source(KVSpec.bytes_per_token).data
    assert shown.startswith("`kvlab/cache/spec.py`, lines ")
    assert "def bytes_per_token(self, dtype: torch.dtype) -> int:" in shown
    assert "\n    return 2 * self.num_layers" in shown  # dedented to the def


def test_show_source_cuts_between_markers_and_names_a_missing_one():
    shown = show_source(KVSpec.bytes_per_token, start="element =", end="return").data
    body = shown.split("```python\n")[1].split("\n```")[0].splitlines()
    assert body[0].startswith("element =") and body[-1].startswith("return 2 *")
    with pytest.raises(ValueError, match="'no such line' is not in the source"):
        show_source(KVSpec.bytes_per_token, start="no such line")


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_an_exercise_passes_its_answer_and_hints_at_a_wrong_one(key):
    ex = EXERCISES[key]
    context = ex.example()
    right = ex.solve(**context)
    assert ask(key, right, **context), f"{key}: its own answer is not right"
    wrong = ex.known_wrong(right)
    verdict = ask(key, wrong, **context)
    assert not verdict and verdict.status == "not yet" and "Hint: " in verdict.message
    assert ask(key, None, **context).status == "unanswered"


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_every_exercise_is_asked_in_its_notebook(key):
    [notebook] = NOTEBOOKS.glob(f"{key.split('.')[0]}_*.py")
    assert re.search(rf"ask\(\s*\"{re.escape(key)}\"", notebook.read_text()), notebook.name


def test_a_tensor_answer_counts_as_its_number():
    import torch

    context = EXERCISES["01.kv-bytes-bf16"].example()
    right = EXERCISES["01.kv-bytes-bf16"].solve(**context)
    assert ask("01.kv-bytes-bf16", torch.tensor(right), **context)


def test_an_unknown_exercise_is_the_notebook_s_bug():
    with pytest.raises(ValueError, match="no exercise 'nope'"):
        ask("nope", 1)


def test_the_committed_answer_key_is_current():
    assert (NOTEBOOKS / "ANSWERS.md").read_text() == render(), (
        "run: python -m kvlab.course.answers > notebooks/ANSWERS.md"
    )


def test_every_stored_show_source_output_is_the_library_s_current_lines():
    """A library change that moves or edits shown lines fails here in seconds, not in the
    browser test's re-execution of the notebook half an hour into `make test`;
    `python tests/show_source_outputs.py --update` stores the outputs a re-run would."""
    every = [(path, m) for path in notebooks() for _, _, m in shown(json.loads(path.read_text()))]
    assert len(every) > 20  # the pattern still matches what show_source prints
    old = [f"{p.name}: {m[1]} lines {m[2]}-{m[3]}" for p, m in every if is_stale(m)]
    assert not old, f"stale show_source outputs (tests/show_source_outputs.py --update): {old}"
