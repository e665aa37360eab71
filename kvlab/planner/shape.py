"""What the planner needs of a model: its shape (from a config.json) and its bytes.

    KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
                         (+ the scales of quantized codecs, as the codec counts them)

Five well-known configs ship with kvlab (`MODELS`, in planner/shapes/); any HF config.json
path, dict or transformers config works too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvlab.cache.codecs import CODECS
from kvlab.cache.spec import KVSpec

SHAPE_DIR = Path(__file__).parent / "shapes"
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
FLOAT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def kv_formats() -> tuple[str, ...]:
    """What KV can be stored as: a float dtype (the model's own, no codec) or a registered
    KV codec (scales included in its token bytes)."""
    return (*FLOAT_DTYPES, *(n for n in CODECS.names() if n not in FLOAT_DTYPES))


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
            return replace(cls.from_config(SHAPE_DIR / MODELS[config]), name=config)
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


def kv_bytes_per_token(shape: ModelShape, kv_codec: str = "bf16") -> int:
    """One token's K and V in every layer, stored as `kv_codec` (`kv_formats()`): a float
    dtype is the model's own (no codec), anything else a registered codec."""
    spec = KVSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim)
    if kv_codec in FLOAT_DTYPES:  # the model's own dtype: no codec, no scales
        return CODECS[None].token_bytes(spec, FLOAT_DTYPES[kv_codec])
    if kv_codec not in CODECS.names():
        raise ValueError(f"kv_codec={kv_codec!r} is unknown; choose one of {kv_formats()}")
    return CODECS[kv_codec].token_bytes(spec, torch.float32)


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
