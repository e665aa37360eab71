"""Tier policies, registered: when blocks are written down, and when they come back up.

Write policies (`TierConfig.write`):

- "write-back": a block is copied down only when the device evicts it (the device copy is
  the only one until then); a tier's own evictions cascade to the next tier.
- "write-through": every full block is copied into every tier as soon as its request
  releases it; an eviction then costs no copy (the block is already below).

Load policies (`TierConfig.load`):

- "promote-on-hit": a request's blocks are loaded back when it is admitted.
- "prefetch-on-queue": as soon as a request is queued (each step, for arrived waiting
  requests), its blocks on disk are read into host memory, and its host blocks are loaded
  into *free* device blocks (never evicting for it); admission then finds them on device.
"""

from __future__ import annotations

from kvlab.registry import Registry


class WritePolicy:
    name: str | None = None  # set by WRITE_POLICIES.register
    describe: str = ""
    on_release: bool = False  # save a released request's blocks into every tier


class LoadPolicy:
    name: str | None = None  # set by LOAD_POLICIES.register
    describe: str = ""
    prefetch: bool = False  # pull queued requests' blocks up before admission


WRITE_POLICIES: Registry[type[WritePolicy]] = Registry("tier write policy", "tiers.write")
LOAD_POLICIES: Registry[type[LoadPolicy]] = Registry("tier load policy", "tiers.load")


@WRITE_POLICIES.register("write-back")
class WriteBack(WritePolicy):
    describe = "copy a block down when the device evicts it"


@WRITE_POLICIES.register("write-through")
class WriteThrough(WritePolicy):
    describe = "copy every full block into every tier when its request releases it"
    on_release = True


@LOAD_POLICIES.register("promote-on-hit")
class PromoteOnHit(LoadPolicy):
    describe = "load a request's tier blocks into the device when it is admitted"


@LOAD_POLICIES.register("prefetch-on-queue")
class PrefetchOnQueue(LoadPolicy):
    describe = "while a request waits: disk -> host, and host -> free device blocks"
    prefetch = True
