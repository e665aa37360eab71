"""Configuration dataclasses. Each one checks itself and names the field, value and limit.

A leaf: nothing of kvlab is imported here. The fields that name registered parts (a
cache, prefix index, KV codec, retention policy, proposer, tier) are checked against their
registries when an engine is built (`kvlab.cache.check_config`, kvlab.speculative), so
`Engine(model, config)` raises the ValueError before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from kvlab.cache.tiers import TierConfig

# The fixed choices. The variants (cache kinds, prefix indexes, KV codecs) are registered
# parts: see kvlab.cache.CACHES, kvlab.cache.prefix.PREFIX_INDEXES, kvlab.cache.codecs.CODECS.
Batching = Literal["continuous", "static"]
ScheduleOrder = Literal["prefill-first", "decode-first"]
Admission = Literal["reserve", "watermark"]
Preemption = Literal["recompute", "swap"]
AttentionBackend = Literal["torch", "kernels"]
PrefixHashAlgo = Literal["blake2b", "sha256_cbor"]

# Default KV budget when neither kv_budget_bytes nor kv_budget_tokens is given:
# four sequences of 8k tokens, ~1.4 GiB for SmolLM2-135M in fp32.
DEFAULT_BUDGET_TOKENS = 32768
DEFAULT_MAX_MODEL_LEN = 8192


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class EngineConfig:
    """How the engine manages its KV cache and batches requests.

    Attributes:
        cache: KV-cache variant: "naive" (one contiguous max_model_len buffer per sequence)
            or "paged" (fixed-size blocks found through a block table).
        block_size: token slots per block of the paged cache.
        prefix_caching: None, "hash" (chained hashes of full blocks, as vLLM) or "radix"
            (a radix tree over token ids, token-granular matching, as SGLang); paged only.
        prefix_caching_hash_algo: how the hash index keys a block: "blake2b" (kvlab's own
            chained keys) or "sha256_cbor" (vLLM's `--prefix-caching-hash-algo
            sha256_cbor`: the same block hashes as vLLM for the same token ids, block size
            and salt, so a router or another engine can read kvlab's KV events).
        prefix_caching_hash_seed: the seed of the first block's parent hash (vLLM's
            NONE_HASH seed: its PYTHONHASHSEED, else "vllm-none-hash", which None means
            for sha256_cbor); engines whose seeds differ share no block hash.
        max_model_len: longest sequence (prompt + output) in tokens; defaults to the
            model's max_position_embeddings, capped at 8192.
        kv_budget_bytes: KV memory budget in bytes (at most one of the two budget fields).
        kv_budget_tokens: KV memory budget in token slots of the model's KV at the cache's
            dtype; defaults to 32768 when neither budget is given.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: token budget of one step (prompt chunks + decodes). Without
            chunked prefill a longer single prompt still runs alone.
        chunked_prefill: split long prompts across steps, so running decodes keep
            flowing; a step may then mix decodes and prompt chunks.
        schedule_order: "prefill-first" (waiting prompts get the step's token budget
            first) or "decode-first" (running decodes first, prompts get what is left).
        admission: "watermark" (admit while the free blocks left after the first step's
            tokens, the prompt or its first chunk, stay above `watermark` of the pool;
            take blocks as tokens arrive and preempt when they run out: as vLLM V1 does)
            or "reserve" (admit only if the request's worst case fits beside what running
            ones may still claim: fewer at once, never preempts). None (the default): the
            cache's own default, its first in `admissions`: "watermark" for the paged
            cache, "reserve" for the naive one (its only choice).
        watermark: fraction of the pool kept free at admission (watermark admission),
            waived while nothing runs; 0, the default, admits as soon as the first step's
            blocks are free (vLLM's `--watermark` defaults to 0 as well; V0 kept 0.01).
        preemption: how a victim gives up its blocks when they run out: "recompute"
            (drop them; its prompt + generated tokens are prefilled again on resume) or
            "swap" (copy them to host memory and back on resume; a cache that cannot
            swap, the naive one, recomputes). The victim is the running request of
            lowest priority, then the most recently admitted.
        batching: "continuous" (a waiting request joins as soon as memory frees) or
            "static" (a new batch starts only when the whole previous batch is done).
        attention: "torch" (the plain-torch reference path) or "kernels" (attention through
            kvlab.kernels: Triton's paged decode kernel on CUDA, the native C kernels on the
            CPU; a bf16 model on the CPU also runs its norms, residual adds, RoPE and SwiGLU
            through kvlab.kernels.cpu_fused).
        batch_invariant: every request's logits, bit for bit, whatever shares its steps
            (batch size, chunking, prefix-cache hits, thread count), at some speed
            (kvlab.model.invariant); CPU only, tensor_parallel_size=1, retention="full".
        poison_freed: debug mode: fill freed KV slots with NaN, so a read of another
            sequence's stale state would show up as NaN output.
        record_block_map: keep, for every step, which request owns each physical block
            (for block-map plots; costs one list of num_blocks ints per step).
        retention: which KV blocks a long sequence keeps (kvlab.cache.retention): "full"
            (all, the default), "window", "sinks" (StreamingLLM) or "h2o" (heavy hitters).
            Anything but "full" needs cache="paged", preemption="recompute" and
            attention="torch".
        retention_window: recent tokens every non-full policy keeps.
        retention_sinks: first tokens "sinks" keeps (rounded up to whole blocks).
        retention_heavy: tokens (whole blocks) "h2o" keeps for their attention so far.
        attention_pattern: which layers attend to a sliding window (kvlab.model.pattern):
            None (the default) runs the model's own (its config's layer_types and
            sliding_window; every layer full for Llama), "full" makes every layer full,
            and e.g. "window=64*5,full" repeats 5 layers of a 64-token window and one
            full layer over the model (Gemma 3's 5 local : 1 global). A window needs
            tensor_parallel_size=1, retention="full" and batch_invariant=False. The paged
            cache keeps every block for a window's layers; cache="hybrid" gives them KV
            cache groups that free what left the window (kvlab.cache.hybrid).
        prefix_cache_retention_interval: which blocks a hybrid cache's sliding group keeps
            cached once they leave its window: None (the default) every one it indexed;
            N tokens (a multiple of block_size) only those a hit at a multiple of N
            tokens reads, the rest go back to the free list (vLLM's
            --prefix-cache-retention-interval, PR #43447).
        kv_codec: how K/V are stored: None (the model's dtype), "fp16", "bf16", "int8",
            "fp8_e4m3", "fp8_e5m2", "int4" or "kivi2" (see kvlab.cache.codecs). Scales
            count in the bytes per token, so kv_budget_bytes buys more slots when smaller.
        speculative: speculative decoding, a kvlab.speculative.SpeculativeConfig (or a dict of
            its fields, as vLLM's speculative_config): e.g. {"method": "ngram",
            "num_speculative_tokens": 4}. None decodes one token per step.
        tensor_parallel_size: run the model as this many processes on this machine
            (kvlab.parallel: each holds its share of the heads, MLP and KV heads; gloo
            all-reduces). It must divide the model's attention heads.
        tiers: a kvlab.cache.tiers.TierConfig: host / disk tiers that keep evicted cached
            blocks and load them back on a later prefix hit (paged + prefix_caching="hash").
        session_ttl_s: seconds a session (add_request(session=...)) may stay idle before
            its blocks are freed on every tier, as by engine.end_session; None: never.
    """

    cache: str = "naive"  # a name in kvlab.cache.CACHES
    block_size: int = 16
    prefix_caching: str | None = None
    prefix_caching_hash_algo: PrefixHashAlgo = "blake2b"
    prefix_caching_hash_seed: str | None = None
    max_model_len: int | None = None
    kv_budget_bytes: int | None = None
    kv_budget_tokens: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    chunked_prefill: bool = False
    schedule_order: ScheduleOrder = "prefill-first"
    admission: Admission | None = None  # None: the cache's default (paged: watermark)
    watermark: float = 0.0
    preemption: Preemption = "recompute"
    batching: Batching = "continuous"
    attention: AttentionBackend = "torch"
    batch_invariant: bool = False  # reductions in an order fixed per row (CPU)
    poison_freed: bool = False
    record_block_map: bool = False
    kv_codec: str | None = None
    speculative: SpeculativeConfig | dict | None = None  # a dict becomes a SpeculativeConfig
    tensor_parallel_size: int = 1
    tiers: TierConfig | None = None  # the KV hierarchy below the device pool
    session_ttl_s: float | None = None
    retention: str = "full"  # a name in kvlab.cache.retention.RETENTION
    retention_window: int = 256
    retention_sinks: int = 4
    retention_heavy: int = 256
    attention_pattern: str | None = None  # None: the model's own (kvlab.model.pattern)
    prefix_cache_retention_interval: int | None = None  # hybrid: None keeps every window block

    def __post_init__(self) -> None:
        self.speculative = SpeculativeConfig.coerce(self.speculative)
        for name, choices in (
            ("batching", Batching),
            ("schedule_order", ScheduleOrder),
            ("preemption", Preemption),
            ("attention", AttentionBackend),
            ("prefix_caching_hash_algo", PrefixHashAlgo),
        ):
            value = getattr(self, name)
            _require(
                value in get_args(choices),
                f"EngineConfig.{name}={value!r} is unknown; choose one of {get_args(choices)}",
            )
        _require(
            self.admission is None or self.admission in get_args(Admission),
            f"EngineConfig.admission={self.admission!r} is unknown; choose one of "
            f"{get_args(Admission)} or None (the cache's default)",
        )
        _require(
            self.kv_budget_bytes is None or self.kv_budget_tokens is None,
            "EngineConfig: give kv_budget_bytes or kv_budget_tokens, not both",
        )
        for name in ("max_model_len", "kv_budget_bytes", "kv_budget_tokens"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"EngineConfig.{name}={value} must be > 0")
        _require(
            0 <= self.watermark < 1, f"EngineConfig.watermark={self.watermark} must be in [0, 1)"
        )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            _require(value > 0, f"EngineConfig.{name}={value} must be > 0")
        if (self.prefix_caching_hash_algo, self.prefix_caching_hash_seed) != ("blake2b", None):
            _require(
                self.prefix_caching == "hash",
                f"EngineConfig.prefix_caching_hash_algo={self.prefix_caching_hash_algo!r} and "
                f"prefix_caching_hash_seed={self.prefix_caching_hash_seed!r} need "
                f"prefix_caching='hash'; got {self.prefix_caching!r}",
            )
        self._check_tensor_parallel()
        self._check_retention()
        interval = self.prefix_cache_retention_interval
        if interval is not None:
            _require(
                self.cache == "hybrid" and interval > 0 and interval % self.block_size == 0,
                f"EngineConfig.prefix_cache_retention_interval={interval} needs cache='hybrid' "
                f"and a positive multiple of block_size={self.block_size}",
            )
        self._check_tiers()
        if self.batch_invariant:
            for name, wanted in (("tensor_parallel_size", 1), ("retention", "full")):
                value = getattr(self, name)
                _require(
                    value == wanted,
                    f"EngineConfig.batch_invariant=True needs {name}={wanted!r}; got {value!r}",
                )

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        _require(tp >= 1, f"EngineConfig.tensor_parallel_size={tp} must be >= 1")
        if tp > 1:
            _require(
                self.attention == "torch",
                f"EngineConfig.attention={self.attention!r} needs tensor_parallel_size=1",
            )
            _require(
                self.speculative is None or self.speculative.method != "layers",
                "EngineConfig.speculative method 'layers' (a draft made of the runner's "
                "layers) needs tensor_parallel_size=1",
            )

    def _check_retention(self) -> None:
        """Retention (kvlab.cache.retention): its sizes, and what it combines with."""
        for name, low in (("retention_window", 1), ("retention_sinks", 0), ("retention_heavy", 0)):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and value >= low,
                f"EngineConfig.{name}={value!r} must be an int >= {low}",
            )
        if self.retention == "full":
            return
        for name, off in (("speculative", None), ("tensor_parallel_size", 1), ("tiers", None)):
            _require(
                getattr(self, name) == off,
                f"EngineConfig.retention={self.retention!r} needs {name}={off!r}: drafts, "
                "shards and tiers are not combined with dropped blocks yet",
            )
        needs = {"cache": "paged", "preemption": "recompute", "attention": "torch"}
        for name, wanted in needs.items():
            _require(
                getattr(self, name) == wanted,
                f"EngineConfig.retention={self.retention!r} needs {name}={wanted!r} "
                f"(got {getattr(self, name)!r}): dropped blocks live only in paged block "
                "tables, swap copies whole sequences and the kernels read whole tables",
            )

    def _check_tiers(self) -> None:
        """KV tiers and sessions (kvlab.cache.tiers, kvlab.engine.sessions)."""
        if self.tiers is not None:
            _require(
                self.cache == "paged" and self.prefix_caching == "hash",
                f"EngineConfig.tiers needs cache='paged' and prefix_caching='hash' (a tier's "
                f"keys are the hash index's chained keys); got cache={self.cache!r}, "
                f"prefix_caching={self.prefix_caching!r}",
            )
            _require(
                self.tensor_parallel_size == 1,
                "EngineConfig.tiers needs tensor_parallel_size=1 (a tier stores one pool's "
                "blocks; sharded pools are not tiered yet)",
            )
        ttl = self.session_ttl_s
        _require(ttl is None or ttl > 0, f"EngineConfig.session_ttl_s={ttl} must be > 0 or None")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts up to `num_speculative_tokens` tokens per
    decoding sequence, and the model verifies them all in the step's one forward.

    Attributes:
        method: a proposer in kvlab.speculative.PROPOSERS: "ngram" (prompt lookup: the
            tokens that followed an earlier occurrence of the sequence's last n tokens)
            or "layers" (self-speculation: the model's first `draft_layers` layers, then
            its final norm and LM head, draft autoregressively).
        num_speculative_tokens: k, the most tokens drafted per sequence per step.
        prompt_lookup_min: shortest n-gram "ngram" matches.
        prompt_lookup_max: longest n-gram "ngram" tries first.
        draft_layers: layers of the "layers" draft (default: a quarter of the model's).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_layers: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.num_speculative_tokens >= 1,
            f"SpeculativeConfig.num_speculative_tokens={self.num_speculative_tokens} must be >= 1",
        )
        _require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            f"SpeculativeConfig: need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) "
            f"<= prompt_lookup_max ({self.prompt_lookup_max})",
        )
        _require(
            self.draft_layers is None or self.draft_layers >= 1,
            f"SpeculativeConfig.draft_layers={self.draft_layers} must be >= 1",
        )

    @classmethod
    def coerce(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """A SpeculativeConfig from itself, a dict of its fields (vLLM's
        `speculative_config` style), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            _require(
                not unknown,
                f"EngineConfig.speculative: unknown field(s) {sorted(unknown)}; the fields "
                f"are {list(cls.__dataclass_fields__)}",
            )
            return cls(**value)
        raise ValueError(
            f"EngineConfig.speculative={value!r} must be a SpeculativeConfig, a dict or None"
        )


@dataclass
class SamplingParams:
    """How one request picks its tokens.

    `n` samples that many continuations of one prompt; they share the prompt's KV blocks
    (copy-on-write, paged cache only). temperature 0 means greedy. top_k 0 and top_p 1.0
    disable those filters. `seed` makes sampling reproducible per request (sample i of
    n > 1 uses seed + i). `ignore_eos` keeps generating to max_new_tokens
    (for benchmarks).
    """

    max_new_tokens: int = 64
    n: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _require(
            self.max_new_tokens > 0,
            f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1",
        )
        _require(self.n >= 1, f"SamplingParams.n={self.n} must be >= 1")
        _require(
            self.temperature >= 0, f"SamplingParams.temperature={self.temperature} must be >= 0"
        )
        _require(self.top_k >= 0, f"SamplingParams.top_k={self.top_k} must be >= 0")
        _require(0 < self.top_p <= 1, f"SamplingParams.top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
