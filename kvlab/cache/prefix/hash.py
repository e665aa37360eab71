"""The hash prefix index (vLLM): each *full* block gets a key chaining its parent block's
key, its own token ids and the request's salt. A lookup walks the chain from the first
block and stops at the first miss. Only full blocks are shared."""

from __future__ import annotations

import hashlib

import numpy as np

from kvlab.cache.prefix.base import PrefixIndex, PrefixMatch
from kvlab.cache.prefix.registry import PREFIX_INDEXES


@PREFIX_INDEXES.register("hash")
class HashPrefixIndex(PrefixIndex):
    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.block_of: dict[bytes, int] = {}  # chained key -> block
        self.key_of: dict[int, bytes] = {}  # block -> chained key

    def keys(self, tokens: list[int], salt: str | None) -> list[bytes]:
        """Chained keys of the full blocks of `tokens`: key_i = H(key_{i-1}, block_i, salt)."""
        keys, parent = [], b""
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            chunk = np.asarray(tokens[start : start + self.block_size], dtype=np.int64)
            digest = hashlib.blake2b(parent, digest_size=16)
            digest.update(chunk.tobytes())
            digest.update(b"" if salt is None else b"salt:" + salt.encode())
            parent = digest.digest()
            keys.append(parent)
        return keys

    def match(self, tokens: list[int], salt: str | None) -> PrefixMatch:
        blocks = []
        for key in self.keys(tokens, salt):
            if key not in self.block_of:
                break
            blocks.append(self.block_of[key])
        return PrefixMatch(blocks)

    def insert(self, tokens, blocks, salt, partial=False) -> None:
        for key, block in zip(self.keys(tokens, salt), blocks):
            if key not in self.block_of and block not in self.key_of:
                self.block_of[key], self.key_of[block] = block, key

    def remove(self, block: int) -> list[int]:
        del self.block_of[self.key_of.pop(block)]
        return []  # descendants stay indexed but unreachable; LRU evicts them in time

    def __contains__(self, block: int) -> bool:
        return block in self.key_of
