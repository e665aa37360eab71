"""A ledger of what every physical KV slot of an engine holds, kept from outside the engine.

The ledger watches the pool's operations (`write` at layer 0, `copy`, `read`, `restore`,
`discard`, `poison`) and the engine's forward, and records for every slot the *identity*
of the K/V written there: the KV cache group whose layers wrote it (0 but in a hybrid
cache, kvlab.cache.hybrid: a group's first layer writes pool layer 0), the salt and the
token prefix up to and including that token (a token's K/V depends on every token before
it). A prefix is named by an interned id (`Prefixes`), so identities compare in O(1).
Swap-out copies, tier saves and tier loads carry identities along with the stored codes.

`check()` then compares the ledger with what the engine believes, in every KV cache
group (one but in a hybrid cache):
- every computed position of every running sequence's table holds that sequence's own
  prefix, written by that group's layers (so a prefix hit never lands on a block holding
  other tokens, or another group's K/V);
- every block the prefix index names holds the prefix its entry names, and that prefix
  is verified (prompt and emitted tokens: never a drafted token);
- no table holds a block past its computed tokens (a speculative rollback returns them);
- a hybrid cache's block is in one group's tables and index at most, a full group drops
  nothing, and a sliding group of W tokens drops block i only once its window no longer
  reaches it: (i + 1) * block_size <= num_computed - W + 1.
"""

from __future__ import annotations

from kvlab.cache.prefix.hash import HashPrefixIndex
from kvlab.cache.retention import DROPPED
from kvlab.integrity import require


class Prefixes:
    """Interned token prefixes: one int per (salt, tokens), made from its parent's id and
    its last token, so a prefix of length L costs one entry, not L tokens."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}  # ("root", salt) or (parent id, token) -> id
        self.nodes: list[tuple] = []  # id -> (salt, parent id or None, token, length)

    def _intern(self, key: tuple, node: tuple) -> int:
        if key not in self.ids:
            self.ids[key] = len(self.nodes)
            self.nodes.append(node)
        return self.ids[key]

    def root(self, salt) -> int:
        return self._intern(("root", salt), (salt, None, None, 0))

    def child(self, parent: int, token: int) -> int:
        salt, _, _, length = self.nodes[parent]
        return self._intern((parent, token), (salt, parent, token, length + 1))

    def walk(self, start: int, tokens) -> list[int]:
        """Ids of `start` extended by tokens[:1], tokens[:2], ..."""
        ids = []
        for token in tokens:
            start = self.child(start, token)
            ids.append(start)
        return ids

    def find(self, salt, tokens) -> int | None:
        """The id of (salt, tokens) if it was ever interned, else None."""
        pid = self.ids.get(("root", salt))
        for token in tokens:
            if pid is None:
                return None
            pid = self.ids.get((pid, token))
        return pid

    def tail(self, pid: int, count: int) -> list[int]:
        """The ids of the last `count` prefixes ending at `pid`, oldest first."""
        ids = []
        while len(ids) < count and self.nodes[pid][1] is not None:
            ids.append(pid)
            pid = self.nodes[pid][1]
        return ids[::-1]

    def describe(self, held: tuple[int, int] | None) -> str:
        """What a slot holds: (group, prefix id), or None."""
        if held is None:
            return "nothing known (never written, poisoned or rolled back)"
        group, pid = held
        salt, _, token, length = self.nodes[pid]
        return f"token {token} after {length - 1} tokens (salt {salt!r}, group {group})"


class BlockLedger:
    """What each pool slot holds (see the module docstring). Attach once per engine."""

    def __init__(self, engine):
        self.engine = engine
        self.prefixes = Prefixes()
        self.slots: dict[int, tuple | None] = {}  # slot -> (group, prefix id) (None: unknown)
        self.stored: dict[int, tuple] = {}  # id(StoredKV) -> what its slots held, in order
        self.keyed: dict[bytes, tuple] = {}  # tier key -> what its block's slots held
        self.verified: set[int] = set()  # prefix ids of verified tokens
        self.chains: dict[int, list[int]] = {}  # request id -> ids of its verified tokens
        self.names: dict[bytes, int] = {}  # hash key of a verified full block -> prefix id
        self._pending: list[int] | None = None  # the forward's rows' ids, in order
        self._layer_read: tuple = ()
        # The groups whose layers write pool layer 0, in the order a forward runs them
        layers = getattr(engine.runner, "kv_layers", [(0, 0)])
        self._writers = [group for group, pool_layer in layers if pool_layer == 0]
        self._writes = 0  # layer-0 writes of this forward so far
        self._wrap(engine)

    # --- watching ----------------------------------------------------------------------
    def _wrap(self, engine) -> None:
        pool, forward = engine.cache.pool, engine._compute

        def forward_rows(batch):
            self._pending, self._writes = self._rows(batch), 0
            try:
                return forward(batch)
            finally:
                self._pending = None

        engine._compute = forward_rows
        speculator = engine.speculator
        if speculator is not None:  # drafting runs inside _compute, and changes the rows
            drafting = speculator.draft

            def draft(batch):
                self._pending = None  # a draft model's writes: overwritten by the target's
                drafting(batch)
                self._pending = self._rows(batch)

            speculator.draft = draft
        release = getattr(engine.cache, "_release", None)
        if release is not None:  # a sequence leaving indexes its tokens, accepted drafts
            # emitted in its last step among them: they are verified from then on

            def released(seq):
                self.chain(seq)
                return release(seq)

            engine.cache._release = released
        self._after(getattr(pool, "local", pool), "write", self._write)  # tp: rank 0's own
        self._after(pool, "copy", self._copy)
        self._after(pool, "read", self._read)
        self._after(pool, "read_layer", self._read_layer)
        self._after(pool, "restore", self._restore)
        self._after(pool, "restore_layer", self._restore_layer)
        self._after(pool, "discard", self._forget)
        self._after(pool, "poison", self._forget)
        connector = getattr(engine.cache, "connector", None)
        if connector is not None:
            self._watch_tiers(connector)

    def _rows(self, batch) -> list[int]:
        """The ids of the tokens a forward of `batch` writes, row by row."""
        pending = []
        for seq, n in batch:
            chain = self.chain(seq)
            start = seq.num_computed
            ids = chain + self.prefixes.walk(chain[-1], seq.draft_ids)
            pending += ids[start : start + n]
        return pending

    @staticmethod
    def _after(obj, name: str, record) -> None:
        """Call `record(*args, result=...)` after each call of `obj.name`."""
        original = getattr(obj, name)

        def wrapped(*args):
            result = original(*args)
            record(*args, result=result)
            return result

        setattr(obj, name, wrapped)

    def _write(self, layer, slots, k, v, result=None) -> None:
        if layer != 0:
            return
        slots = slots.tolist()
        group = self._writers[self._writes % len(self._writers)]
        self._writes += 1
        ids = [None] * len(slots) if self._pending is None else self._pending  # None: a
        # draft model's own forward (speculation "layers"), overwritten by the target's
        require(len(ids) == len(slots), "ledger: a forward wrote other rows than it ran")
        for slot, pid in zip(slots, ids):
            self.slots[slot] = None if pid is None else (group, pid)

    def _copy(self, source, target, result=None) -> None:
        for s, t in zip(source.tolist(), target.tolist()):
            self.slots[t] = self.slots.get(s)

    def _read(self, slots, result=None) -> None:
        self.stored[id(result)] = tuple(self.slots.get(s) for s in slots.tolist())

    def _read_layer(self, layer, slots, result=None) -> None:
        if layer == 0:
            self._layer_read = tuple(self.slots.get(s) for s in slots.tolist())

    def _restore(self, slots, saved, result=None) -> None:
        ids = self.stored.get(id(saved))
        for i, slot in enumerate(slots.tolist()):
            self.slots[slot] = None if ids is None else ids[i]

    def _restore_layer(self, layer, slots, saved, result=None) -> None:
        if layer == 0:
            self._restore(slots, saved)

    def _forget(self, slots, result=None) -> None:
        for slot in slots.tolist():
            self.slots[slot] = None

    def _watch_tiers(self, connector) -> None:
        """A tier save carries the saved block's ids under its key; a load brings them."""
        stack, wait_for_save, get = connector.stack, connector.wait_for_save, connector.stack.get

        def saving():
            for block, key, *_ in connector._bound.saves:
                slots = connector.cache.block_slots([block]).tolist()
                self.keyed[key] = tuple(self.slots.get(s) for s in slots)
            return wait_for_save()

        def fetched(key, salt):
            stored, tier = get(key, salt)
            if stored is not None:
                self.stored[id(stored)] = self.keyed.get(key)
            return stored, tier

        connector.wait_for_save, stack.get = saving, fetched

    # --- what the engine should hold ---------------------------------------------------
    def chain(self, seq) -> list[int]:
        """Prefix ids of `seq`'s verified tokens (extended as it emits), starting with its
        salt's root, so chain[p] names tokens [0, p) and chain[p + 1] includes token p."""
        chain = self.chains.setdefault(seq.request_id, [self.prefixes.root(seq.salt)])
        tokens = seq.token_ids
        if len(chain) <= len(tokens):
            new = self.prefixes.walk(chain[-1], tokens[len(chain) - 1 :])
            chain += new
            self.verified.update(new)
            self._name_blocks(seq, chain)
        return chain[1:]

    def _name_blocks(self, seq, chain: list[int]) -> None:
        index = getattr(self.engine.cache, "index", None)
        if not isinstance(index, HashPrefixIndex):
            return
        bs, tokens = index.block_size, seq.token_ids
        for i, key in enumerate(index.keys(tokens, seq.salt)):
            self.names.setdefault(key, chain[(i + 1) * bs])

    def check(self) -> None:
        """Raise IntegrityError if a table or a prefix index disagrees with the ledger."""
        engine = self.engine
        cache, s = engine.cache, engine.scheduler
        for seq in s.waiting + s.swapped:
            self.chain(seq)
        windows = _windows(cache)
        owner: dict[int, int] = {}  # block -> the group whose tables or index hold it
        for seq in s.running:
            for g, table in enumerate(cache.group_tables(seq)):
                self._check_table(cache, seq, g, table)
                if windows is not None:
                    self._check_drops(cache, seq, g, table, windows[g])
                self._claim(owner, g, table, f"request {seq.request_id}'s table")
        for g, index in enumerate(_indexes(cache)):
            if index is None:
                continue
            for block, pid in self._indexed(index):
                self._check_indexed(cache, g, block, pid)
                self._claim(owner, g, [block], "prefix index")

    def _check_table(self, cache, seq, g: int, table: list[int]) -> None:
        """Every computed position of `seq` in group g's table holds its own token, written
        by that group; the table ends with its computed tokens."""
        chain, bs = self.chain(seq), cache.block_size
        require(
            cache.name == "naive" or len(table) * bs < seq.num_computed + bs,
            f"ledger: request {seq.request_id} holds a block past its {seq.num_computed} "
            f"computed tokens ({len(table)} blocks of {bs}, group {g})",
        )
        for p in range(seq.num_computed):
            block = table[p // bs]
            if block == DROPPED:
                continue
            slot = block * bs + p % bs
            require(
                self.slots.get(slot) == (g, chain[p]),
                f"ledger: position {p} of request {seq.request_id} is in slot {slot} (group "
                f"{g}), which holds {self.prefixes.describe(self.slots.get(slot))}, not its "
                f"own token {seq.token_ids[p]} after {p} tokens",
            )

    @staticmethod
    def _check_drops(cache, seq, g: int, table: list[int], window: int | None) -> None:
        """A full group (window None) drops nothing; a sliding group drops block i only
        once its window of W tokens no longer reaches it: the next query, at position
        num_computed, reads from num_computed - W + 1 on."""
        bs, rid = cache.block_size, seq.request_id
        for i, block in enumerate(table):
            if block != DROPPED:
                continue
            require(
                window is not None,
                f"ledger: full-attention group {g} dropped block {i} of request {rid}",
            )
            require(
                (i + 1) * bs <= seq.num_computed - window + 1,
                f"ledger: group {g} (window {window}) dropped block {i} of request {rid}, "
                f"which its window still reaches ({seq.num_computed} computed tokens, "
                f"blocks of {bs})",
            )

    @staticmethod
    def _claim(owner: dict[int, int], g: int, blocks: list[int], where: str) -> None:
        """Record that group g holds `blocks`; no block is held by two groups at once."""
        for block in blocks:
            if block != DROPPED:
                held = owner.setdefault(block, g)
                require(held == g, f"ledger: block {block} is in group {held}'s tables or "
                                   f"index and in group {g}'s {where}")  # fmt: skip

    def _indexed(self, index) -> list[tuple[int, int]]:
        """(block, prefix id of its last token) for every block the index names."""
        if isinstance(index, HashPrefixIndex):
            entries = []
            for key, block in index.block_of.items():
                require(
                    key in self.names,
                    f"ledger: the prefix index names block {block} under a key no verified "
                    "prefix has (a drafted or unknown token is indexed)",
                )
                entries.append((block, self.names[key]))
            return entries
        entries, stack = [], [(root, (), salt) for salt, root in index.roots.items()]
        while stack:
            node, prefix, salt = stack.pop()
            for child in node.children.values():
                tokens = prefix + child.tokens
                pid = self.prefixes.find(salt, tokens)
                require(
                    pid in self.verified,
                    f"ledger: the radix index names block {child.block} for tokens no "
                    f"verified prefix has (a drafted or unknown token is indexed): salt "
                    f"{salt!r}, {len(tokens)} tokens, verified up to "
                    f"{self._verified_length(salt, tokens)}, ending {list(tokens[-4:])}",
                )
                entries.append((child.block, pid))
                stack.append((child, tokens, salt))
        return entries

    def _verified_length(self, salt, tokens) -> int:
        """How many of `tokens` (after `salt`) form a verified prefix."""
        for n in range(len(tokens), 0, -1):
            if self.prefixes.find(salt, tokens[:n]) in self.verified:
                return n
        return 0

    def _check_indexed(self, cache, g: int, block: int, pid: int) -> None:
        bs = cache.block_size
        length = self.prefixes.nodes[pid][3]
        ids = self.prefixes.tail(pid, length - (length - 1) // bs * bs)
        for offset, want in enumerate(ids):
            slot = block * bs + offset
            require(
                self.slots.get(slot) == (g, want),
                f"ledger: block {block} of group {g}'s index, slot {offset}, holds "
                f"{self.prefixes.describe(self.slots.get(slot))}, not the token its entry names",
            )


def _windows(cache) -> list[int | None] | None:
    """Each KV cache group's window (None: full attention), or None where the cache has no
    groups (a retention policy decides what a paged cache drops: the fuzz checks it)."""
    return None if cache.groups is None else [group.window for group in cache.groups]


def _indexes(cache) -> list:
    """Each KV cache group's prefix index (None: no prefix caching)."""
    parts = cache.parts if cache.groups is not None else [cache]
    return [getattr(part, "index", None) for part in parts]
