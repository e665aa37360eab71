"""Capacity planner: how many sequences fit in an accelerator's memory, from a config.json.

The rule of thumb, term by term:

    KV capacity (tokens) ~ (memory x utilization - weights - activations) / KV bytes per token

A paged cache holds a sequence of C tokens in ceil(C / block_size) blocks, so at context C
it runs blocks // ceil(C / block_size) sequences; a naive cache reserves max_model_len
slots for every sequence whatever its length, so it runs tokens // max_model_len.

    plan("Llama-3-8B", memory="80GiB", context_len=8192, users=32)
    plan("Llama-3-70B", memory="80GiB", tensor_parallel_size=4)   # per device, 4 devices

With tensor parallelism over `tensor_parallel_size` devices (vLLM's
`tensor_parallel_size`), `memory` is each device's: every rank holds 1/tp of the weights
and, for every token, the K and V of its share of the KV heads (kv_heads // tp of them, at
least 1: vLLM replicates a KV head when there are more ranks than heads), so each device's
KV budget holds tp times the tokens it would hold for the whole model.

`kvlab.experiments.capacity_check` runs kvlab's engine on the embedded model with a byte
budget and compares its measured peak concurrency with the prediction.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from kvlab.planner.shape import (
    FLOAT_DTYPES,
    ModelShape,
    activation_bytes,
    kv_bytes_per_token,
    weight_bytes,
)
from kvlab.units import GiB, ceil_div, parse_size


@dataclass(frozen=True)
class Plan:
    """What fits: every size in bytes, token counts in tokens."""

    model: str
    attention: str
    params: int
    weight_dtype: str
    kv_codec: str
    memory_bytes: int  # the accelerator's memory
    utilization: float  # fraction of it the server may use (vLLM's gpu_memory_utilization)
    weight_bytes: int
    activation_bytes: int
    kv_budget_bytes: int  # what is left for the KV cache
    kv_bytes_per_token: int
    kv_tokens: int  # token slots in the KV budget
    block_size: int
    num_blocks: int
    context_len: int
    max_model_len: int
    paged_max_seqs: int  # sequences of context_len tokens, each in whole blocks
    naive_max_seqs: int  # sequences each reserving max_model_len slots
    users: int | None
    users_fit: bool | None  # whether `users` sequences of context_len fit (paged)
    users_max_context: int | None  # longest context memory allows each of `users` (paged)
    users_kv_bytes: int | None  # KV of `users` sequences of context_len, in whole blocks
    memory_needed_bytes: int | None  # memory for `users` x context_len (before utilization)
    tensor_parallel_size: int = 1  # devices the model is split over; sizes are per device
    kv_heads_per_rank: int | None = None  # KV heads each device stores (None: all of them)

    @property
    def oom_users(self) -> int:
        """The first number of users at context_len that runs out of memory (paged)."""
        return self.paged_max_seqs + 1

    @property
    def oom_context(self) -> int | None:
        """The context length at which `users` sequences run out of memory (paged); None
        without `users`, or when memory outlasts max_model_len."""
        if self.users_max_context is None or self.users_max_context >= self.max_model_len:
            return None
        return self.users_max_context + 1

    def to_dict(self) -> dict:
        return {**asdict(self), "oom_users": self.oom_users, "oom_context": self.oom_context}

    def summary(self) -> str:
        """A few lines a learner can read."""
        gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        lines = [f"{self.model}: {self.params / 1e9:.2f} B parameters, {self.attention}"]
        if self.tensor_parallel_size > 1:
            lines.append(
                f"tensor parallel over {self.tensor_parallel_size} devices: each holds "
                f"1/{self.tensor_parallel_size} of the weights and {self.kv_heads_per_rank} "
                "KV head(s) of every token; sizes below are per device"
            )
        lines += [
            f"memory {gib(self.memory_bytes)} x {self.utilization:.0%} usable = "
            f"{gib(self.memory_bytes * self.utilization)}",
            f"  weights ({self.weight_dtype})  {gib(self.weight_bytes)}",
            f"  activations      {gib(self.activation_bytes)}",
            f"  KV cache         {gib(self.kv_budget_bytes)}",
            f"KV per token ({self.kv_codec}): {self.kv_bytes_per_token:,} bytes "
            f"-> {self.kv_tokens:,} tokens = {self.num_blocks:,} blocks of {self.block_size}",
            f"at {self.context_len:,} tokens per sequence: paged {self.paged_max_seqs} sequences, "
            f"naive (reserving max_model_len={self.max_model_len:,}) {self.naive_max_seqs}",
            f"  {self.oom_users} users at {self.context_len:,} tokens run out of memory",
        ]
        if self.users is not None:
            verdict = "fit" if self.users_fit else "do NOT fit"
            lines.append(
                f"{self.users} users at {self.context_len:,} tokens {verdict} "
                f"(they need {gib(self.memory_needed_bytes)} of memory)"
            )
            if self.oom_context is None:
                lines.append(f"  memory outlasts max_model_len={self.max_model_len:,} for them")
            else:
                lines.append(f"  they run out of memory at {self.oom_context:,} tokens each")
        return "\n".join(lines)


def plan(
    model: str | Path | dict | ModelShape | object,
    memory: str | int = "80GiB",
    weight_dtype: str = "bf16",
    kv_codec: str | None = None,
    context_len: int = 4096,
    block_size: int = 16,
    users: int | None = None,
    max_model_len: int | None = None,
    utilization: float = 0.9,
    max_num_batched_tokens: int = 4096,
    max_num_seqs: int = 256,
    activations: int | None = None,
    tensor_parallel_size: int = 1,
) -> Plan:
    """Plan a model on an accelerator (or on `tensor_parallel_size` of them).

    Args:
        model: a shipped name (`MODELS`), a config.json path, a dict, a HF config or a
            ModelShape.
        memory: accelerator memory ("80GiB", "24GB" or bytes).
        weight_dtype: one of WEIGHT_DTYPES. kv_codec: one of KV_CODECS; None means the
            weights' dtype when that is a float, else bf16.
        context_len: tokens per sequence (prompt + output). block_size: paged block size.
        users: optional number of concurrent sequences to check.
        max_model_len: what a naive cache reserves per sequence (default: the model's
            max_position_embeddings). utilization: fraction of memory the server may use.
        activations: bytes for activations; default `activation_bytes(...)`'s estimate.
        tensor_parallel_size: devices the model is split over, each with `memory`
            (`rank_shape`: what one of them holds); every size in the plan is per device.
    """
    shape = model if isinstance(model, ModelShape) else ModelShape.from_config(model)
    if kv_codec is None:
        kv_codec = weight_dtype if weight_dtype in FLOAT_DTYPES else "bf16"
    for name, value in (("context_len", context_len), ("block_size", block_size)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if users is not None and users < 1:
        raise ValueError(f"users={users} must be >= 1")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization={utilization} must be in (0, 1]")
    max_model_len = max_model_len or shape.max_position_embeddings
    if context_len > max_model_len:
        raise ValueError(f"context_len={context_len} exceeds max_model_len={max_model_len}")
    memory_bytes = parse_size(memory)
    tp = tensor_parallel_size
    rank = rank_shape(shape, tp)  # what one device holds: the model itself when tp == 1
    weights = ceil_div(weight_bytes(shape, weight_dtype), tp)  # each device's shard
    act_dtype = weight_dtype if weight_dtype in FLOAT_DTYPES else "bf16"
    if activations is None:
        activations = activation_bytes(rank, act_dtype, max_num_batched_tokens, max_num_seqs)
    kv_budget = max(0, int(memory_bytes * utilization) - weights - activations)
    per_token = kv_bytes_per_token(rank, kv_codec)  # every layer's K and V of its KV heads
    kv_tokens = kv_budget // per_token
    num_blocks = kv_tokens // block_size
    per_seq_blocks = ceil_div(context_len, block_size)  # whole blocks per sequence
    users_fit = users_max_context = kv_needed = needed = None
    if users is not None:
        users_fit = users * per_seq_blocks <= num_blocks
        users_max_context = (num_blocks // users) * block_size  # may pass max_model_len
        kv_needed = users * per_seq_blocks * block_size * per_token
        needed = math.ceil((weights + activations + kv_needed) / utilization)
    return Plan(
        model=shape.name,
        attention=shape.attention,
        params=shape.num_params(),
        weight_dtype=weight_dtype,
        kv_codec=kv_codec,
        memory_bytes=memory_bytes,
        utilization=utilization,
        weight_bytes=weights,
        activation_bytes=activations,
        kv_budget_bytes=kv_budget,
        kv_bytes_per_token=per_token,
        kv_tokens=kv_tokens,
        block_size=block_size,
        num_blocks=num_blocks,
        context_len=context_len,
        max_model_len=max_model_len,
        paged_max_seqs=num_blocks // per_seq_blocks,
        naive_max_seqs=kv_tokens // max_model_len,
        users=users,
        users_fit=users_fit,
        users_max_context=users_max_context,
        users_kv_bytes=kv_needed,
        memory_needed_bytes=needed,
        tensor_parallel_size=tp,
        kv_heads_per_rank=rank.num_kv_heads if tp > 1 else None,
    )


def rank_shape(shape: ModelShape, tensor_parallel_size: int = 1) -> ModelShape:
    """What one of `tensor_parallel_size` ranks computes and stores, as vLLM splits a
    Llama-family model: query heads and the MLP split evenly, KV heads too (kv_heads // tp
    each), or one replicated KV head per rank when there are more ranks than KV heads
    (vLLM's QKVParallelLinear and ModelConfig.get_num_kv_heads). The hidden size (the
    residual stream every rank keeps whole) does not change.

    Raises ValueError where vLLM refuses: query heads not divisible by tp, or KV heads and
    tp neither dividing the other."""
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size={tp} must be >= 1")
    if tp == 1:
        return shape
    heads, kv = shape.num_heads, shape.num_kv_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the {heads} query heads")
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} and the {kv} KV heads must divide one another")
    return replace(
        shape,
        name=f"{shape.name} (1 of {tp} ranks)",
        num_heads=heads // tp,
        num_kv_heads=max(1, kv // tp),
        intermediate_size=ceil_div(shape.intermediate_size, tp),
    )


def capacity_curve(
    model: str | Path | dict | ModelShape | object,
    contexts: list[int] | None = None,
    **kwargs,
) -> pd.DataFrame:
    """Max concurrent sequences against context length: paged, naive, and paged MHA.

    One row per context length; kwargs go to `plan` (memory, dtypes, block_size, ...).
    """
    shape = model if isinstance(model, ModelShape) else ModelShape.from_config(model)
    top = kwargs.get("max_model_len") or shape.max_position_embeddings
    if contexts is None:
        contexts = [2**k for k in range(7, 20) if 2**k <= top]
    kwargs = {k: v for k, v in kwargs.items() if k != "users"}
    rows = []
    for context in contexts:
        gqa = plan(shape, context_len=context, **kwargs)
        mha = plan(shape.with_mha(), context_len=context, **kwargs)
        rows.append(
            {
                "context_len": context,
                "paged": gqa.paged_max_seqs,
                "naive": gqa.naive_max_seqs,
                "paged_mha": mha.paged_max_seqs,
                "kv_tokens": gqa.kv_tokens,
            }
        )
    return pd.DataFrame(rows)


def gqa_vs_mha(model: str | Path | dict | ModelShape | object, **kwargs) -> pd.DataFrame:
    """The model as shipped (GQA) beside the same model with MHA: parameters, KV bytes
    per token, KV tokens and max sequences at the context length. kwargs go to `plan`."""
    shape = model if isinstance(model, ModelShape) else ModelShape.from_config(model)
    rows = {}
    for variant in (shape, shape.with_mha()):
        p = plan(variant, **kwargs)
        rows[p.attention] = {
            "params (B)": round(p.params / 1e9, 3),
            "KV bytes/token": p.kv_bytes_per_token,
            "KV tokens": p.kv_tokens,
            f"paged seqs @ {p.context_len}": p.paged_max_seqs,
            f"naive seqs @ {p.max_model_len}": p.naive_max_seqs,
        }
    return pd.DataFrame.from_dict(rows, orient="index")


_TORCH_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def predict_engine_capacity(
    model_config: object,
    kv_budget_bytes: int,
    sequence_len: int,
    cache: str = "paged",
    block_size: int = 16,
    kv_codec: str | None = None,
    model_dtype: torch.dtype = torch.float32,
    max_model_len: int = 512,
) -> int:
    """Sequences of `sequence_len` tokens the planner says a kvlab engine holds at once.

    The planner's arithmetic with the engine's inputs: no weights or activations to take
    off (the budget is the KV budget), the model's dtype when kv_codec is None.
    """
    shape = ModelShape.from_config(model_config)
    per_token = kv_bytes_per_token(shape, kv_codec or _TORCH_NAMES[model_dtype])
    tokens = kv_budget_bytes // per_token
    if cache == "naive":
        return tokens // max_model_len
    return (tokens // block_size) // ceil_div(sequence_len, block_size)
