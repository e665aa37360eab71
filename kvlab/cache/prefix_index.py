"""Prefix indexes: which physical blocks already hold the K/V of a token prefix.

Two designs behind one interface, so notebooks can compare them on the same traffic:

- `HashPrefixIndex` (vLLM): each *full* block gets a key chaining its parent block's key,
  its own token ids and the request's salt. A lookup walks the chain from the first block
  and stops at the first miss. Only full blocks are shared.
- `RadixPrefixIndex` (SGLang): a tree over token ids, one node per block (page-aligned
  storage), with partial blocks as leaves. Matching is token-granular: after the full
  blocks it finds the child sharing the longest run of tokens, whose first k slots the
  cache copies into a fresh block instead of recomputing them.

A salt (tenant / cache namespace) is part of every key, so requests with different salts
never share a block.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PrefixMatch:
    blocks: list[int]  # full blocks whose tokens equal the prompt's first len(blocks) blocks
    partial_block: int | None = None  # a block whose first `partial_tokens` slots also match
    partial_tokens: int = 0


class PrefixIndex(ABC):
    def __init__(self, block_size: int):
        self.block_size = block_size

    @abstractmethod
    def match(self, tokens: list[int], salt: str | None) -> PrefixMatch:
        """The longest cached prefix of `tokens` under `salt`."""

    @abstractmethod
    def insert(
        self, tokens: list[int], blocks: list[int], salt: str | None, partial: bool = False
    ) -> None:
        """Index the blocks holding `tokens` (block i holds tokens[i*bs:(i+1)*bs]).

        Full blocks always; the last, partly filled block too if `partial` (radix only).
        A prefix already indexed under another block keeps its block.
        """

    @abstractmethod
    def remove(self, block: int) -> list[int]:
        """Forget an evicted block; return other blocks that became unreachable."""

    @abstractmethod
    def __contains__(self, block: int) -> bool: ...


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


@dataclass(eq=False)
class RadixNode:
    tokens: tuple[int, ...]  # block_size tokens, or fewer for a partial leaf
    block: int
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)


class RadixPrefixIndex(PrefixIndex):
    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.roots: dict[str | None, RadixNode] = {}  # one tree per salt
        self.node_of: dict[int, RadixNode] = {}  # block -> node

    def _root(self, salt: str | None) -> RadixNode:
        return self.roots.setdefault(salt, RadixNode((), -1, None))

    def match(self, tokens: list[int], salt: str | None) -> PrefixMatch:
        node, blocks, bs = self._root(salt), [], self.block_size
        while len(blocks) * bs + bs <= len(tokens):
            start = len(blocks) * bs
            child = node.children.get(tuple(tokens[start : start + bs]))
            if child is None:
                break
            blocks.append(child.block)
            node = child
        rest = tokens[len(blocks) * bs : len(blocks) * bs + bs]
        best, best_len = None, 0
        for child in node.children.values():  # token-granular: longest common run
            common = 0
            for a, b in zip(child.tokens, rest):
                if a != b:
                    break
                common += 1
            if common > best_len:
                best, best_len = child, common
        if best is None:
            return PrefixMatch(blocks)
        return PrefixMatch(blocks, best.block, best_len)

    def insert(self, tokens, blocks, salt, partial=False) -> None:
        node, bs = self._root(salt), self.block_size
        for i, block in enumerate(blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            if not chunk or (len(chunk) < bs and not partial):
                return
            child = node.children.get(chunk)
            if child is None:
                if block in self.node_of:
                    return  # this block already backs another prefix
                child = RadixNode(chunk, block, node)
                node.children[chunk] = child
                self.node_of[block] = child
            node = child
            if len(chunk) < bs:
                return

    def remove(self, block: int) -> list[int]:
        node = self.node_of.pop(block)
        del node.parent.children[node.tokens]
        orphans, stack = [], list(node.children.values())
        while stack:
            child = stack.pop()
            del self.node_of[child.block]
            orphans.append(child.block)
            stack.extend(child.children.values())
        return orphans

    def __contains__(self, block: int) -> bool:
        return block in self.node_of


PREFIX_INDEXES = {"hash": HashPrefixIndex, "radix": RadixPrefixIndex}
