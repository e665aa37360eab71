"""The config fields that name registered cache parts, checked against their registries.

`EngineConfig` checks itself without knowing the registries (kvlab.config is a leaf); an
engine's cache is built only after `check_config` has named any unknown part, and any part
that does not combine with the cache, in a ValueError.
"""

from __future__ import annotations

from kvlab.cache.codecs import CODECS
from kvlab.cache.prefix import PREFIX_INDEXES
from kvlab.cache.registry import CACHES
from kvlab.cache.retention import RETENTION
from kvlab.cache.tiers import TierConfig


def check_config(config) -> None:
    """Raise ValueError naming the field if `config` names an unknown cache, prefix index,
    KV codec or retention policy, or parts its cache cannot combine."""
    cache = CACHES[config.cache]  # each registry's error names the field and the choices
    if config.prefix_caching is not None:
        PREFIX_INDEXES[config.prefix_caching]
        if not cache.shares_prefixes:
            sharing = [repr(n) for n, part in CACHES.items() if part.shares_prefixes]
            raise ValueError(
                f"EngineConfig.prefix_caching={config.prefix_caching!r} needs cache="
                + " or ".join(sharing)
            )
    CODECS[config.kv_codec]
    RETENTION[config.retention]
    if cache.admission_of(config) not in cache.admissions:
        raise ValueError(
            f"EngineConfig.admission={config.admission!r} needs cache='paged' "
            f"(cache={config.cache!r} implements {cache.admissions})"
        )
    if config.cache == "hybrid":
        _check_hybrid(config)
    if config.tiers is not None and not isinstance(config.tiers, TierConfig):
        raise ValueError(
            f"EngineConfig.tiers={config.tiers!r} must be a kvlab.cache.tiers.TierConfig"
        )


def _check_hybrid(config) -> None:
    """What the hybrid cache (kvlab.cache.hybrid) combines with so far."""
    for name, wanted in (
        ("preemption", "recompute"), ("retention", "full"), ("tiers", None),
        ("speculative", None), ("tensor_parallel_size", 1), ("batch_invariant", False),
    ):  # fmt: skip
        value = getattr(config, name)
        if value != wanted:
            raise ValueError(f"EngineConfig.cache='hybrid' needs {name}={wanted!r}; got {value!r}")
    if config.prefix_caching not in (None, "hash"):
        raise ValueError(
            f"EngineConfig.cache='hybrid' needs prefix_caching='hash' or None (a sliding "
            f"group's hit is found by block hashes); got {config.prefix_caching!r}"
        )
