"""The interface every KV-cache variant implements, and the memory accounting they share.

Every variant hands each sequence a *block table*: a list of physical block ids, each
block holding `block_size` consecutive token slots of the shared KVPool. Token position p
of a sequence lives in slot `table[p // block_size] * block_size + p % block_size`.
The naive cache is the special case of one block of `max_model_len` slots per sequence.

A variant is a class registered in `kvlab.cache.CACHES`. `KVCache` is what the scheduler
and engine need of every one (admission, growth, release, accounting). What only some can
do is a capability, a class attribute the engine checks before calling the methods it
guards:

    shares_prefixes   `publish(seq)`: the prompt is in the cache; reuse it (prefix caching)
    forks             `fork(parent, child)`: n > 1 samples share the prompt's blocks
    swaps             `swap_out`, `allocate_computed`, `swap_in`: swap preemption
    admissions        the EngineConfig.admission policies it implements, its default first
    emits_events      `from_config(..., events=sink)`: its prefix index reports what it
                      stores and removes (kvlab.cache.events, vLLM's KV events)

and the parts a variant may hold, None where it has none: `index` (its prefix index, whose
`keys` a session uses to forget its prefixes), `retention` (the policy that drops tokens;
H2O scores what attention reads), `connector` (the tiers below the device) and `groups`
(the KV cache groups of a hybrid model, each with a table per sequence: `group_tables`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvlab.cache.pool import KVPool
from kvlab.cache.spec import KVSpec
from kvlab.sequence import Sequence

if TYPE_CHECKING:
    from kvlab.cache.connector import KVConnector
    from kvlab.cache.groups import KVCacheGroup
    from kvlab.cache.prefix.base import PrefixIndex
    from kvlab.cache.retention.base import RetentionPolicy
    from kvlab.config import EngineConfig


@dataclass(frozen=True)
class MemoryStats:
    """KV memory as every variant reports it, so side-by-side plots are fair."""

    budget_bytes: int  # the whole pool
    reserved_bytes: int  # slots set aside for running sequences
    live_bytes: int  # slots that hold a token's K/V right now

    @property
    def waste_bytes(self) -> int:
        return self.reserved_bytes - self.live_bytes

    @property
    def waste_frac(self) -> float:
        return self.waste_bytes / self.reserved_bytes if self.reserved_bytes else 0.0


class KVCache(ABC):
    """Decides which slots of the pool belong to which sequence."""

    name: ClassVar[str]  # set by CACHES.register
    shares_prefixes: ClassVar[bool] = False
    forks: ClassVar[bool] = False
    swaps: ClassVar[bool] = False
    emits_events: ClassVar[bool] = False
    admissions: ClassVar[tuple[str, ...]] = ("reserve",)
    index: PrefixIndex | None = None
    retention: RetentionPolicy | None = None
    connector: KVConnector | None = None
    groups: list[KVCacheGroup] | None = None  # KV cache groups (hybrid); None: one table

    def __init__(self, pool: KVPool, block_size: int, max_model_len: int, poison_freed: bool):
        if pool.num_slots % block_size:
            raise ValueError(f"pool of {pool.num_slots} slots is not a multiple of {block_size=}")
        self.pool = pool
        self.block_size = block_size
        self.num_blocks = pool.num_slots // block_size
        self.max_model_len = max_model_len
        self.poison_freed = poison_freed
        self.sequences: dict[int, Sequence] = {}  # admitted, by request id

    # --- construction ----------------------------------------------------------------
    @classmethod
    def admission_of(cls, config: EngineConfig) -> str:
        """The admission policy in force: `config.admission`, or when None this cache's
        default (the first of its `admissions`)."""
        return config.admission or cls.admissions[0]

    @classmethod
    @abstractmethod
    def slot_unit(cls, config: EngineConfig, max_model_len: int) -> tuple[str, int]:
        """(EngineConfig field, slots): the pool is carved in runs of that many slots."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: EngineConfig, pool: KVPool, max_model_len: int) -> KVCache:
        """The cache over `pool` that `config` describes."""

    # --- what each variant decides -------------------------------------------------
    @abstractmethod
    def check_fits(self, seq: Sequence) -> None:
        """Raise ValueError if `seq` could never be served within this cache's budget."""

    @abstractmethod
    def _plan(self, seq: Sequence, alone: bool, chunk: int | None) -> object | None:
        """How `seq` is admitted now (the variant's plan, for `_allocate`), or None when it
        cannot be without endangering running sequences.

        `alone`: no sequence is running (headroom kept for running ones is not needed).
        `chunk`: the most tokens `seq` computes in its first step (None: all it has); a
        cache that takes blocks as tokens arrive needs room for those only."""

    def stage(self, seq: Sequence) -> None:  # noqa: B027  (only tiered caches stage)
        """Bring what `seq` may reuse onto the device before admission is decided (a tiered
        cache loads its held prefix blocks back). Never takes memory running sequences hold."""

    @abstractmethod
    def _allocate(self, seq: Sequence, plan: object, chunk: int | None) -> None:
        """Take what `_plan` planned for `seq`: what this variant reserves at admission."""

    @abstractmethod
    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> None:
        """Make positions [0, num_tokens) of `seq` writable."""

    def retain(self, seq: Sequence) -> None:
        """After a step of `seq`: drop what its retention policy no longer keeps (paged;
        kvlab.cache.retention). Variants without retention keep everything."""
        return None

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` must take to hold `num_tokens` tokens (0: it has room)."""
        return 0

    @abstractmethod
    def _release(self, seq: Sequence) -> list[int]:
        """Give back the sequence's blocks; return those that became free."""

    @abstractmethod
    def block_table(self, seq: Sequence) -> list[int]:
        """Physical block ids holding the sequence's tokens, in logical order."""

    def group_tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's block table in each KV cache group (one group but in hybrid)."""
        return [self.block_table(seq)]

    def group_blocks(self) -> list[int]:
        """Blocks each KV cache group's tables reference now (one group but in hybrid)."""
        return [self.num_blocks - self.num_available]

    @abstractmethod
    def reserved_slots(self) -> int:
        """Token slots set aside for admitted sequences."""

    @property
    @abstractmethod
    def num_available(self) -> int:
        """Blocks an allocation can take now (free ones, and evictable cached ones)."""

    @abstractmethod
    def block_owners(self) -> list[int]:
        """For each physical block, the request id holding it, or -1 (for block maps)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise IntegrityError naming the broken invariant, if any."""

    # --- shared behaviour ----------------------------------------------------------
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int | None = None, alone: bool = False
    ) -> list[int] | None:
        """The blocks for `seq`'s next `num_new_tokens` tokens (None: all it has pending)
        -> its block table; or None, and nothing changed.

        vLLM's KVCacheManager.allocate_slots, for a new request and a running one alike:
        deciding and taking are one call, so nothing can change between them.
        - A new request is admitted with its prefix hit (a tiered cache loads what a tier
          holds of the prompt first, as cached blocks, and the decision counts them);
          `alone`: no sequence is running (the headroom kept for running ones is not
          needed).
        - A running request grows by the blocks its next tokens need; None when fewer are
          available (the scheduler then preempts and asks again); its next tokens include
          any speculative drafts it verifies this step."""
        if seq.request_id in self.sequences:  # running: grow (drafts included)
            end = seq.num_computed + (seq.num_pending if num_new_tokens is None else num_new_tokens)
            if self.blocks_needed(seq, end) > self.num_available:
                return None
        else:  # new: admit
            self.stage(seq)
            plan = self._plan(seq, alone, num_new_tokens)
            if plan is None:
                return None
            self._allocate(seq, plan, num_new_tokens)
            self.sequences[seq.request_id] = seq
            n = seq.num_pending  # after the prefix hit, which counts as computed
            end = seq.num_computed + (n if num_new_tokens is None else min(num_new_tokens, n))
        self.ensure_capacity(seq, end)
        return self.block_table(seq)

    def free(self, seq: Sequence) -> None:
        """Release everything `seq` holds (idempotent for sequences never admitted)."""
        if self.sequences.pop(seq.request_id, None) is None:
            return
        freed = self._release(seq)
        if self.poison_freed and freed:
            self.pool.poison(self.block_slots(freed))

    def rewind(self, seq: Sequence, num_computed: int) -> int:
        """Forget positions [num_computed, seq.num_computed) of `seq` (rejected speculative
        drafts): the codec rolls back their state and the blocks past the kept tokens
        return to the free list. Returns how many blocks were returned."""
        if not 0 <= num_computed <= seq.num_computed:
            raise ValueError(f"cannot rewind request {seq.request_id} to {num_computed} tokens")
        if num_computed < seq.num_computed:
            self.pool.discard(self.position_slots(seq, num_computed, seq.num_computed))
            seq.num_computed = num_computed
        freed = self._trim(seq)
        if self.poison_freed and freed:
            self.pool.poison(self.block_slots(freed))
        return len(freed)

    def _trim(self, seq: Sequence) -> list[int]:
        """Give back the blocks past `seq.num_computed`; return them (those now free)."""
        return []

    def position_slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Pool slots of positions [start, end) of `seq`, (end - start,) int64."""
        table = torch.tensor(self.block_table(seq), dtype=torch.long)
        positions = torch.arange(start, end)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        return slots.to(self.pool.device)

    def forget_prefixes(self, prefixes: list[tuple], keep: set[bytes]) -> dict[str, int]:
        """Free what holds the given (tokens, salt) prefixes for reuse (a session ended):
        cached blocks and tier copies, but the chained keys in `keep`. A cache without
        prefix sharing holds nothing after its requests finish."""
        return {"device": 0}

    def drop_swapped(self, seq: Sequence) -> None:  # noqa: B027  (only tiers keep swap room)
        """A swapped-out request's saved KV is gone (it swapped in, or ended swapped out)."""

    def block_slots(self, blocks: list[int]) -> torch.Tensor:
        """All slots of the given blocks, (len(blocks) * block_size,) int64."""
        ids = torch.tensor(blocks, dtype=torch.long, device=self.pool.device)
        offsets = torch.arange(self.block_size, device=self.pool.device)
        return (ids[:, None] * self.block_size + offsets).reshape(-1)

    def live_tokens(self) -> int:
        return sum(seq.num_computed for seq in self.sequences.values())

    def memory(self) -> MemoryStats:
        per_token = self.pool.bytes_per_token
        return MemoryStats(
            budget_bytes=self.pool.num_slots * per_token,
            reserved_bytes=self.reserved_slots() * per_token,
            live_bytes=self.live_tokens() * per_token,
        )

    @property
    def num_running(self) -> int:
        return len(self.sequences)


def make_pool(
    config: EngineConfig,
    cache: type[KVCache],
    spec: KVSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    model_spec: KVSpec | None = None,
) -> KVPool:
    """The pool the config's KV budget buys for `cache`: budget // (bytes per token, scales
    included) slots, in whole runs of the cache's unit (a block, or a naive region).

    `spec` is what one slot holds; `model_spec` the model's whole KV when a slot holds
    fewer layers (a hybrid cache's group): `kv_budget_tokens` counts tokens of the whole
    model, so every cache gets the same bytes."""
    from kvlab.cache.codecs import CODECS
    from kvlab.config import DEFAULT_BUDGET_TOKENS

    codec = CODECS[config.kv_codec]
    per_token = codec.token_bytes(spec, dtype)
    if config.kv_budget_bytes is not None:
        slots = config.kv_budget_bytes // per_token
    else:
        tokens = config.kv_budget_tokens or DEFAULT_BUDGET_TOKENS
        slots = tokens * codec.token_bytes(model_spec or spec, dtype) // per_token
    field, unit = cache.slot_unit(config, max_model_len)
    if unit % codec.alignment:
        raise ValueError(
            f"EngineConfig.{field}={unit} must be a multiple of {codec.alignment} for "
            f"kv_codec={config.kv_codec!r} (it quantizes keys in groups of that many tokens)"
        )
    slots -= slots % unit
    if slots == 0:
        raise ValueError(
            f"KV budget holds fewer token slots ({per_token} bytes each) than "
            f"{field}={unit}: too small for even one {cache.name} sequence"
        )
    return KVPool(spec, slots, dtype, device, config.kv_codec)
