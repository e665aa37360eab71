"""Notebook 10's exercises: what a block weighs when it moves, which block a full LRU
tier sends one tier down, and what a link costs KV that crosses it every decode step."""

from __future__ import annotations

from kvlab.course.exercise import exercise


def _smollm2() -> dict:
    import torch

    from kvlab.cache.spec import KVSpec

    spec = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64)
    return {"spec": spec, "block_size": 16, "dtype": torch.float32}


def _bytes_hint(answer, right) -> str:
    if answer * 2 == right:
        return "half of it: the model runs in fp32 here, 4 bytes per element."
    if answer * 16 == right:
        return "that is one token: a block holds block_size tokens."
    return "block_size x (2 x layers x KV heads x head_dim x 4 bytes, fp32 on this CPU)."


@exercise(
    "10.block-bytes",
    question="A tier stores whole blocks. How many bytes does one block of 16 tokens of the "
    "embedded model move when it goes down to the host tier (fp32 K/V, no codec)?",
    solution="16 tokens x (2 x 30 layers x 3 KV heads x 64 x 4 bytes) = 16 x 46,080 = "
    "737,280 bytes; with kv_codec='int8' the stored codes (and their scales) move instead: "
    "16 x 11,880 = 190,080 bytes.",
    hint=_bytes_hint,
    example=_smollm2,
)
def block_bytes(spec, block_size: int, dtype) -> int:
    return block_size * spec.bytes_per_token(dtype)


def _ops() -> dict:
    return {"capacity": 3, "ops": ["put A", "put B", "put C", "get A", "put D"]}


def _lru_hint(answer, right) -> str:
    if answer == "A":
        return (
            "A was read (`get A`) after B and C were written: it is now the most "
            "recently used, so it is not the one to go."
        )
    if answer == "D":
        return (
            "D has just arrived; the tier makes room for it by sending the least "
            "recently used entry down."
        )
    return (
        "replay the operations: each put or get moves its key to the most recent end; "
        "a put past the capacity sends the least recent one down a tier."
    )


@exercise(
    "10.lru-victim",
    question="A host tier holding `capacity` blocks, LRU, sees the operations `ops` in order. "
    "Which key does the last put send down to the next tier (a string)?",
    solution="After put A, B, C the order (least recent first) is A, B, C; get A makes it "
    "B, C, A; put D exceeds 3 blocks, so B, the least recently used, goes down a tier "
    "(`HostTier.put` and `_make_room`; `TierStack.save` hands it to the disk tier).",
    hint=_lru_hint,
    example=_ops,
    choices=("A", "B", "C", "D"),
)
def lru_victim(capacity: int, ops: list[str]) -> str:
    import torch

    from kvlab.cache.codecs import StoredKV
    from kvlab.cache.tiers.host import HostTier

    tier, evicted = HostTier(capacity), []
    for op in ops:
        verb, name = op.split()
        if verb == "put":
            stored = StoredKV({"kv": torch.zeros(1, 1)})
            evicted += [
                key.decode() for key, _salt, _stored in tier.put(name.encode(), None, stored)
            ]
        else:
            tier.get(name.encode(), None)
    return evicted[-1]


def _link() -> dict:
    return {"blocks": 36, "block_bytes": 737_280, "link_gb_s": 25}


def _copy_hint(answer, right) -> str:
    if isinstance(answer, (int, float)) and answer and abs(answer / right - 1e-3) < 1e-4:
        return "that is in milliseconds: the answer is asked in microseconds (x 1,000)."
    if isinstance(answer, (int, float)) and answer > 0:
        blocks = right / answer  # an answer for one block is the right one / the blocks
        if blocks >= 2 and abs(blocks - round(blocks)) < 0.05:
            return "that is fewer blocks than move: every block of the context, every step."
    return "blocks x block_bytes / (link_gb_s x 1e9 bytes per second), then x 1e6 for µs."


@exercise(
    "10.copy-time",
    question="KV held in host memory crosses the link every decode step. A step reads "
    "`blocks` blocks of `block_bytes` bytes each; how many microseconds does a link of "
    "`link_gb_s` GB/s take to move them (bandwidth only, no latency)?",
    solution="blocks x block_bytes / (link_gb_s x 1e9) seconds: in the stored run 36 x "
    "737,280 bytes = 26.5 MB, over 25 GB/s 1,062 µs per step, paid again every step "
    "(`experiments.tiers.project_copy`); a KV tier pays it once, when a block comes back.",
    hint=_copy_hint,
    example=_link,
    tolerance=0.05,
)
def copy_time_us(blocks: int, block_bytes: int, link_gb_s: float) -> float:
    from kvlab.experiments.tiers import project_copy

    return project_copy(blocks * block_bytes, link_gb_s) * 1e6
