"""The text kvlab ships (written for the project, see kvlab/data/README.md)."""

from __future__ import annotations

from functools import cache
from importlib import resources


def _read(name: str) -> str:
    return resources.files("kvlab").joinpath("data", name).read_text(encoding="utf-8")


@cache
def chat_prompts() -> list[str]:
    """64 everyday chat prompts; the first is "What is the capital of France?"."""
    return _read("chat_prompts.txt").splitlines()


@cache
def questions() -> list[str]:
    """48 generic questions about a document."""
    return _read("questions.txt").splitlines()


@cache
def preamble() -> str:
    """The document-QA assistant's system preamble (~300 tokens)."""
    return _read("preamble.txt").strip()


@cache
def documents() -> dict[str, str]:
    """16 documents from ~100 to ~1400 words, by file stem."""
    folder = resources.files("kvlab").joinpath("data", "documents")
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".txt")), key=lambda f: f.name)
    return {f.name.removesuffix(".txt"): f.read_text(encoding="utf-8").strip() for f in files}


@cache
def heldout() -> str:
    """~3500 words of continuous prose for perplexity measurements."""
    return _read("heldout.txt")
