"""Why greedy decoding drifts with the batch, measured: the same prompts run alone and in
other settings, every generated token's logits recorded and compared bit for bit.

    alone = run(model, prompts, ALONE)
    other = run(model, prompts, Setting("batch of 16", batch=16))
    compare_steps(alone, other)   # per prompt: bit-equal steps, the token where they part, the gap

A setting is how a prompt meets the engine: with how many others in its steps, its
prompt cut in chunks, its prefix found in the cache, on how many threads, and in
batch-invariant mode or not (EngineConfig.batch_invariant). `matmul_rows` shows the
cause one level down: a row of a matrix product gets other bits when other rows come
with it. Every run here is greedy, so a changed token can only come from changed logits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.nn.functional as F

from kvlab.build import Engine
from kvlab.config import EngineConfig, SamplingParams
from kvlab.model.loading import LoadedModel

TOP = 8  # logits kept per step besides the digest: the leaders, for gaps
BASE = {"cache": "paged", "max_model_len": 1024, "kv_budget_tokens": 16384}


@dataclass(frozen=True)
class Setting:
    """How a prompt is run: engine overrides, torch threads (None: as set), how many
    prompts share each engine run (`batch`), and whether the same prompts ran once
    before on the engine (`warm`: prefix-cache hits; needs prefix_caching)."""

    name: str
    config: dict = field(default_factory=dict)
    threads: int | None = None
    batch: int = 1
    warm: bool = False


ALONE = Setting("alone")


@dataclass(frozen=True)
class Step:
    """One generated token and the logits it was chosen from."""

    token: int
    digest: str  # of the logits' bytes: equal digests, equal bits
    top_ids: tuple[int, ...]  # the TOP largest logits, largest first
    top_values: tuple[float, ...]

    def logit(self, token: int) -> float | None:
        """The logit of `token`, if it is among the TOP kept."""
        return dict(zip(self.top_ids, self.top_values)).get(token)


def step_of(logits: torch.Tensor, token: int) -> Step:
    """logits: (vocab,) float32 -> the Step that keeps what comparisons need."""
    top = logits.topk(TOP)
    digest = hashlib.blake2b(logits.contiguous().numpy().tobytes(), digest_size=16).hexdigest()
    return Step(token, digest, tuple(top.indices.tolist()), tuple(top.values.tolist()))


def record_logits(engine: Engine) -> dict[int, list[torch.Tensor]]:
    """From now on, each request's logits at every token it samples, by request id:
    (vocab,) float32 tensors in step order. An observer of the engine's steps."""
    seen: dict[int, list[torch.Tensor]] = {}

    def record(batch, logits) -> None:
        for (seq, n), rows in zip(batch, logits):
            if seq.num_computed + n >= seq.num_tokens:  # the prompt is in: a token follows
                seen.setdefault(seq.request_id, []).append(rows[-1].clone())

    engine.observers.subscribe("after_compute", record)
    return seen


def run(
    model: LoadedModel,
    prompts: list[list[int]],
    setting: Setting,
    new_tokens: int = 16,
    base: dict | None = None,
    companions: list[list[int]] = (),
) -> list[list[Step]]:
    """Each prompt's greedy answer under `setting`, one Step per generated token.

    Prompts are token ids (used as given). They run `setting.batch` at a time on one
    engine, in order, a short last group topped up to `batch` with `companions` (whose
    answers are not kept); with `warm`, each group first runs for one token (its prompts'
    full blocks are then in the prefix cache; the tokens after the first would add no
    hit) and the second run counts.
    """
    config = EngineConfig(**{**BASE, **(base or {}), **setting.config})
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    warm_up = SamplingParams(max_new_tokens=1, ignore_eos=True)
    threads = torch.get_num_threads()
    if setting.threads:
        torch.set_num_threads(setting.threads)
    try:
        engine = Engine(model, config)
        seen = record_logits(engine)
        answers: list[list[Step]] = []
        for start in range(0, len(prompts), setting.batch):
            group = prompts[start : start + setting.batch]
            kept = len(group)
            group += list(companions[: setting.batch - kept])
            if setting.warm:  # one token first: the prompts' full blocks enter the prefix cache
                engine.generate(group, warm_up, progress=False)
            seen.clear()
            outputs = engine.generate(group, params, progress=False)
            for out in outputs[:kept]:
                rows = seen[out.request_id]
                answers.append([step_of(x, t) for x, t in zip(rows, out.token_ids)])
    finally:
        torch.set_num_threads(threads)
    return answers


def compare_steps(
    reference: list[list[Step]], other: list[list[Step]], tokenizer=None
) -> pd.DataFrame:
    """One row per prompt: steps whose logits are the same bits (up to the first parting),
    where the answers part (None: never), the tokens there and the reference's logit gap
    between them (its margin for the token it chose), and the largest change among the
    reference's leading logits over the steps compared."""
    rows = []
    for index, (ref, alt) in enumerate(zip(reference, other)):
        parts = next((i for i, (a, b) in enumerate(zip(ref, alt)) if a.token != b.token), None)
        upto = len(ref) if parts is None else parts + 1
        exact = sum(a.digest == b.digest for a, b in zip(ref[:upto], alt[:upto]))
        moved = [
            abs(value - b.logit(token))
            for a, b in zip(ref[:upto], alt[:upto])
            for token, value in zip(a.top_ids, a.top_values)
            if b.logit(token) is not None
        ]
        row = {"prompt": index, "steps": upto, "bit_exact": exact, "parts_at": parts}
        row["max_change"] = max(moved, default=0.0)
        if parts is not None:
            a, b = ref[parts], alt[parts]
            taken = a.logit(b.token)
            row["gap"] = None if taken is None else a.top_values[0] - taken
            row["was"], row["became"] = a.token, b.token
            if tokenizer is not None:
                row["was"], row["became"] = (tokenizer.decode([t]) for t in (a.token, b.token))
        rows.append(row)
    return pd.DataFrame(rows)


def drift(
    model: LoadedModel,
    prompts: list[list[int]],
    settings: list[Setting],
    new_tokens: int = 16,
    base: dict | None = None,
    companions: list[list[int]] = (),
) -> pd.DataFrame:
    """`compare_steps` of every setting against ALONE (same base), one frame: a column
    `setting` names it."""
    reference = run(model, prompts, ALONE, new_tokens, base)
    frames = []
    for setting in settings:
        answers = run(model, prompts, setting, new_tokens, base, companions)
        frame = compare_steps(reference, answers, model.tokenizer)
        frames.append(frame.assign(setting=setting.name))
    return pd.concat(frames, ignore_index=True)


def matmul_rows(
    weight: torch.Tensor, counts: tuple[int, ...] = (1, 2, 4, 16, 64), threads=(1, 2)
) -> pd.DataFrame:
    """Whether row 0 of x @ weight.T gets the same bits when x has `count` rows, for
    F.linear (MKL's sgemm, what HF transformers runs), kvlab's Linears (oneDNN over the
    weight reordered once; the default mode) and kvlab's invariant linears (batch-invariant
    mode), on 1 and 2 threads. Compared with one row, one thread. What the libraries do
    depends on the CPU; the invariant linears keep the bits by construction."""
    from kvlab.model.invariant import InvariantLinears
    from kvlab.model.linear import Linears

    x = torch.randn(max(counts), weight.shape[1], generator=torch.Generator().manual_seed(0))
    linear = Linears([weight])
    kernels = {
        "F.linear (MKL)": F.linear,
        "kvlab Linears (oneDNN)": linear,
        "kvlab invariant": InvariantLinears(),
    }
    before, rows = torch.get_num_threads(), []
    try:
        for name, kernel in kernels.items():
            torch.set_num_threads(1)
            alone = kernel(x[:1], weight)
            for t in threads:
                torch.set_num_threads(t)
                for count in counts:
                    same = torch.equal(kernel(x[:count], weight)[:1], alone)
                    rows.append({"matmul": name, "threads": t, "rows": count, "same_bits": same})
    finally:
        torch.set_num_threads(before)
    return pd.DataFrame(rows)
