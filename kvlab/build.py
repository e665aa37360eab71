"""The engine, assembled: `Engine(model, config)` builds every part from the config once
and hands them to the engine core (kvlab.engine.core.EngineCore).

    engine = Engine(load_model(), EngineConfig(cache="paged", prefix_caching="hash"))

The parts, in the order they are made (each needs the ones before it):

1. the config's registered names are checked (a bad one raises ValueError, nothing built);
2. the runner: the model's forward in this process, or rank 0 of `tensor_parallel_size`
   processes (kvlab.parallel), whose pool every rank mirrors;
3. the cache over its pool, with its allocator, prefix index, admission policy,
   retention policy and tier connector (kvlab.cache);
4. the attention the runner calls: the torch reference, the kernels or batch-invariant
   attention, observed by a retention policy that scores blocks (kvlab.model);
5. the speculator, if the config drafts tokens (kvlab.speculative).
"""

from __future__ import annotations

import weakref

from kvlab.cache import check_config as check_cache_config
from kvlab.cache import make_cache
from kvlab.cache.events import EventSink
from kvlab.config import EngineConfig
from kvlab.engine.core import EngineCore
from kvlab.engine.parts import EngineParts, max_model_len_of
from kvlab.model.attention_chain import build_attention
from kvlab.model.loading import LoadedModel
from kvlab.model.pattern import Pattern, attention_pattern
from kvlab.model.runner import ModelRunner, kv_spec_of


class Engine(EngineCore):
    """Serves requests on one model with one KV-cache design (see kvlab.engine.core for
    what it does, and this module for what it is made of)."""

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig | None = None,
        kv_events: EventSink | None = None,
    ):
        """`kv_events`: a sink the cache reports its stored and removed blocks to
        (kvlab.cache.events; `kvlab serve --kv-events-config` publishes them)."""
        config = config or EngineConfig()
        parts = build_parts(model, config, kv_events)
        super().__init__(model, config, parts)
        weakref.finalize(self, parts.close)  # tensor-parallel workers stop at exit


def check_config(config: EngineConfig) -> None:
    """Raise ValueError naming the field if `config` names a part no registry holds (a
    cache, prefix index, KV codec, retention policy, proposer) or parts that do not
    combine; `Engine(model, config)` calls it before it builds anything."""
    check_cache_config(config)
    if config.speculative is not None:
        from kvlab.speculative import PROPOSERS

        PROPOSERS[config.speculative.method]  # its error names the field and the choices


def pattern_of(hf_config, config: EngineConfig) -> Pattern:
    """Each layer's sliding window (None: full attention), checked against what a window
    combines with so far."""
    pattern = attention_pattern(hf_config, config.attention_pattern)
    if any(pattern):
        for name, wanted in (
            ("tensor_parallel_size", 1), ("retention", "full"), ("batch_invariant", False)
        ):  # fmt: skip
            value = getattr(config, name)
            if value != wanted:
                raise ValueError(
                    f"a sliding-window layer (attention_pattern={config.attention_pattern!r},"
                    f" or the model's own) needs {name}={wanted!r}; got {value!r}"
                )
    return pattern


def build_parts(
    model: LoadedModel, config: EngineConfig, kv_events: EventSink | None = None
) -> EngineParts:
    """Every part an engine on `model` with `config` runs on (see the module docstring)."""
    check_config(config)
    max_model_len = max_model_len_of(model.config, config)
    hf = model.hf_model
    pattern = pattern_of(hf.config, config)
    if config.tensor_parallel_size > 1:
        from kvlab.parallel import start_tensor_parallel

        parallel = start_tensor_parallel(model, config.tensor_parallel_size)
        runner, attach, close = parallel.runner, parallel.attach, parallel.close
        spec = runner.kv_spec
    else:
        parallel, runner, attach, close = None, None, None, (lambda: None)
        spec = kv_spec_of(hf.config)
    embedding = hf.get_input_embeddings().weight
    try:
        cache = make_cache(
            config,
            spec,
            embedding.dtype,
            embedding.device,
            max_model_len,
            attach,
            kv_events,
            pattern,
        )
    except BaseException:
        close()
        raise
    if runner is None:
        retention = cache.retention  # H2O scores what attention reads
        scores = retention.scores if retention and retention.observes_attention else None
        attention = build_attention(config, cache.block_size, scores)
        fused_ops = config.attention == "kernels"  # bf16 or fp32 on the CPU: kernels.cpu_fused
        runner = ModelRunner(hf, attention, config.batch_invariant, pattern, fused_ops)
        if cache.groups is not None:  # hybrid: each layer reads and writes its group's blocks
            runner.use_kv_groups(cache.groups)
    parts = EngineParts(runner, cache, max_model_len, parallel=parallel, close=close)
    if config.speculative is not None:
        from kvlab.speculative.speculator import Speculator

        parts.speculator = Speculator(
            config.speculative, runner, cache, max_model_len, record=config.record_block_map
        )
    return parts
