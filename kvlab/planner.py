"""Capacity planner: how many sequences fit in an accelerator's memory, from a config.json.

The rule of thumb, term by term:

    KV capacity (tokens) ~ (memory x utilization - weights - activations) / KV bytes per token
    KV bytes per token   = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
                           (+ the scales of quantized codecs, as kvlab.cache.codecs counts them)

A paged cache holds a sequence of C tokens in ceil(C / block_size) blocks, so at context C
it runs blocks // ceil(C / block_size) sequences; a naive cache reserves max_model_len
slots for every sequence whatever its length, so it runs tokens // max_model_len.

    plan("Llama-3-8B", memory="80GiB", context_len=8192, users=32)

Five well-known configs ship with kvlab (`MODELS`); any HF config.json path, dict or
transformers config works too. `check_against_engine` runs kvlab's engine on the embedded
model with a byte budget and compares its measured peak concurrency with the prediction.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pandas as pd
import torch

CONFIG_DIR = Path(__file__).parent / "configs"
MODELS = {
    "SmolLM2-135M": "smollm2-135m.json",
    "Llama-3-8B": "llama-3-8b.json",
    "Mistral-7B": "mistral-7b.json",
    "Qwen2.5-7B": "qwen2.5-7b.json",
    "Llama-3-70B": "llama-3-70b.json",
}
# Bytes per weight element (int4: two per byte; quantization scales are not counted).
WEIGHT_DTYPES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
FLOAT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# KV storage: the float dtypes, or kvlab's codecs (scales included in their token bytes).
KV_DTYPES = ("fp32", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "kivi2")
# Element sizes used only if kvlab.cache.codecs is unavailable (no scales counted).
_KV_ELEMENT_BYTES = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "int8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "int4": 0.5,
    "kivi2": 0.25,
}
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
GIB = 2**30


def parse_size(text: str | int | float) -> int:
    """Bytes from "80GiB", "24GB", "512MiB", "1.5e9" or a number (GB = 1e9, GiB = 2**30)."""
    if isinstance(text, int | float):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"size {text!r} is not understood: give a number with an optional unit "
            "(B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model's architecture (a Llama-family decoder)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q, k and v

    @classmethod
    def from_config(cls, config: str | Path | dict | object) -> ModelShape:
        """From a shipped model name (`MODELS`), a config.json path, a dict or a HF config."""
        if isinstance(config, str) and config in MODELS:
            return replace(cls.from_config(CONFIG_DIR / MODELS[config]), name=config)
        if isinstance(config, str | Path):
            path = Path(config)
            if not path.is_file():
                raise ValueError(
                    f"model {str(config)!r} is neither a shipped config ({list(MODELS)}) "
                    "nor a config.json file"
                )
            data = json.loads(path.read_text())
            data.setdefault("_name_or_path", path.stem)
        elif isinstance(config, dict):
            data = dict(config)
        else:  # a transformers PretrainedConfig
            data = config.to_dict()
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if k not in data
        ]
        if missing:
            raise ValueError(f"config lacks {missing}: is it a decoder-only HF config.json?")
        heads = data["num_attention_heads"]
        name = str(data.get("_name_or_path") or data.get("model_type", "model"))
        return cls(
            name=name.rsplit("/", 1)[-1],
            num_layers=data["num_hidden_layers"],
            hidden_size=data["hidden_size"],
            num_heads=heads,
            num_kv_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim") or data["hidden_size"] // heads,
            vocab_size=data["vocab_size"],
            intermediate_size=data.get("intermediate_size", 4 * data["hidden_size"]),
            max_position_embeddings=data.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            attention_bias=bool(data.get("attention_bias", data.get("model_type") == "qwen2")),
        )

    @property
    def attention(self) -> str:
        """ "MHA", "GQA" or "MQA", with its head counts."""
        kind = "MHA" if self.num_kv_heads == self.num_heads else "GQA"
        kind = "MQA" if self.num_kv_heads == 1 and self.num_heads > 1 else kind
        return f"{kind} ({self.num_heads} query / {self.num_kv_heads} KV heads)"

    def with_mha(self) -> ModelShape:
        """The same model with multi-head attention: one KV head per query head."""
        return replace(self, name=f"{self.name} (MHA)", num_kv_heads=self.num_heads)

    def num_params(self) -> int:
        """Parameters: embeddings (+ LM head unless tied), layers (attention, SwiGLU MLP,
        two RMSNorms each) and the final norm."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + h


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str = "bf16") -> int:
    """One token's K and V in every layer, in `kv_dtype` (KV_DTYPES), scales included."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r} is unknown; choose one of {KV_DTYPES}")
    try:
        from kvlab.cache.codecs import codec_class
        from kvlab.cache.pool import KVSpec
    except ImportError:  # an older kvlab without codecs: plain element sizes
        elements = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
        return math.ceil(elements * _KV_ELEMENT_BYTES[kv_dtype])
    spec = KVSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim)
    if kv_dtype in FLOAT_DTYPES:  # the model's own dtype: no codec, no scales
        return codec_class(None).token_bytes(spec, FLOAT_DTYPES[kv_dtype])
    return codec_class(kv_dtype).token_bytes(spec, torch.float32)


def weight_bytes(shape: ModelShape, weight_dtype: str = "bf16") -> int:
    """Parameters x bytes per element of `weight_dtype` (WEIGHT_DTYPES)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(
            f"weight_dtype={weight_dtype!r} is unknown; choose one of {list(WEIGHT_DTYPES)}"
        )
    return math.ceil(shape.num_params() * WEIGHT_DTYPES[weight_dtype])


def activation_bytes(
    shape: ModelShape,
    act_dtype: str = "bf16",
    max_num_batched_tokens: int = 4096,
    max_num_seqs: int = 64,
) -> int:
    """A rough peak of one forward step's temporaries (flash-style attention, no score
    matrix): per batched token the residual, normed input, q/k/v, attention output and
    the MLP's gate/up/product, plus one fp32 row of logits per running sequence."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    per_token = 4 * h + 2 * kv + 3 * shape.intermediate_size
    element = WEIGHT_DTYPES[act_dtype] if act_dtype in FLOAT_DTYPES else 2.0
    return (
        math.ceil(max_num_batched_tokens * per_token * element)
        + max_num_seqs * shape.vocab_size * 4
    )


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True)
class Plan:
    """What fits: every size in bytes, token counts in tokens."""

    model: str
    attention: str
    params: int
    weight_dtype: str
    kv_dtype: str
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
        gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        lines = [
            f"{self.model}: {self.params / 1e9:.2f} B parameters, {self.attention}",
            f"memory {gib(self.memory_bytes)} x {self.utilization:.0%} usable = "
            f"{gib(self.memory_bytes * self.utilization)}",
            f"  weights ({self.weight_dtype})  {gib(self.weight_bytes)}",
            f"  activations      {gib(self.activation_bytes)}",
            f"  KV cache         {gib(self.kv_budget_bytes)}",
            f"KV per token ({self.kv_dtype}): {self.kv_bytes_per_token:,} bytes "
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
    kv_dtype: str | None = None,
    context_len: int = 4096,
    block_size: int = 16,
    users: int | None = None,
    max_model_len: int | None = None,
    utilization: float = 0.9,
    max_num_batched_tokens: int = 4096,
    max_num_seqs: int = 256,
    activations: int | None = None,
) -> Plan:
    """Plan a model on an accelerator.

    Args:
        model: a shipped name (`MODELS`), a config.json path, a dict, a HF config or a
            ModelShape.
        memory: accelerator memory ("80GiB", "24GB" or bytes).
        weight_dtype: one of WEIGHT_DTYPES. kv_dtype: one of KV_DTYPES; None means the
            weights' dtype when that is a float, else bf16.
        context_len: tokens per sequence (prompt + output). block_size: paged block size.
        users: optional number of concurrent sequences to check.
        max_model_len: what a naive cache reserves per sequence (default: the model's
            max_position_embeddings). utilization: fraction of memory the server may use.
        activations: bytes for activations; default `activation_bytes(...)`'s estimate.
    """
    shape = model if isinstance(model, ModelShape) else ModelShape.from_config(model)
    if kv_dtype is None:
        kv_dtype = weight_dtype if weight_dtype in FLOAT_DTYPES else "bf16"
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
    weights = weight_bytes(shape, weight_dtype)
    act_dtype = weight_dtype if weight_dtype in FLOAT_DTYPES else "bf16"
    if activations is None:
        activations = activation_bytes(shape, act_dtype, max_num_batched_tokens, max_num_seqs)
    kv_budget = max(0, int(memory_bytes * utilization) - weights - activations)
    per_token = kv_bytes_per_token(shape, kv_dtype)
    kv_tokens = kv_budget // per_token
    num_blocks = kv_tokens // block_size
    per_seq_blocks = blocks_for(context_len, block_size)
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
        kv_dtype=kv_dtype,
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


# --- the check against the engine ----------------------------------------------------------
_TORCH_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def predict_engine_capacity(
    model_config: object,
    kv_budget_bytes: int,
    sequence_len: int,
    cache: str = "paged",
    block_size: int = 16,
    kv_dtype: str | None = None,
    model_dtype: torch.dtype = torch.float32,
    max_model_len: int = 512,
) -> int:
    """Sequences of `sequence_len` tokens the planner says a kvlab engine holds at once.

    The planner's arithmetic with the engine's inputs: no weights or activations to take
    off (the budget is the KV budget), the model's dtype when kv_dtype is None.
    """
    shape = ModelShape.from_config(model_config)
    per_token = kv_bytes_per_token(shape, kv_dtype or _TORCH_NAMES[model_dtype])
    tokens = kv_budget_bytes // per_token
    if cache == "naive":
        return tokens // max_model_len
    return (tokens // block_size) // blocks_for(sequence_len, block_size)


@dataclass(frozen=True)
class CapacityCheck:
    predicted: int  # sequences, from the planner
    measured: int  # peak running sequences of the engine's run
    kv_budget_bytes: int
    sequence_len: int  # prompt + output tokens per request
    cache: str
    kv_dtype: str | None

    @property
    def error(self) -> float:
        """(measured - predicted) / measured."""
        return (self.measured - self.predicted) / self.measured


def check_against_engine(
    model,
    kv_budget_bytes: int,
    prompt_len: int = 24,
    output_len: int = 8,
    cache: str = "paged",
    block_size: int = 16,
    kv_dtype: str | None = None,
    max_model_len: int = 128,
    extra_requests: int = 4,
) -> CapacityCheck:
    """Serve identical-length requests (more than fit) on kvlab's engine with this byte
    budget and compare the peak number running at once with the planner's prediction.

    Prompts are distinct windows of the held-out text (token ids), so nothing is shared.
    """
    from kvlab import texts
    from kvlab.config import EngineConfig
    from kvlab.engine import Engine
    from kvlab.workloads import Request

    sequence_len = prompt_len + output_len
    predicted = predict_engine_capacity(
        model.config,
        kv_budget_bytes,
        sequence_len,
        cache,
        block_size,
        kv_dtype,
        model.dtype,
        max_model_len,
    )
    n = predicted + extra_requests
    ids = model.tokenizer.encode(texts.heldout())
    if len(ids) < n + prompt_len:
        raise ValueError(f"{n} requests of {prompt_len} tokens need a longer text")
    requests = [Request(ids[i : i + prompt_len], output_len) for i in range(n)]
    config = EngineConfig(
        cache=cache,
        block_size=block_size,
        kv_dtype=kv_dtype,
        kv_budget_bytes=kv_budget_bytes,
        max_model_len=max_model_len,
        max_num_seqs=n,
        max_num_batched_tokens=max(4096, n * prompt_len),  # admit them all in one step
    )
    engine = Engine(model, config)
    engine.run(requests, ignore_eos=True)
    measured = int(engine.stats()["running"].max())
    return CapacityCheck(predicted, measured, kv_budget_bytes, sequence_len, cache, kv_dtype)
