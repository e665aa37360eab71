"""Notebook 13's exercises: what a salt leaves an attacker to hit, and what a "shared"
prompt shares once the per-user line moves after the instructions."""

from __future__ import annotations

from kvlab.course.exercise import exercise

BLOCK = 16  # the notebook's engines' block size


def _salted() -> dict:
    """A 144-token victim prompt and two tenants' salts, for the tests."""
    from kvlab.serve.tenants import engine_salt

    return {
        "victim_ids": list(range(1000, 1144)),
        "victim_salt": engine_salt("acme", None),
        "attacker_salt": engine_salt("mallory", None),
    }


def _salted_hint(answer, right) -> str:
    if isinstance(answer, int) and answer > right and answer % BLOCK == 0:
        return (
            "that is what the shared cache gives: the salt goes into every block's key, so "
            "the attacker's keys differ from the victim's from block 0 on."
        )
    return "count the attacker's block keys that equal the victim's, from the first on."


@exercise(
    "13.salted-hit-tokens",
    question="On the server with per-tenant salts, how many of the victim's prompt tokens "
    "can the attacker's *right* guess (the very same token ids) hit in the cache?",
    solution="0: the tenant's salt is hashed into every block key (`block_hashes`), so the "
    "attacker's keys differ from the victim's from block 0 on, whatever the tokens; on the "
    "shared cache (no salt) the same guess hits all 9 full blocks, 144 tokens.",
    hint=_salted_hint,
    example=_salted,
)
def salted_hit_tokens(victim_ids: list[int], victim_salt: str, attacker_salt: str) -> int:
    from kvlab.cache.prefix.hash import block_hashes

    victim = block_hashes(victim_ids, BLOCK, victim_salt, algo="blake2b")
    attacker = block_hashes(victim_ids, BLOCK, attacker_salt, algo="blake2b")
    same = next((i for i, (a, b) in enumerate(zip(victim, attacker)) if a != b), len(victim))
    return same * BLOCK


def _layout() -> dict:
    """Two prompts sharing their first 134 tokens, for the tests."""
    shared = list(range(500, 634))
    return {"first": shared + [1, 2, 3, 4], "second": shared + [5, 6, 7]}


def _shared_hint(answer, right) -> str:
    if isinstance(answer, int) and answer > right and answer < right + BLOCK:
        return f"only full blocks are shared: round down to a multiple of {BLOCK}."
    return f"the tokens both prompts open with, rounded down to whole blocks of {BLOCK}."


@exercise(
    "13.pii-last-hits",
    question='In the "PII last" layout the users\' prompts open with the same tokens (the '
    "count is printed above). How many prompt tokens does the second user's request hit?",
    solution="The shared opening (the instructions and the start of the customer line) "
    "rounded down to whole blocks of 16: 128 tokens of 158 for this model's tokenizer; the "
    "rest, the user's own line, is computed (`engine.explain` names block 8).",
    hint=_shared_hint,
    example=_layout,
)
def pii_last_hits(first: list[int], second: list[int]) -> int:
    common = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), len(second))
    full = min(common, len(second) - 1)  # the last prompt token is always computed
    return full // BLOCK * BLOCK
