"""Why a prompt missed the prefix cache: a memory of every block prefix ever published.

An index forgets a block when it is evicted; the history does not. For each block a request
publishes it keeps two chained keys of the tokens up to the block's end, one with the salt
and one without, so a miss at block i can be told apart: never seen, seen under another
salt, or seen and gone since (evicted). `miss_reason` returns one of `MISS_REASONS`'s
labels with a sentence for the request's explanation (`engine.explain(request_id)`).
"""

from __future__ import annotations

MISS_REASONS = {
    "shorter than one block": "only full blocks are shared, and the prompt's last token "
    "is always computed (it gives the logits)",
    "partial block": "the rest of the prompt fills no whole block, and this index shares "
    "full blocks only",
    "never seen": "no earlier request published this block's tokens",
    "different salt": "an earlier request published these tokens under another salt",
    "evicted": "an earlier request published this block; it has been evicted since",
    "computed in the same step": "the block it would copy from is computed in this very "
    "step, so its slots are not written yet",
    "no room to copy": "a cached block matches part of the next block, but copying it "
    "would take the last free block, so those tokens are recomputed",
}


class PrefixHistory:
    """Chained keys of every full block published, per request and overall."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.salted: set[int] = set()  # key of (salt, tokens up to a block's end)
        self.unsalted: set[int] = set()  # the same without the salt
        self._chains: dict[int, list[tuple[int, int]]] = {}  # request id -> keys per block

    def _keys(self, tokens: list[int], salt: str | None, start: tuple[int, int], i: int):
        block = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
        return hash((start[0], salt, block)), hash((start[1], block))

    def _chain(self, tokens: list[int], salt: str | None, blocks: int, known=()):
        keys = list(known)
        for i in range(len(keys), blocks):
            keys.append(self._keys(tokens, salt, keys[-1] if keys else (0, 0), i))
        return keys

    def record(self, request_id: int, tokens: list[int], salt: str | None) -> None:
        """`tokens` (a prefix of the request's tokens) are published: remember its full blocks."""
        known = self._chains.get(request_id, ())
        chain = self._chain(tokens, salt, len(tokens) // self.block_size, known)
        self._chains[request_id] = chain
        for salted, unsalted in chain:
            self.salted.add(salted)
            self.unsalted.add(unsalted)

    def forget(self, request_id: int) -> None:
        self._chains.pop(request_id, None)

    def miss_reason(
        self,
        prompt: list[int],
        salt: str | None,
        hit_tokens: int,
        token_granular: bool,
        copy_refused: bool = False,
    ) -> str | None:
        """Why the prompt's reusable part (all but its last token) was not all a hit, or
        None if it was. `token_granular`: the index matches partial blocks (radix);
        `copy_refused`: a partial-block source was still being computed."""
        limit = len(prompt) - 1
        if hit_tokens >= limit:
            return None
        if copy_refused:
            return "computed in the same step"
        if limit < self.block_size:
            return "shorter than one block"
        first = hit_tokens // self.block_size  # the first block not wholly a hit
        if (first + 1) * self.block_size > limit:
            return "never seen" if token_granular else "partial block"
        salted, unsalted = self._chain(prompt, salt, first + 1)[first]
        if salted in self.salted:
            return "evicted"
        return "different salt" if unsalted in self.unsalted else "never seen"
