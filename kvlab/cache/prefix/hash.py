"""The hash prefix index (vLLM): each *full* block gets a key chaining its parent block's
key, its own token ids and the request's salt. A lookup walks the chain from the first
block and stops at the first miss. Only full blocks are shared.

Two ways to compute a key (`EngineConfig.prefix_caching_hash_algo`):

- "blake2b", kvlab's own: blake2b-128 of (parent key, the block's token ids as int64
  bytes, the salt), the salt in every block;
- "sha256_cbor", vLLM's (`vllm/v1/core/kv_cache_utils.py: hash_block_tokens` with
  `vllm/utils/hashing.py: sha256_cbor`): SHA-256 of the canonical CBOR encoding of the
  tuple (parent hash, token ids, extra keys), where the first block's parent is
  NONE_HASH = sha256_cbor(seed) and its extra keys hold the salt as vLLM's cache_salt,
  `(("cache_salt", salt),)`; later blocks carry None (the chain carries the salt). The
  same token ids, block size and salt give the same 32-byte hashes as vLLM, so a router
  can compute a request's block hashes itself and look them up in the engines' KV events.

With an event sink (kvlab.cache.events), the index reports what it stores and removes, as
vLLM's block pool does: one `BlockStored` per run of newly indexed blocks, one
`BlockRemoved` per evicted block, `AllBlocksCleared` when it is cleared.
"""

from __future__ import annotations

import hashlib

import numpy as np

from kvlab.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventSink
from kvlab.cache.prefix.base import PrefixIndex, PrefixMatch
from kvlab.cache.prefix.registry import PREFIX_INDEXES
from kvlab.cache.retention.base import DROPPED

HASH_ALGOS = ("blake2b", "sha256_cbor")
VLLM_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's seed when PYTHONHASHSEED is unset


def sha256_cbor(value) -> bytes:
    """vLLM's `sha256_cbor`: SHA-256 of the canonical CBOR encoding of `value` (tuples and
    lists are CBOR arrays, bytes byte strings, str text strings, None null)."""
    import cbor2

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def salt_extra_keys(salt: str | None) -> tuple | None:
    """The extra keys vLLM hashes into a request's first block for its cache_salt."""
    return (("cache_salt", salt),) if salt else None


def block_hashes(
    tokens: list[int],
    block_size: int,
    salt: str | None = None,
    algo: str = "sha256_cbor",
    seed: str | None = None,
) -> list[bytes]:
    """Chained hashes of the full blocks of `tokens` (the partial tail is not hashed).

    sha256_cbor: vLLM's block hashes for these token ids, block size, cache_salt and
    NONE_HASH seed (None: "vllm-none-hash", vLLM's own when PYTHONHASHSEED is unset).
    blake2b: kvlab's own keys (seed None: no seed, the chain starts from b"")."""
    if algo not in HASH_ALGOS:
        raise ValueError(
            f"prefix_caching_hash_algo={algo!r} is unknown; choose one of {HASH_ALGOS}"
        )
    keys: list[bytes] = []
    if algo == "sha256_cbor":
        parent = sha256_cbor(VLLM_NONE_HASH_SEED if seed is None else seed)
        for start in range(0, len(tokens) - block_size + 1, block_size):
            chunk = tuple(int(t) for t in tokens[start : start + block_size])
            extra = salt_extra_keys(salt) if start == 0 else None
            parent = sha256_cbor((parent, chunk, extra))
            keys.append(parent)
        return keys
    parent = b"" if seed is None else hashlib.blake2b(seed.encode(), digest_size=16).digest()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = np.asarray(tokens[start : start + block_size], dtype=np.int64)
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(chunk.tobytes())
        digest.update(b"" if salt is None else b"salt:" + salt.encode())
        parent = digest.digest()
        keys.append(parent)
    return keys


@PREFIX_INDEXES.register("hash")
class HashPrefixIndex(PrefixIndex):
    emits_events = True

    def __init__(
        self,
        block_size: int,
        algo: str = "blake2b",
        seed: str | None = None,
        events: EventSink | None = None,
    ):
        super().__init__(block_size)
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo={algo!r} is unknown; choose {HASH_ALGOS}")
        self.algo, self.seed = algo, seed
        self.events = events  # told what is stored and removed (None: nobody listens)
        self.block_of: dict[bytes, int] = {}  # chained key -> block
        self.key_of: dict[int, bytes] = {}  # block -> chained key

    @classmethod
    def from_config(cls, config, events: EventSink | None = None) -> HashPrefixIndex:
        return cls(
            config.block_size,
            config.prefix_caching_hash_algo,
            config.prefix_caching_hash_seed,
            events,
        )

    def keys(self, tokens: list[int], salt: str | None) -> list[bytes]:
        """Chained keys of the full blocks of `tokens`: key_i = H(key_{i-1}, block_i, salt)."""
        return block_hashes(tokens, self.block_size, salt, self.algo, self.seed)

    def match(self, tokens: list[int], salt: str | None) -> PrefixMatch:
        blocks = []
        for key in self.keys(tokens, salt):
            if key not in self.block_of:
                break
            blocks.append(self.block_of[key])
        return PrefixMatch(blocks)

    def insert(self, tokens, blocks, salt, partial=False) -> None:
        keys = self.keys(tokens, salt)
        new = []  # positions of the blocks indexed now
        for i, (key, block) in enumerate(zip(keys, blocks)):
            if block == DROPPED:  # a sliding-window group's block that left its window
                continue
            if key not in self.block_of and block not in self.key_of:
                self.block_of[key], self.key_of[block] = block, key
                new.append(i)
        if self.events is not None and new:
            self._stored(tokens, keys, new, salt)

    def _stored(self, tokens, keys: list[bytes], new: list[int], salt: str | None) -> None:
        """One BlockStored per run of consecutive new blocks, as vLLM's
        `cache_full_blocks` reports the blocks one call makes full."""
        runs, bs = [[new[0]]], self.block_size
        for i in new[1:]:
            if i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self.events(
                BlockStored(
                    block_hashes=[keys[i] for i in run],
                    parent_block_hash=keys[first - 1] if first else None,
                    token_ids=[int(t) for t in tokens[first * bs : (last + 1) * bs]],
                    block_size=bs,
                    extra_keys=[self._event_extra_keys(i, salt) for i in run],
                )
            )

    def _event_extra_keys(self, i: int, salt: str | None) -> tuple | None:
        """What block i hashes besides its tokens, untagged as vLLM's events carry it."""
        if salt is None or (self.algo == "sha256_cbor" and i > 0):
            return None
        return (salt,)

    def remove(self, block: int) -> list[int]:
        key = self.key_of.pop(block)
        del self.block_of[key]
        if self.events is not None:
            self.events(BlockRemoved(block_hashes=[key]))
        return []  # descendants stay indexed but unreachable; LRU evicts them in time

    def clear(self) -> None:
        """Forget every block at once (vLLM's reset_prefix_cache)."""
        self.block_of.clear()
        self.key_of.clear()
        if self.events is not None:
            self.events(AllBlocksCleared())

    def __contains__(self, block: int) -> bool:
        return block in self.key_of
