"""A learner's part inside kvlab's real PagedCache: random traffic with prefix sharing.

The same property test the library passes (tests/test_prefix_cache.py): requests from a
few prompt families and two tenants (salts) are admitted, grown and finished at random;
after every operation `PagedCache.check_integrity()` must hold, and every slot a running
request can read must hold exactly what that request wrote there. Each slot stores two
numbers: (tenant, position, token) and a hash of the whole prefix up to that position,
standing in for real K/V, which depend on every earlier token.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from kvlab.cache import KVPool, KVSpec, PagedCache
from kvlab.cache.prefix import PrefixIndex
from kvlab.config import SamplingParams
from kvlab.labs.grading import Broken, Case, Transcript, where
from kvlab.sequence import Sequence

BODY = [(11 * i + 3) % 50 for i in range(24)]  # a "document" every family shares
CONSISTENT = "PagedCache.check_integrity() holds after every operation"
OWN_KV = "a request reads back exactly the K/V written for its own prefix and tenant"
ALL_BACK = "when every request has finished, every block is free or cached again"


def _prompt(family: int, block_size: int, length: int, extra: int) -> list[int]:
    head = [60 + 10 * family + i for i in range(block_size)]  # a family's own first block
    return (head + BODY)[: max(1, length)] + [extra % 50] * (extra % 4)


def _expected(seq: Sequence, salt_id: int, end: int) -> list[tuple[float, float]]:
    values, rolling = [], 0
    for p, token in enumerate(seq.token_ids[:end]):
        rolling = (rolling * 131 + token + 1) % 1_000_003  # exact in float32
        values.append((float(salt_id * 100_000 + p * 100 + token), float(rolling)))
    return values


def _slots(cache: PagedCache, seq: Sequence, start: int, end: int) -> torch.Tensor:
    table, bs = cache.block_table(seq), cache.block_size
    return torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)])


def _write(cache: PagedCache, seq: Sequence, salt_id: int, end: int) -> None:
    start = seq.num_computed
    cache.ensure_capacity(seq, end)
    values = torch.tensor(_expected(seq, salt_id, end)[start:end]).view(-1, 1, 2)
    cache.pool.write(0, _slots(cache, seq, start, end), values, values)
    seq.num_computed = end


def _read(cache: PagedCache, seq: Sequence) -> list[tuple[float, float]]:
    k, _ = cache.pool.gather(0, _slots(cache, seq, 0, seq.num_computed)[None])
    return [tuple(row) for row in k[0, :, 0, :].tolist()]


def random_cases(seed: int, count: int, max_ops: int = 60) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        params = (rng.choice([2, 4]), rng.randint(8, 24))  # block_size, num_blocks
        ops = tuple(
            (
                rng.choice(["admit", "admit", "grow", "finish"]),
                rng.randrange(3),  # prompt family
                rng.randrange(2),  # tenant (salt)
                rng.randrange(10**6),
            )
            for _ in range(rng.randint(1, max_ops))
        )
        cases.append(Case(params, ops))
    return cases


def smaller_params(params: tuple) -> list[tuple]:
    block_size, num_blocks = params
    return [(block_size, n) for n in (num_blocks // 2, num_blocks - 1) if n >= 6]


def run_sharing_case(
    case: Case,
    make_index: Callable[[int], PrefixIndex],
    make_allocator: Callable[[PagedCache], object] | None = None,
) -> None:
    """Replay one case; raise `Broken` with a log of the operations on the first violation."""
    block_size, num_blocks = case.params
    log = Transcript()
    pool = KVPool(KVSpec(1, 1, 2), num_blocks * block_size, torch.float32, torch.device("cpu"))
    cache = PagedCache(pool, block_size, 64, prefix_index=make_index(block_size))
    if make_allocator is not None:
        cache.allocator = make_allocator(cache)
    log.add(f"# PagedCache: {num_blocks} blocks of {block_size} tokens, prefix index on")
    running: list[tuple[Sequence, int]] = []

    def crash(error: Exception, doing: str) -> Broken:
        return log.broken(
            "the cache's calls into your code run without crashing",
            f"{type(error).__name__}: {error} (while {doing}){where(error)}",
            "no error: this operation is valid",
        )

    for step, (op, family, salt_id, r) in enumerate(case.ops):
        if op == "admit":
            prompt = _prompt(family, block_size, 1 + r % 23, r)
            seq = Sequence(step, prompt, SamplingParams(max_new_tokens=1 + r % 6))
            seq.salt = f"tenant-{salt_id}"
            try:
                if cache.allocate_slots(seq) is None:
                    continue
                hit = seq.num_computed
                _write(cache, seq, salt_id, len(prompt))
                cache.publish(seq)
            except (Broken, NotImplementedError):
                raise
            except Exception as error:
                raise crash(error, f"admitting request {step}") from None
            running.append((seq, salt_id))
            log.add(
                f"admit request {step}: {len(prompt)} tokens, family {family}, {seq.salt!r}",
                note=f"{hit} tokens from the prefix cache; blocks {cache.block_table(seq)}",
            )
        elif op == "grow" and running:
            seq, salt_id = running[r % len(running)]
            if len(seq.output_ids) >= seq.params.max_new_tokens:
                continue
            seq.output_ids.append(r % 50)
            try:
                _write(cache, seq, salt_id, seq.num_tokens)
            except NotImplementedError:
                raise
            except Exception as error:
                raise crash(error, f"growing request {seq.request_id}") from None
            log.add(f"request {seq.request_id} writes token {seq.num_tokens - 1}")
        elif op == "finish" and running:
            seq, _ = running.pop(r % len(running))
            try:
                cache.free(seq)
            except NotImplementedError:
                raise
            except Exception as error:
                raise crash(error, f"finishing request {seq.request_id}") from None
            log.add(f"finish request {seq.request_id}")
        else:
            continue
        _check(cache, running, log)
    for seq, _ in running:
        try:
            cache.free(seq)
        except Exception as error:
            raise crash(error, f"finishing request {seq.request_id}") from None
        log.add(f"finish request {seq.request_id}")
    _check(cache, [], log)
    allocator = cache.allocator
    if allocator.num_used or any(allocator.ref_counts):
        raise log.broken(
            ALL_BACK,
            f"num_used={allocator.num_used}, ref_counts={list(allocator.ref_counts)}",
            "num_used=0 and every reference count 0",
        )


def _check(cache: PagedCache, running: list[tuple[Sequence, int]], log: Transcript) -> None:
    try:
        cache.check_integrity()
    except AssertionError as error:
        raise log.broken(CONSISTENT, f"AssertionError: {error}", "no assertion fails") from None
    for seq, salt_id in running:
        got = _read(cache, seq)
        want = _expected(seq, salt_id, seq.num_computed)
        if got != want:
            p = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            block = cache.block_table(seq)[p // cache.block_size]
            raise log.broken(
                OWN_KV,
                f"request {seq.request_id} reads position {p} from block {block}, which holds "
                f"K/V written for another prefix or tenant",
                f"the K/V of request {seq.request_id}'s own tokens 0..{p} under its salt",
            )
