"""kvlab's step profile beside vLLM's on the same tokens: where the gap between them is.

    steps = profile_steps(model, requests, config)    # kvlab, kvlab.experiments.step_profile
    run = side.run(prompts, max_new, profile=True)    # vLLM, a VllmBenchSide(inproc=True)
    phase_table(steps, run)                           # seconds per phase, both systems
    parts_table_vs_vllm(steps, run)                   # seconds per part, both systems

Both runs split where every request has had its prompt computed (its first token out):
the **prompt phase** (prefill, with any decodes mixed into it) and the **decode phase**
(the rest). vLLM's run is recorded by torch's profiler in one process; its operators'
self CPU time is sorted into kvlab's parts by name (VLLM_OP_PARTS), and what no operator
accounts for (Python: scheduling, bookkeeping, the profiler's own cost) is "unaccounted".
The profiler slows a run of many small operators a little, so compare the shares of the
parts, and take speed from `kvlab bench`.
"""

from __future__ import annotations

import re

import pandas as pd

from kvlab.experiments.step_profile import PARTS
from kvlab.peers.vllm_peer import VllmRun

# A vLLM (torch profiler) operator name -> kvlab's part: the first pattern that matches.
VLLM_OP_PARTS = (
    ("attention", r"attn|attention|sdpa|flash|paged"),
    ("kv write", r"reshape_and_cache|cache"),
    ("matmuls", r"onednn|mkldnn|linear|addmm|\bmm\b|matmul|gemm|bmm"),
    ("sampling", r"sampl|argmax|topk|top_k|softmax|log_softmax"),
    ("other forward", r"norm|rotary|rope|silu|act_and_mul|embedding|aten::"),
)


def vllm_part(op: str) -> str:
    """The kvlab part an operator of vLLM's profile counts under ("unaccounted" if none)."""
    for part, pattern in VLLM_OP_PARTS:
        if re.search(pattern, op, flags=re.IGNORECASE):
            return part
    return "unaccounted"


def _split(step_ms: list[float], prompt_steps: int) -> dict[str, tuple[int, float]]:
    return {
        "prompt phase": (prompt_steps, sum(step_ms[:prompt_steps]) / 1e3),
        "decode phase": (len(step_ms) - prompt_steps, sum(step_ms[prompt_steps:]) / 1e3),
        "whole run": (len(step_ms), sum(step_ms) / 1e3),
    }


def kvlab_phases(steps: pd.DataFrame) -> dict[str, tuple[int, float]]:
    """kvlab's (steps, seconds) per phase, from profile_steps' rows."""
    prompt = [i for i, phase in enumerate(steps["phase"]) if phase != "decode"]
    return _split(list(steps["step_ms"]), (prompt[-1] + 1) if prompt else 0)


def vllm_phases(run: VllmRun) -> dict[str, tuple[int, float]]:
    """vLLM's (steps, seconds) per phase: its prompt phase ends with the last step that
    completed a prompt (vLLM counts a prompt's tokens in the step of its first token)."""
    rows = run.step_rows
    prompt = [i for i, row in enumerate(rows) if row["prompt_tokens"] > 0]
    return _split([row["step_ms"] for row in rows], (prompt[-1] + 1) if prompt else 0)


def phase_table(steps: pd.DataFrame, run: VllmRun) -> pd.DataFrame:
    """Steps and seconds per phase for kvlab and vLLM, and kvlab's time over vLLM's."""
    ours, theirs = kvlab_phases(steps), vllm_phases(run)
    table = pd.DataFrame(
        {
            "kvlab steps": {k: v[0] for k, v in ours.items()},
            "kvlab s": {k: v[1] for k, v in ours.items()},
            "vLLM steps": {k: v[0] for k, v in theirs.items()},
            "vLLM s": {k: v[1] for k, v in theirs.items()},
        }
    )
    table["kvlab / vLLM time"] = table["kvlab s"] / table["vLLM s"]
    return table


def vllm_parts(run: VllmRun) -> dict[str, float]:
    """Seconds of vLLM's profiled run per kvlab part (its top operators' self time)."""
    seconds = dict.fromkeys([*PARTS, "unaccounted"], 0.0)
    for op in run.ops:
        seconds[vllm_part(op["op"])] += op["self_ms"] / 1e3
    wall = sum(row["step_ms"] for row in run.step_rows) / 1e3
    seconds["unaccounted"] += max(0.0, wall - sum(seconds.values()))
    return seconds


def parts_table_vs_vllm(steps: pd.DataFrame, run: VllmRun) -> pd.DataFrame:
    """Seconds per part over the whole run, kvlab's (timed) beside vLLM's (profiled)."""
    ours = {part: steps[f"{part} ms"].sum() / 1e3 for part in PARTS}
    ours["unaccounted"] = max(0.0, steps["step_ms"].sum() / 1e3 - sum(ours.values()))
    table = pd.DataFrame({"kvlab s": ours, "vLLM s": vllm_parts(run)})
    table.loc["whole run"] = table.sum()
    return table
