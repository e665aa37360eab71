"""The radix prefix index: a tree over token ids, as SGLang's RadixAttention keeps, one node
per block (page-aligned storage), with partial blocks as leaves. kvlab's matching goes past
the last full block: it finds the child sharing the longest run of tokens, whose first k
slots the cache copies into a fresh block instead of recomputing them. That copy is kvlab's
own design: SGLang matches token by token only at page size 1 and cuts a match to whole
pages otherwise (`page_align_keys` in sglang/srt/mem_cache/radix_cache.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.cache.prefix.base import PrefixIndex, PrefixMatch
from kvlab.cache.prefix.registry import PREFIX_INDEXES


@dataclass(eq=False)
class RadixNode:
    tokens: tuple[int, ...]  # block_size tokens, or fewer for a partial leaf
    block: int
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)


@PREFIX_INDEXES.register("radix")
class RadixPrefixIndex(PrefixIndex):
    token_granular = True

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
