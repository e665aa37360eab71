"""Known-wrong lab answers: each breaks one rule a grader checks (tests/test_labs.py asserts
which) and is handed in as a submission in tests/test_nbgrader.py.

Wrong allocators override one method of kvlab's own `BlockAllocator` (the reference), so
each has exactly one bug. `submission(mistake)` is the exercise cell a learner with that
bug hands in: the mistake's source, bound to the names the lab's grader cell uses.
"""

from __future__ import annotations

import hashlib
import inspect
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvlab.cache import BlockAllocator, OutOfBlocks
from kvlab.cache.retention import DROPPED
from kvlab.engine.scheduler import choose_victim as kvlab_choose_victim
from kvlab.labs import (
    allocator,
    capstone,
    hashing,
    hybrid_hit,
    int8,
    kv_cache,
    kvlab_block_keys,
    metrics,
    rollback,
    scorer,
    tier,
    victim,
    window,
)
from kvlab.units import ceil_div


# --- lab 0: the KV cache of one attention layer ---------------------------------------------
class KVCacheAnswer:
    """The right answer (the lab's solution); each mistake below changes one method."""

    def __init__(self, num_heads, num_kv_heads, head_dim, dtype=torch.float32):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.k = torch.empty(0, num_kv_heads, head_dim, dtype=dtype)
        self.v = torch.empty(0, num_kv_heads, head_dim, dtype=dtype)

    def append(self, k, v):
        self.k = torch.cat((self.k, k))
        self.v = torch.cat((self.v, v))

    def attend(self, q):
        n, total = q.shape[0], self.k.shape[0]
        group = self.num_heads // self.num_kv_heads
        k = self.k.repeat_interleave(group, dim=1)
        v = self.v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,thd->hnt", q, k) * self.head_dim**-0.5
        position = torch.arange(total - n, total)[:, None]
        scores = scores.masked_fill(torch.arange(total)[None, :] > position, float("-inf"))
        return torch.einsum("hnt,thd->nhd", scores.softmax(dim=-1), v)


class NoCausalMask(KVCacheAnswer):
    """Forgets the mask: a prompt's tokens see the tokens after them."""

    def attend(self, q):
        group = self.num_heads // self.num_kv_heads
        k = self.k.repeat_interleave(group, dim=1)
        v = self.v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,thd->hnt", q, k) * self.head_dim**-0.5
        return torch.einsum("hnt,thd->nhd", scores.softmax(dim=-1), v)


class CausalFromTheTopLeft(KVCacheAnswer):
    """torch's is_causal=True: its mask is aligned top-left, as if the new tokens came first."""

    def attend(self, q):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            self.k.transpose(0, 1),
            self.v.transpose(0, 1),
            is_causal=True,
            enable_gqa=True,
        )
        return out.transpose(0, 1)


class RepeatsKNotV(KVCacheAnswer):
    """GQA: repeats the KV heads of K for the query heads, but not those of V."""

    def attend(self, q):
        n, total = q.shape[0], self.k.shape[0]
        group = self.num_heads // self.num_kv_heads
        k = self.k.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,thd->hnt", q, k) * self.head_dim**-0.5
        position = torch.arange(total - n, total)[:, None]
        scores = scores.masked_fill(torch.arange(total)[None, :] > position, float("-inf"))
        return torch.einsum("hnt,thd->nhd", scores.softmax(dim=-1), self.v)


class TilesKVHeads(KVCacheAnswer):
    """GQA with .repeat: query head h reads KV head h % num_kv_heads, not h // group."""

    def attend(self, q):
        n, total = q.shape[0], self.k.shape[0]
        group = self.num_heads // self.num_kv_heads
        k = self.k.repeat(1, group, 1)
        v = self.v.repeat(1, group, 1)
        scores = torch.einsum("nhd,thd->hnt", q, k) * self.head_dim**-0.5
        position = torch.arange(total - n, total)[:, None]
        scores = scores.masked_fill(torch.arange(total)[None, :] > position, float("-inf"))
        return torch.einsum("hnt,thd->nhd", scores.softmax(dim=-1), v)


class OverwritesTheCache(KVCacheAnswer):
    """append replaces the cached K/V with the new tokens' instead of adding to them."""

    def append(self, k, v):
        self.k, self.v = k, v


class ScalesByHeadDim(KVCacheAnswer):
    """Divides the scores by head_dim instead of its square root."""

    def attend(self, q):
        n, total = q.shape[0], self.k.shape[0]
        group = self.num_heads // self.num_kv_heads
        k = self.k.repeat_interleave(group, dim=1)
        v = self.v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,thd->hnt", q, k) / self.head_dim
        position = torch.arange(total - n, total)[:, None]
        scores = scores.masked_fill(torch.arange(total)[None, :] > position, float("-inf"))
        return torch.einsum("hnt,thd->nhd", scores.softmax(dim=-1), v)


# --- lab 1: block allocator -----------------------------------------------------------------
class FreesOnFirstDecref(BlockAllocator):
    """Forgets the reference count: the first decref frees a shared block."""

    def decref(self, block, keep_cached=False):
        if self.ref_counts[block] <= 0:
            raise ValueError("double free")
        self.ref_counts[block] = 0
        if keep_cached:
            self.cached[block] = None
            return False
        self.free_blocks.append(block)
        return True


class AllowsDoubleFree(BlockAllocator):
    """Clamps the count at zero instead of raising: a double free goes unnoticed."""

    def decref(self, block, keep_cached=False):
        self.ref_counts[block] = max(0, self.ref_counts[block] - 1)
        if self.ref_counts[block]:
            return False
        if keep_cached:
            self.cached[block] = None
            return False
        self.free_blocks.append(block)
        return True


class LosesUncachedBlocks(BlockAllocator):
    """uncache() drops the block without putting it on the free list: it is lost."""

    def uncache(self, block):
        del self.cached[block]


class EvictsMostRecentlyUsed(BlockAllocator):
    """popitem() takes the most recently used cached block."""

    def allocate(self):
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.cached:
            block, _ = self.cached.popitem()
            if self.on_evict:
                self.on_evict(block)
        else:
            raise OutOfBlocks("no block")
        self.ref_counts[block] = 1
        return block


class RevivedBlockStaysCached(BlockAllocator):
    """incref() of a cached block forgets to take it out of the cache."""

    def incref(self, block):
        if block not in self.cached and self.ref_counts[block] <= 0:
            raise ValueError("free block")
        self.ref_counts[block] += 1


class EvictsBeforeUsingFreeBlocks(BlockAllocator):
    """Takes a cached block even though free ones are left (loses cache hits)."""

    def allocate(self):
        if self.cached:
            block, _ = self.cached.popitem(last=False)
            if self.on_evict:
                self.on_evict(block)
        elif self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            raise OutOfBlocks("no block")
        self.ref_counts[block] = 1
        return block


# --- lab 2: chained block hash --------------------------------------------------------------
def ignores_parent(tokens, block_size, salt):
    starts = range(0, len(tokens) - block_size + 1, block_size)
    return [hash((tuple(tokens[s : s + block_size]), salt)) for s in starts]


def ignores_salt(tokens, block_size, salt):
    keys, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        keys.append(parent)
    return keys


def joins_digits(tokens, block_size, salt):
    keys, parent = [], ""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        text = parent + (salt or "") + "".join(str(t) for t in tokens[start : start + block_size])
        parent = hashlib.sha256(text.encode()).hexdigest()
        keys.append(parent)
    return keys


def keys_the_partial_block(tokens, block_size, salt):
    keys, parent = [], None
    for start in range(0, len(tokens), block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size]), salt))
        keys.append(parent)
    return keys


def hashes_the_sum(tokens, block_size, salt):
    keys, parent = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, sum(tokens[start : start + block_size]), salt))
        keys.append(parent)
    return keys


# --- lab 3: int8 codec (each wrong quantize is paired with a right dequantize) --------------
def dequantize(q, scale):
    return q.float() * scale.float()[..., None]


def per_tensor_scale(x):
    s = x.abs().max() / 127
    return (x / s).round().clamp(-127, 127).to(torch.int8), s.expand(x.shape[:2])


def per_tensor_scalar(x):
    s = x.abs().max() / 127
    return (x / s).round().clamp(-127, 127).to(torch.int8), s


def truncates(x):
    s = x.abs().amax(-1) / 127
    safe = torch.where(s > 0, s, 1.0)[..., None]
    return (x / safe).clamp(-127, 127).to(torch.int8), s


def overflows(x):  # amax / 128 and no clamp: the largest value wraps around
    s = x.abs().amax(-1) / 128
    safe = torch.where(s > 0, s, 1.0)[..., None]
    return (x / safe).round().to(torch.int8), s


def float16_scale(x):
    s = (x.abs().amax(-1) / 127).half()
    safe = torch.where(s > 0, s, 1.0)[..., None].float()
    return (x / safe).round().clamp(-127, 127).to(torch.int8), s


# --- lab 4: preemption victim ---------------------------------------------------------------
def oldest_admitted(running):
    return max(running, key=lambda s: (-s.priority, -s.admit_order))


def ignores_priority(running):
    return max(running, key=lambda s: s.admit_order)


def latest_arrival(running):
    return max(running, key=lambda s: (-s.priority, s.arrival_s))


def highest_priority(running):
    return max(running, key=lambda s: (s.priority, s.admit_order))


def sorts_in_place(running):
    running.sort(key=lambda s: (-s.priority, s.admit_order))
    return running[-1]


def returns_request_id(running):
    return kvlab_choose_victim(running).request_id


# --- lab 5: speculative rollback -----------------------------------------------------------
def keeps_a_block_too_many(table, block_size, num_computed, num_drafts, accepted, ref_counts):
    kept = num_computed - (num_drafts - accepted)
    num_blocks = kept // block_size + 1  # one too many when kept ends at a block boundary
    return kept, num_blocks, [b for b in table[num_blocks:] if ref_counts[b] == 1]


def keeps_a_block_too_few(table, block_size, num_computed, num_drafts, accepted, ref_counts):
    kept = num_computed - (num_drafts - accepted)
    num_blocks = kept // block_size  # drops a partly filled last block of kept tokens
    return kept, num_blocks, [b for b in table[num_blocks:] if ref_counts[b] == 1]


def frees_shared_blocks(table, block_size, num_computed, num_drafts, accepted, ref_counts):
    kept = num_computed - (num_drafts - accepted)
    num_blocks = ceil_div(kept, block_size)
    return kept, num_blocks, list(table[num_blocks:])


def forgets_to_rewind(table, block_size, num_computed, num_drafts, accepted, ref_counts):
    kept = num_computed - (num_drafts - accepted)
    num_blocks = ceil_div(kept, block_size)
    return num_computed, num_blocks, [b for b in table[num_blocks:] if ref_counts[b] == 1]


def frees_accepted_drafts(table, block_size, num_computed, num_drafts, accepted, ref_counts):
    kept = num_computed - (num_drafts - accepted)
    num_blocks = ceil_div(num_computed - num_drafts, block_size)  # as if none was accepted
    return kept, num_blocks, [b for b in table[num_blocks:] if ref_counts[b] == 1]


# --- lab 6: sliding-window release ----------------------------------------------------------
def releases_partial_blocks(table, num_computed, block_size, window, sinks):
    first = ceil_div(sinks, block_size)
    end = ceil_div(max(num_computed - window, 0), block_size)  # a block the window starts in
    return [i for i in range(first, end) if table[i] != DROPPED]


def keeps_one_token_too_many(table, num_computed, block_size, window, sinks):
    first = ceil_div(sinks, block_size)
    end = max(num_computed - 1 - window, 0) // block_size  # the window plus the newest token
    return [i for i in range(first, end) if table[i] != DROPPED]


def ignores_sinks(table, num_computed, block_size, window, sinks):
    end = max(num_computed - window, 0) // block_size
    return [i for i in range(end) if table[i] != DROPPED]


def rounds_sinks_down(table, num_computed, block_size, window, sinks):
    first = sinks // block_size  # releases the block holding the last sink tokens
    end = max(num_computed - window, 0) // block_size
    return [i for i in range(first, end) if table[i] != DROPPED]


def releases_dropped_blocks(table, num_computed, block_size, window, sinks):
    first = ceil_div(sinks, block_size)
    end = max(num_computed - window, 0) // block_size
    return list(range(first, end))


# --- lab 7: a tier's LRU -------------------------------------------------------------------
class TierAnswer:
    """A right answer (the lab's solution): the mistakes below each change one method."""

    def __init__(self, capacity_blocks):
        self.capacity_blocks = capacity_blocks
        self.entries = OrderedDict()
        self.hits = self.misses = self.refused = self.evictions = 0

    def keys(self):
        return list(self.entries)

    def get(self, key, salt):
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        if entry[0] != salt:
            self.refused += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return entry[1]

    def put(self, key, salt, value):
        if key in self.entries:
            self.entries.move_to_end(key)
            return []
        self.entries[key] = (salt, value)
        return self._make_room()

    def _make_room(self):
        evicted = []
        while len(self.entries) > self.capacity_blocks:
            old, (old_salt, old_value) = self.entries.popitem(last=False)
            self.evictions += 1
            evicted.append((old, old_salt, old_value))
        return evicted


class EvictsTheMostRecent(TierAnswer):
    """Makes room before storing, with popitem(): the most recently used entry goes."""

    def put(self, key, salt, value):
        if key in self.entries:
            self.entries.move_to_end(key)
            return []
        evicted = []
        if len(self.entries) >= self.capacity_blocks:
            old, (old_salt, old_value) = self.entries.popitem()
            self.evictions += 1
            evicted.append((old, old_salt, old_value))
        self.entries[key] = (salt, value)
        return evicted


class HitDoesNotPromote(TierAnswer):
    """A hit is served but stays where it was in the LRU order."""

    def get(self, key, salt):
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        if entry[0] != salt:
            self.refused += 1
            return None
        self.hits += 1
        return entry[1]


class ServesAnySalt(TierAnswer):
    """Looks the key up and never compares salts: another tenant's block is served."""

    def get(self, key, salt):
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return entry[1]


class RefusalCountedAsMiss(TierAnswer):
    """Refuses another salt, but counts it as a miss."""

    def get(self, key, salt):
        entry = self.entries.get(key)
        if entry is None or entry[0] != salt:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return entry[1]


class EvictsBeforeFull(TierAnswer):
    """Evicts while the tier holds capacity_blocks entries: one slot always stays empty."""

    def _make_room(self):
        evicted = []
        while len(self.entries) >= self.capacity_blocks:
            old, (old_salt, old_value) = self.entries.popitem(last=False)
            self.evictions += 1
            evicted.append((old, old_salt, old_value))
        return evicted


class ExceedsItsBound(TierAnswer):
    """Checks for room before storing, with `>`: the tier ends up one entry over."""

    def put(self, key, salt, value):
        if key in self.entries:
            self.entries.move_to_end(key)
            return []
        evicted = self._make_room()
        self.entries[key] = (salt, value)
        return evicted


class LosesEvictedEntries(TierAnswer):
    """Evicts the right entry but returns nothing: the block never reaches the next tier."""

    def put(self, key, salt, value):
        super().put(key, salt, value)
        return []


class RePutKeepsItsPlace(TierAnswer):
    """A put of a key already held assigns it again, which keeps its place in the order."""

    def put(self, key, salt, value):
        if key in self.entries:
            self.entries[key] = (salt, value)
            return []
        return super().put(key, salt, value)


# --- lab 8: reading /metrics ---------------------------------------------------------------
def read_line(line):
    """(name, labels, the rest of the line) of one sample line."""
    label = re.compile(r'\s*([A-Za-z_]\w*)="((?:[^"\\]|\\.)*)"\s*,?')
    labels = {}
    if "{" not in line:
        name, rest = line.split(None, 1)
        return name, labels, rest
    name, rest = line.split("{", 1)
    while not rest.lstrip().startswith("}"):
        match = label.match(rest)
        labels[match[1]] = re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], match[2])
        rest = rest[match.end() :]
    return name.strip(), labels, rest.lstrip()[1:]


def sample_lines(text):
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def parse_metrics(text):  # the right answers (the lab's solution); each mistake replaces one
    samples = []
    for line in sample_lines(text):
        name, labels, rest = read_line(line)
        samples.append((name, labels, float(rest.split()[0])))
    return samples


def delta(before, after, name):
    old, new = parse_metrics(before), parse_metrics(after)
    return sum(v for n, _, v in new if n == name) - sum(v for n, _, v in old if n == name)


def caching_off(after):
    info = [labels for n, labels, _ in parse_metrics(after) if n == "vllm:cache_config_info"]
    return any(labels.get("enable_prefix_caching") == "False" for labels in info)


def hit_rate(before, after):
    queries = delta(before, after, "vllm:prefix_cache_queries_total")
    hits = delta(before, after, "vllm:prefix_cache_hits_total")
    if queries == 0:
        return None, "no queries"
    if hits == 0:
        return 0.0, "prefix caching off" if caching_off(after) else "no shared prefixes"
    return hits / queries, "hits"


def usage_after(after):
    usage = [v for n, _, v in parse_metrics(after) if n == "vllm:kv_cache_usage_perc"]
    return max(usage, default=0.0)


def preemptions(before, after):
    return int(delta(before, after, "vllm:num_preemptions_total")), usage_after(after)


def parse_takes_the_last_number(text):
    samples = []
    for line in sample_lines(text):
        name, labels, rest = read_line(line)
        samples.append((name, labels, float(rest.split()[-1])))  # a timestamp, if any
    return samples


def parse_splits_labels_on_commas(text):
    samples = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        labels = {}
        if "{" in line:
            name, rest = line.split("{", 1)
            inner, rest = rest.rsplit("}", 1)
            for part in inner.split(","):  # a value holding a comma is cut in two
                if "=" in part:
                    key, value = part.split("=", 1)
                    labels[key.strip()] = value.strip('"')
        else:
            name, rest = line.split(None, 1)
        samples.append((name, labels, float(rest.split()[0])))
    return samples


def parse_drops_total(text):
    samples = []
    for line in sample_lines(text):
        name, labels, rest = read_line(line)
        samples.append((name.removesuffix("_total"), labels, float(rest.split()[0])))
    return samples


def rate_from_totals(before, after):
    new = parse_metrics(after)
    queries = sum(v for n, _, v in new if n == "vllm:prefix_cache_queries_total")
    hits = sum(v for n, _, v in new if n == "vllm:prefix_cache_hits_total")
    if queries == 0:
        return None, "no queries"
    if hits == 0:
        return 0.0, "prefix caching off" if caching_off(after) else "no shared prefixes"
    return hits / queries, "hits"


def rate_per_request(before, after):
    requests = delta(before, after, "vllm:request_success_total")
    hits = delta(before, after, "vllm:prefix_cache_hits_total")
    if requests == 0:
        return None, "no queries"
    if hits == 0:
        return 0.0, "prefix caching off" if caching_off(after) else "no shared prefixes"
    return hits / requests, "hits"


def rate_divides_by_zero(before, after):
    queries = delta(before, after, "vllm:prefix_cache_queries_total")
    hits = delta(before, after, "vllm:prefix_cache_hits_total")
    rate = hits / queries
    if hits == 0:
        return 0.0, "prefix caching off" if caching_off(after) else "no shared prefixes"
    return rate, "hits"


def rate_blames_sharing(before, after):
    queries = delta(before, after, "vllm:prefix_cache_queries_total")
    hits = delta(before, after, "vllm:prefix_cache_hits_total")
    if queries == 0:
        return None, "no queries"
    return hits / queries, "hits" if hits else "no shared prefixes"


def preemptions_from_histogram_sum(before, after):
    count = delta(before, after, "vllm:request_num_preemptions_sum")  # finished requests only
    return int(count), usage_after(after)


def preemptions_usage_in_percent(before, after):
    return int(delta(before, after, "vllm:num_preemptions_total")), 100 * usage_after(after)


def preemptions_total_not_delta(before, after):
    new = parse_metrics(after)
    count = sum(v for n, _, v in new if n == "vllm:num_preemptions_total")
    return int(count), usage_after(after)


# --- lab 9: the precise scorer ----------------------------------------------------------------
class ScorerAnswer:
    """A right answer (the lab's solution): the mistakes below each change one method."""

    def __init__(self):
        self.held = {}

    def apply(self, replica, event):
        blocks = self.held.setdefault(replica, set())
        if event["type"] == "BlockStored":
            blocks.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            blocks.difference_update(event["block_hashes"])
        elif event["type"] == "AllBlocksCleared":
            blocks.clear()

    def score(self, hashes, replicas):
        scores = {}
        for replica in replicas:
            blocks, n = self.held.get(replica, set()), 0
            for h in hashes:
                if h not in blocks:
                    break
                n += 1
            scores[replica] = n
        return scores


class CountsBlocksPastAGap(ScorerAnswer):
    """Counts every hash the replica holds, not the run from the first block."""

    def score(self, hashes, replicas):
        return {r: sum(h in self.held.get(r, set()) for h in hashes) for r in replicas}


class RemovesFromEveryReplica(ScorerAnswer):
    """A BlockRemoved forgets the block on every replica, not only the one that evicted it."""

    def apply(self, replica, event):
        if event["type"] == "BlockRemoved":
            for blocks in self.held.values():
                blocks.difference_update(event["block_hashes"])
        else:
            super().apply(replica, event)


class ClearsEveryReplica(ScorerAnswer):
    """AllBlocksCleared from one replica empties them all."""

    def apply(self, replica, event):
        if event["type"] == "AllBlocksCleared":
            self.held.clear()
        else:
            super().apply(replica, event)


class ScoresOnlyReplicasSeen(ScorerAnswer):
    """Leaves out the replicas that have sent no event yet."""

    def score(self, hashes, replicas):
        scores = super().score(hashes, replicas)
        return {r: n for r, n in scores.items() if r in self.held}


# --- lab 10: the capstone (lab 1, 2 and 4 parts inside kvlab's engine) ----------------------
class NeverReusesFreedBlocks(BlockAllocator):
    """Hands out each block once: a freed block never comes off the free list again."""

    def __init__(self, num_blocks, on_evict=None):
        super().__init__(num_blocks, on_evict)
        self.fresh = 0  # blocks 0 .. fresh - 1 were handed out once

    def allocate(self):
        if self.fresh < self.num_blocks:
            block, self.fresh = self.fresh, self.fresh + 1
            self.free_blocks.remove(block)
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            if self.on_evict:
                self.on_evict(block)
        else:
            raise OutOfBlocks("every block was handed out once")
        self.ref_counts[block] = 1
        return block


class LeaksAFreedBlock(BlockAllocator):
    """The first block freed never goes back on the free list."""

    leaked = False

    def decref(self, block, keep_cached=False):
        freed = super().decref(block, keep_cached)
        if freed and not self.leaked:
            self.leaked = True
            self.free_blocks.remove(block)
        return freed


# --- lab 11: the cross-group prefix hit (each a whole answer: it has no class to change) ----
def min_of_each_groups_hit(groups, cached, num_blocks, block_size):
    hits = []
    for g, group in enumerate(groups):  # each group's own longest hit; the hit is the shortest
        if group.window is None:
            hits.append(next((i for i in range(num_blocks) if not cached(g, i)), num_blocks))
            continue
        need, h = ceil_div(group.window - 1, block_size), num_blocks
        while h > 0:
            lacking = [i for i in range(max(0, h - need), h) if not cached(g, i)]
            if not lacking:
                break
            h = lacking[-1]
        hits.append(h)
    return min(hits)


def one_pass_over_the_windows(groups, cached, num_blocks, block_size):
    hit = num_blocks
    for g, group in enumerate(groups):
        if group.window is None:
            hit = next((i for i in range(hit) if not cached(g, i)), hit)
    for g, group in enumerate(groups):  # each window once: a later move is never checked
        if group.window is not None:
            need = ceil_div(group.window - 1, block_size)
            while hit > 0:
                lacking = [i for i in range(max(0, hit - need), hit) if not cached(g, i)]
                if not lacking:
                    break
                hit = lacking[-1]
    return hit


def needs_whole_window_blocks(groups, cached, num_blocks, block_size):
    hit = num_blocks
    for g, group in enumerate(groups):
        if group.window is None:
            hit = next((i for i in range(hit) if not cached(g, i)), hit)
    moved = True
    while moved:
        moved = False
        for g, group in enumerate(groups):
            if group.window is not None:
                need, h = ceil_div(group.window, block_size), hit  # W tokens, not W - 1
                while h > 0:
                    lacking = [i for i in range(max(0, h - need), h) if not cached(g, i)]
                    if not lacking:
                        break
                    h = lacking[-1]
                moved, hit = moved or h != hit, h
    return hit


def scans_windows_left_to_right(groups, cached, num_blocks, block_size):
    hit = num_blocks
    for g, group in enumerate(groups):
        if group.window is None:
            hit = next((i for i in range(hit) if not cached(g, i)), hit)
    moved = True
    while moved:
        moved = False
        for g, group in enumerate(groups):
            if group.window is not None:
                need, h = ceil_div(group.window - 1, block_size), 0
                while h < hit and all(cached(g, i) for i in range(max(0, h + 1 - need), h + 1)):
                    h += 1  # grows the hit from the left while the window serves it
                moved, hit = moved or h != hit, h
    return hit


def asks_past_the_bound(groups, cached, num_blocks, block_size):
    hit = num_blocks
    for g, group in enumerate(groups):
        if group.window is None:
            h = 0
            while cached(g, h):  # the group's run of held blocks, cut to the bound after
                h += 1
            hit = min(hit, h)
    moved = True
    while moved:
        moved = False
        for g, group in enumerate(groups):
            if group.window is not None:
                need, h = ceil_div(group.window - 1, block_size), hit
                while h > 0:
                    lacking = [i for i in range(max(0, h - need), h) if not cached(g, i)]
                    if not lacking:
                        break
                    h = lacking[-1]
                moved, hit = moved or h != hit, h
    return hit


# --- the table ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mistake:
    lab: str  # the lab's notebook name
    code: object  # the wrong class or function
    invariant: str  # the rule the grader's first failure must name
    phrases: list[str] = field(default_factory=list)  # and what its report must show

    @property
    def name(self) -> str:
        return self.code.__name__


LAB_NAMES = (  # every lab, in order: the tests check the folders and workflow against it
    "00_kv_cache",
    "01_block_allocator",
    "02_block_hash",
    "03_int8_codec",
    "04_preemption_victim",
    "05_spec_rollback",
    "06_window_release",
    "07_tier_lru",
    "08_reading_metrics",
    "09_precise_scorer",
    "10_capstone",
    "11_hybrid_hit",
)
L0, L1, L2, L3, L4, L5, L6, L7, L8, L9, L10, L11 = LAB_NAMES
MISTAKES = [
    Mistake(L0, NoCausalMask, kv_cache.CAUSAL, ["appended after it", "-inf"]),
    Mistake(L0, CausalFromTheTopLeft, kv_cache.ATTENDS, ["is_causal=True", "top-left"]),
    Mistake(L0, RepeatsKNotV, kv_cache.GQA, ["RuntimeError", "K and V alike"]),
    Mistake(L0, TilesKVHeads, kv_cache.GQA, ["h % 3", "repeat_interleave(3, dim=1)"]),
    Mistake(L0, OverwritesTheCache, kv_cache.KEEPS, ["(1, 2, 4)", "torch.cat((self.k, k))"]),
    Mistake(L0, ScalesByHeadDim, kv_cache.ATTENDS, ["1 / head_dim", "head_dim ** -0.5"]),
    Mistake(L1, FreesOnFirstDecref, allocator.LAST_REF, ["a.incref(0)", "still has 1 reference"]),
    Mistake(L1, AllowsDoubleFree, allocator.DOUBLE_FREE, ["a.decref(0)", "ValueError"]),
    Mistake(L1, LosesUncachedBlocks, allocator.CONSERVED, ["a.uncache(0)", "num_free=1"]),
    Mistake(L1, EvictsMostRecentlyUsed, allocator.LRU, ["least recently used first, are [1, 0]"]),
    Mistake(L1, RevivedBlockStaysCached, allocator.ONE_STATE, ["take it out of `cached`"]),
    Mistake(L1, EvictsBeforeUsingFreeBlocks, allocator.FREE_FIRST, ["while blocks [1] were free"]),
    Mistake(L2, ignores_parent, hashing.CHAINED, ["block_keys([1, 2, 5, 6], 2, None)[1] =="]),
    Mistake(L2, ignores_salt, hashing.SALTED, ["'tenant-a'"]),
    Mistake(L2, joins_digits, hashing.DISTINCT, ['"1"+"23" == "12"+"3"']),
    Mistake(
        L2, keys_the_partial_block, hashing.FULL_BLOCKS, ["len(block_keys([1], 2, None)) == 1"]
    ),
    Mistake(
        L2,
        hashes_the_sum,
        hashing.DISTINCT,
        ["block_keys([1, 2], 2, None)[0] == block_keys([2, 1]"],
    ),
    Mistake(L3, per_tensor_scale, int8.BOUND, ["every token and head got the same scale"]),
    Mistake(
        L3, per_tensor_scalar, int8.SHAPES, ["scale.shape == ()", "one scale per token per KV"]
    ),
    Mistake(L3, truncates, int8.BOUND, ["round to nearest", "x = torch.tensor([[["]),
    Mistake(L3, overflows, int8.BOUND, ["overflows int8"]),
    Mistake(L3, float16_scale, int8.BOUND, ["underflowed to 0"]),
    Mistake(L4, oldest_admitted, victim.NEWEST, ["chose request 0", "Expected: request 1"]),
    Mistake(L4, ignores_priority, victim.PRIORITY, ["chose request 1 (priority 1"]),
    Mistake(L4, latest_arrival, victim.NEWEST, ["arrival_s never changes"]),
    Mistake(L4, highest_priority, victim.PRIORITY, ["larger `priority` is more important"]),
    Mistake(L4, sorts_in_place, victim.UNCHANGED, ["don't pop or remove it"]),
    Mistake(L4, returns_request_id, victim.RETURNS_ONE, ["not its index or request_id"]),
    Mistake(
        L5,
        keeps_a_block_too_many,
        rollback.ENDS,
        ["kept 3 blocks, but the table has only 2", "exactly at a block boundary"],
    ),
    Mistake(L5, keeps_a_block_too_few, rollback.KEEPS_KEPT, ["positions 8..9", "round up"]),
    Mistake(L5, frees_shared_blocks, rollback.SHARED, ["block 12 is freed, but its ref count"]),
    Mistake(L5, forgets_to_rewind, rollback.REWOUND, ["num_computed == 7", "Expected: 5"]),
    Mistake(
        L5, frees_accepted_drafts, rollback.KEEPS_KEPT, ["accepted drafts are real tokens now"]
    ),
    Mistake(L6, releases_partial_blocks, window.IN_WINDOW, ["block 1 (positions 4..7)", "partly"]),
    Mistake(L6, keeps_one_token_too_many, window.OUTSIDE, ["Expected: release [0, 1]"]),
    Mistake(L6, ignores_sinks, window.SINKS, ["the first 4 tokens stay"]),
    Mistake(L6, rounds_sinks_down, window.SINKS, ["ceil_div(sinks, block_size)"]),
    Mistake(L6, releases_dropped_blocks, window.TWICE, ["table[1] is DROPPED"]),
    Mistake(L7, EvictsTheMostRecent, tier.LRU, ["evicted 'c'", "popitem(last=False)"]),
    Mistake(L7, HitDoesNotPromote, tier.PROMOTES, ["tier.get('a', 'tenant-a')", "move_to_end"]),
    Mistake(L7, ServesAnySalt, tier.SALTED, ["stored under salt 'tenant-a'"]),
    Mistake(L7, RefusalCountedAsMiss, tier.COUNTED, ["misses=1, refused=0", "refused, not"]),
    Mistake(L7, EvictsBeforeFull, tier.BOUND, ["the tier held 2 of 3", "not full yet"]),
    Mistake(L7, ExceedsItsBound, tier.BOUND, ["holds 4 entries", "capacity 3"]),
    Mistake(L7, LosesEvictedEntries, tier.DEMOTES, ["lost, not demoted"]),
    Mistake(
        L7,
        RePutKeepsItsPlace,
        tier.PROMOTES,
        ["tier.put('a', 'tenant-a', 'kv-a')", "keeps its place"],
    ),
    Mistake(L8, parse_takes_the_last_number, metrics.VALUES, ["1796122440221", "timestamp"]),
    Mistake(L8, parse_splits_labels_on_commas, metrics.LABELS, ["closing unescaped"]),
    Mistake(L8, parse_drops_total, metrics.NAMES, ["'vllm:prefix_cache_queries_total'"]),
    Mistake(L8, rate_from_totals, metrics.DELTAS, ["the totals since the server started"]),
    Mistake(L8, rate_per_request, metrics.PER_QUERY, ["hit tokens / 3 requests"]),
    Mistake(L8, rate_divides_by_zero, metrics.EMPTY, ["ZeroDivisionError", "# the interval: no"]),
    Mistake(L8, rate_blames_sharing, metrics.ZERO, ['enable_prefix_caching="False"']),
    Mistake(L8, preemptions_from_histogram_sum, metrics.PREEMPTED, ["still running"]),
    Mistake(L8, preemptions_usage_in_percent, metrics.KV_USAGE, ["already a fraction"]),
    Mistake(L8, preemptions_total_not_delta, metrics.PREEMPTED, ["since the server started"]),
    Mistake(L9, CountsBlocksPastAGap, scorer.GAP, ["s.score([1, 9, 3, 4], ['r0'])"]),
    Mistake(L9, RemovesFromEveryReplica, scorer.REMOVED, ["r1 still holds block 3"]),
    Mistake(L9, ClearsEveryReplica, scorer.CLEARED, ["r1 did not reset"]),
    Mistake(L9, ScoresOnlyReplicasSeen, scorer.RETURNS, ["s.score([1, 2, 3], ['r0', 'r1', 'r2'])"]),
    Mistake(L10, LeaksAFreedBlock, capstone.CONSISTENT, ["!= total 26", "lab 1"]),
    Mistake(L10, NeverReusesFreedBlocks, capstone.CONSISTENT, ["OutOfBlocks", "must be reusable"]),
    Mistake(L10, ignores_parent, capstone.TOKENS, ["parent's key (lab 2)", "b1-again"]),
    Mistake(L10, ignores_salt, capstone.CONSISTENT, ["shared across salts", "'tenant-x'"]),
    Mistake(L10, EvictsMostRecentlyUsed, capstone.HITS, ["least recently used cached one"]),
    Mistake(L10, highest_priority, capstone.PREEMPTIONS, ["your choose_victim chose", "(lab 4)"]),
    Mistake(
        L11,
        min_of_each_groups_hit,
        hybrid_hit.WINDOW,
        ["group 1 serves a hit of 6 blocks but not one of 4", "ask every window again"],
    ),
    Mistake(
        L11,
        one_pass_over_the_windows,
        hybrid_hit.WINDOW,
        ["group 0 (window 32) lacks block 3", "until none moves it"],
    ),
    Mistake(L11, needs_whole_window_blocks, hybrid_hit.LONGEST, ["ceil(16 / 16) = 1 block"]),
    Mistake(L11, scans_windows_left_to_right, hybrid_hit.LONGEST, ["from the hit's end leftwards"]),
    Mistake(L11, asks_past_the_bound, hybrid_hit.ASKS, ["asked cached(0, 6)"]),
]


def of(lab: str) -> list[Mistake]:
    return [m for m in MISTAKES if m.lab == lab]


# The names each lab's grader cell reads from the exercise cell, bound to a mistake.
BINDINGS = {
    L0: "LabKVCache = {name}",
    L1: "LabBlockAllocator = {name}",
    L2: "block_keys = {name}",
    L3: "quantize_int8, dequantize_int8 = {name}, dequantize",
    L4: "choose_victim = {name}",
    L5: "rollback = {name}",
    L6: "release_blocks = {name}",
    L7: "LabHostTier = {name}",
    L8: "parse_metrics, hit_rate, preemptions = {answer}",
    L9: "LabScorer = {name}",
    L10: "make_allocator, block_keys, choose_victim = {answer}",
    L11: "cross_group_hit = {name}",
}
L8_ROLES = (
    "parse_",
    "rate_",
    "preemptions_",
)  # a lab 8 mistake replaces the function of its prefix


def answer(mistake: Mistake) -> tuple:
    """What the lab's grader is called with: the mistake, with right parts beside it."""
    if mistake.lab == L3:
        return mistake.code, dequantize
    if mistake.lab == L8:
        right = [parse_metrics, hit_rate, preemptions]
        role = next(i for i, p in enumerate(L8_ROLES) if mistake.name.startswith(p))
        right[role] = mistake.code
        return tuple(right)
    if mistake.lab == L10:  # the mistake in its part's place, kvlab's own parts beside it
        right = [BlockAllocator, kvlab_block_keys, kvlab_choose_victim]
        params = [] if inspect.isclass(mistake.code) else inspect.signature(mistake.code).parameters
        right[0 if not params else 1 if "tokens" in params else 2] = mistake.code
        return tuple(right)
    return (mistake.code,)


IMPORTS = """\
import hashlib
import re
from collections import OrderedDict

import torch

from kvlab.cache import BlockAllocator, OutOfBlocks
from kvlab.cache.retention import DROPPED
from kvlab.engine.scheduler import choose_victim as kvlab_choose_victim
from kvlab.labs import kvlab_block_keys
from kvlab.units import ceil_div
"""


def submission(mistake: Mistake) -> str:
    """The exercise cell of a learner whose answer is `mistake`: self-contained code."""
    parts = [IMPORTS, inspect.getsource(mistake.code)]
    if mistake.lab == L3:
        parts.append(inspect.getsource(dequantize))
    if mistake.lab in (L0, L7):  # the right answer the mistake changes one method of
        parts.insert(1, inspect.getsource(KVCacheAnswer if mistake.lab == L0 else TierAnswer))
    if mistake.lab == L9:
        parts.insert(1, inspect.getsource(ScorerAnswer))
    if mistake.lab == L8:  # the right functions, the mistake bound in place of its own
        helpers = (read_line, sample_lines, delta, caching_off, usage_after)
        helpers += (parse_metrics, hit_rate, preemptions)
        parts[1:1] = [inspect.getsource(fn) for fn in helpers]
    names = ", ".join(  # kvlab's victim rule is imported under another name
        "kvlab_choose_victim" if fn is kvlab_choose_victim else fn.__name__
        for fn in answer(mistake)
    )
    parts.append(BINDINGS[mistake.lab].format(name=mistake.name, answer=names) + "\n")
    return "\n\n".join(part.strip("\n") for part in parts) + "\n"
