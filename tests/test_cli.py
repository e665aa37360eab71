"""The `kvlab` command line."""

from __future__ import annotations

import json
import subprocess
import sys

from kvlab.cli import main


def test_generate_json(capsys):
    code = main(["generate", "What is the capital of France?", "--max-new-tokens", "16", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["outputs"][0]["text"] == "The capital of France is Paris."
    assert result["outputs"][0]["finish_reason"] == "eos"


def test_bad_input_is_a_clear_error(capsys):
    assert main(["generate", "hi", "--max-new-tokens", "0"]) == 2
    assert "max_new_tokens=0 must be >= 1" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "kvlab", "--help"], capture_output=True, text=True, check=True
    )
    assert "generate" in result.stdout
