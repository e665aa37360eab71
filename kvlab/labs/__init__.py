"""Classroom labs: learners implement an engine part; a grader checks it like the library's own.

Each grader takes the learner's code, runs seeded property checks and reference comparisons
(the same kinds of checks the library's parts pass in tests/), prints a short report and
returns a `LabResult`. On a failure the report names the broken invariant, shows the
smallest failing input found (as code to paste and run) and what was expected.

    from kvlab.labs import check_block_allocator
    result = check_block_allocator(MyAllocator)   # prints "... all 5 checks passed."

The references are kvlab's own parts, through their public interfaces: one layer's K/V in a
`KVPool` read by `pooled_attention` (`KvlabKVCache`; the lab-0 grader also runs the real
model through the learner's cache, `run_model_with_cache`), `BlockAllocator`,
`HashPrefixIndex.keys` (`kvlab_block_keys`), the `Int8` codec (`kvlab_quantize`,
`kvlab_dequantize`), `kvlab.engine.scheduler.choose_victim` (`kvlab_victim`), the
speculative rollback `KVCache.rewind` with `BlockAllocator.decref` (`kvlab_rollback`) and
the retention policies "window" and "sinks" (`kvlab_release`) and the host tier
`HostTier` (`KvlabHostTier`), kvlab's router index `kvlab.route.index.BlockIndex`
(`KvlabScorer`), the hybrid cache's `kvlab.cache.groups.cross_group_hit`
(`kvlab_cross_group_hit`); the /metrics lab reads pages kvlab's server metrics render
(`kvlab_parse`: prometheus_client's parser, `kvlab_hit_rate`, `kvlab_preemptions`). The
cross-group hit's last check serves the real model in kvlab's engine with `cache="hybrid"`
and compares the learner's hit with the engine's (`kvlab.labs.hybrid_hit.engine_probes`). The
capstone (`check_capstone`) plugs the parts of labs 1, 2 and 4 into kvlab's engine
(`kvlab.labs.capstone.plug_in`) and serves the real model: its reference is the same engine
with kvlab's own parts, whose greedy tokens it checks against HF transformers. The labs
are notebooks/labs/source/<lab>/<lab>.ipynb (nbgrader sources, solved); the learners'
notebooks/labs/<lab>.ipynb are generated from them by `python -m kvlab.labs.student`.
"""

from kvlab.labs.allocator import check_block_allocator
from kvlab.labs.capstone import check_capstone
from kvlab.labs.grading import Failure, LabFailure, LabResult
from kvlab.labs.hashing import check_block_hash, kvlab_block_keys
from kvlab.labs.hybrid_hit import check_cross_group_hit, groups_of, kvlab_cross_group_hit
from kvlab.labs.int8 import check_int8_codec, kvlab_dequantize, kvlab_quantize
from kvlab.labs.kv_cache import (
    KvlabKVCache,
    check_kv_cache,
    generate_with_cache,
    generate_without_cache,
    kv_inputs,
    run_model_with_cache,
)
from kvlab.labs.metrics import check_metrics_reading, kvlab_hit_rate, kvlab_parse, kvlab_preemptions
from kvlab.labs.metrics_pages import example_pages
from kvlab.labs.rollback import Rollback, check_spec_rollback, kvlab_rollback
from kvlab.labs.scorer import KvlabScorer, check_precise_scorer
from kvlab.labs.tier import KvlabHostTier, check_tier_lru
from kvlab.labs.victim import check_victim_choice, kvlab_victim, running_seq
from kvlab.labs.window import check_window_release, kvlab_release

__all__ = [
    "Failure",
    "LabFailure",
    "KvlabHostTier",
    "KvlabKVCache",
    "KvlabScorer",
    "LabResult",
    "Rollback",
    "check_block_allocator",
    "check_block_hash",
    "check_capstone",
    "check_cross_group_hit",
    "check_int8_codec",
    "check_kv_cache",
    "check_metrics_reading",
    "check_precise_scorer",
    "check_spec_rollback",
    "check_tier_lru",
    "check_victim_choice",
    "check_window_release",
    "kvlab_block_keys",
    "kvlab_cross_group_hit",
    "example_pages",
    "generate_with_cache",
    "generate_without_cache",
    "groups_of",
    "kv_inputs",
    "kvlab_dequantize",
    "kvlab_hit_rate",
    "kvlab_parse",
    "kvlab_preemptions",
    "kvlab_quantize",
    "kvlab_release",
    "kvlab_rollback",
    "kvlab_victim",
    "run_model_with_cache",
    "running_seq",
]
