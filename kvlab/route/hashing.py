"""What a router hashes to find a request's prefix on a replica.

- `token_block_hashes`: the precise policy's keys, vLLM's block hashes of the request's
  token ids (sha256_cbor chained over full blocks, the cache_salt in the first block's
  extra keys, NONE_HASH from the seed) as the integers vLLM's KV events carry: the same
  function the engines hash with (kvlab.cache.prefix.hash.block_hashes), so a block the
  router computes is a block an engine reported, when block size and seed agree.
- `char_block_hashes`: the approximate policy's keys, as llm-d's approximate prefix scorer
  makes them: chained hashes of fixed-size runs of the prompt's characters (no tokenizer,
  no events; only what the router itself sent where).
"""

from __future__ import annotations

import hashlib

from kvlab.cache.prefix.hash import block_hashes


def external(digest: bytes) -> int:
    """vLLM's event form of a hash: its last 8 bytes as an unsigned integer."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def token_block_hashes(
    tokens: list[int], block_size: int, salt: str | None = None, seed: str | None = None
) -> list[int]:
    """The hashes of the blocks a replica can hit for this prompt: the full blocks of all
    but its last token (an engine always computes the last one), as event integers."""
    usable = tokens[: max(0, len(tokens) - 1)]
    return [external(h) for h in block_hashes(usable, block_size, salt, "sha256_cbor", seed)]


def char_block_hashes(text: str, block_chars: int = 64, salt: str | None = None) -> list[int]:
    """Chained 64-bit hashes of the full `block_chars`-character blocks of `text` (the
    salt, if any, seeds the chain)."""
    parent = hashlib.blake2b((salt or "").encode(), digest_size=8).digest()
    keys = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        digest = hashlib.blake2b(parent, digest_size=8)
        digest.update(text[start : start + block_chars].encode())
        parent = digest.digest()
        keys.append(int.from_bytes(parent, "big"))
    return keys
