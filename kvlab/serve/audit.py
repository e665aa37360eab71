"""A tenant audit of the engine's block tables: did any KV block pass between tenants?

Counters say how many prompt tokens hit the prefix cache, not whose blocks they hit. The
audit reads the block tables themselves (every KV cache group's), after every engine step (an
after_step observer on the engine loop's thread, so it sees every table a request ever had):

- a block in the tables of two tenants' requests at once is a cross-tenant share;
- a request admitted with prefix hits (its first ceil(hits / block_size) table entries
  came from the prefix index) whose hit block another tenant's request wrote is a
  cross-tenant hit.

The writer of a hit block is another request holding it in the same step (the index
hands out a block while its writer computes it), or else the last request the audit saw
holding it: a writer holds its block for at least the step that computes it. The tenant
of a request is the first element of its salt (kvlab.serve.tenants.engine_salt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvlab.build import Engine


def tenant_of(salt: str | None) -> str | None:
    """The tenant part of an engine salt made by `engine_salt` (None: no tenant; an open
    server's salt is the request's cache_salt itself)."""
    if salt is None or not salt.startswith("["):
        return None
    try:
        pair = json.loads(salt)
    except ValueError:
        return None
    return pair[0] if isinstance(pair, list) and len(pair) == 2 else None


@dataclass
class TenantAudit:
    steps: int = 0
    admissions: int = 0  # (re)admissions seen
    hit_admissions: int = 0  # of those, with prefix hits
    hit_blocks: int = 0  # hit blocks whose last holder was checked
    cross_tenant_hits: int = 0  # hit blocks last held by another tenant
    cross_tenant_shares: int = 0  # blocks in two tenants' tables at once
    findings: list[str] = field(default_factory=list)  # each cross-tenant hit or share
    _last: dict[int, str | None] = field(default_factory=dict)  # block -> last tenant
    _present: set[int] = field(default_factory=set)  # request ids in the tables last step

    def install(self, engine: Engine) -> TenantAudit:
        """Audit `engine` after each of its steps (call before its loop starts)."""
        engine.observers.subscribe("after_step", lambda finished: self.check(engine))
        return self

    def check(self, engine: Engine) -> None:
        cache, size = engine.cache, engine.cache.block_size
        tables = {rid: cache.group_tables(seq) for rid, seq in cache.sequences.items()}
        holders: dict[int, dict[int, str | None]] = {}  # block -> {request id: tenant}
        for request_id, groups in tables.items():  # a table per KV cache group
            tenant = tenant_of(cache.sequences[request_id].salt)
            for block in (b for table in groups for b in table):
                if block >= 0:
                    holders.setdefault(block, {})[request_id] = tenant
        for request_id in set(tables) - self._present:  # admitted in this step
            self._admitted(request_id, cache.sequences[request_id], tables[request_id], size,
                           holders)  # fmt: skip
        for block, tenants in holders.items():
            if len(set(tenants.values())) > 1:
                self.cross_tenant_shares += 1
                self.findings.append(f"step {self.steps}: block {block} held by {tenants}")
            self._last[block] = next(iter(tenants.values()))
        self._present = set(tables)
        self.steps += 1

    def _admitted(self, request_id: int, seq, tables: list, size: int, holders: dict) -> None:
        """Check the hit blocks of a request (re)admitted in this step (in each of its KV
        cache groups' tables): their writer is another request holding them now (the
        index hands out a block while its writer computes it in the same step), or else
        their last holder."""
        tenant, hit = tenant_of(seq.salt), -(-seq.prefix_hit_tokens // size)
        self.admissions += 1
        self.hit_admissions += hit > 0
        for block in (b for table in tables for b in table[:hit] if b >= 0):
            others = [t for r, t in holders[block].items() if r != request_id]
            writers = others or ([self._last[block]] if block in self._last else [])
            self.hit_blocks += bool(writers)
            if any(writer != tenant for writer in writers):
                self.cross_tenant_hits += 1
                self.findings.append(
                    f"step {self.steps}: request {request_id} of {tenant!r} hit block "
                    f"{block}, written by {sorted(map(str, writers))}"
                )

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
