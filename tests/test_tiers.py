"""The tiers on their own: host LRU, disk files with checksums, salts, the stack, configs."""

from __future__ import annotations

import pytest
import torch

import kvlab
from kvlab.cache import check_config
from kvlab.cache.codecs import StoredKV
from kvlab.cache.tiers import LOAD_POLICIES, TIERS, WRITE_POLICIES, DiskTier, HostTier, TierConfig
from kvlab.cache.tiers.stack import TierStack
from kvlab.integrity import IntegrityError


def stored(seed: int) -> StoredKV:
    """A block's stored codes in several dtypes (codes, scales), (layers, slots, ...)."""
    g = torch.Generator().manual_seed(seed)
    return StoredKV({
        "k0": torch.randn(2, 4, 3, 8, generator=g),
        "k1": torch.randn(2, 4, 3, generator=g).to(torch.bfloat16),
        "v0": torch.randint(-128, 127, (2, 4, 3, 8), generator=g, dtype=torch.int8),
        "v1": torch.randn(2, 4, 3, 8, generator=g).to(torch.float8_e4m3fn),
    })  # fmt: skip


def same(a: StoredKV, b: StoredKV) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(
        a.tensors[n].dtype == b.tensors[n].dtype
        and torch.equal(a.tensors[n].view(torch.uint8), b.tensors[n].view(torch.uint8))
        for n in a.tensors
    )


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_registries_name_the_parts():
    assert TIERS.names() == ("host", "disk")
    assert WRITE_POLICIES.names() == ("write-back", "write-through")
    assert LOAD_POLICIES.names() == ("promote-on-hit", "prefetch-on-queue")


def test_host_tier_is_a_bounded_lru():
    host = HostTier(2)
    assert host.put(key(1), None, stored(1)) == []
    host.put(key(2), None, stored(2))
    assert host.get(key(1), None) is not None  # key 1 becomes most recently used
    [(evicted, salt, codes)] = host.put(key(3), None, stored(3))
    assert evicted == key(2) and salt is None and same(codes, stored(2))
    assert host.keys() == [key(1), key(3)] and host.stats.evictions == 1
    assert host.nbytes == 2 * stored(0).nbytes
    host.check_integrity()
    assert host.discard(key(1)) and not host.discard(key(1))
    assert host.get(key(9), None) is None and host.stats.misses == 1


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_tier_never_serves_another_salt(kind, tmp_path):
    tier = HostTier(4) if kind == "host" else DiskTier(4, tmp_path)
    tier.put(key(1), "tenant-a", stored(1))
    assert tier.get(key(1), "tenant-b") is None
    assert tier.get(key(1), None) is None
    assert tier.stats.salt_refusals == 2
    assert same(tier.get(key(1), "tenant-a"), stored(1))


def test_disk_tier_round_trips_bit_exact_and_evicts_files(tmp_path):
    disk = DiskTier(2, tmp_path)
    for i in range(3):
        disk.put(key(i), "s", stored(i))
    assert disk.keys() == [key(1), key(2)] and disk.stats.evictions == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        k.hex() + ".kvblock" for k in (key(1), key(2))
    )
    assert same(disk.get(key(2), "s"), stored(2))
    disk.check_integrity()
    disk.close()
    assert list(tmp_path.iterdir()) == []  # a given directory keeps no file the tier wrote


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "delete"])
def test_a_damaged_disk_file_is_detected_and_never_served(damage, tmp_path):
    disk = DiskTier(4, tmp_path)
    disk.put(key(1), None, stored(1))
    path = disk.path(key(1))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 7])
    elif damage == "flip":
        data[-3] ^= 0x10
        path.write_bytes(data)
    elif damage == "header":
        data[2] ^= 0x01  # '"key"' becomes '"jey"': the header no longer names its key
        path.write_bytes(data)
    else:
        path.unlink()
    assert disk.get(key(1), None) is None
    assert disk.stats.corrupt == 1 and key(1) not in disk and not path.exists()
    disk.check_integrity()


def test_owned_disk_directory_is_removed_on_close():
    disk = DiskTier(4)
    disk.put(key(1), None, stored(1))
    directory = disk.directory
    assert directory.exists()
    disk.close()
    assert not directory.exists()


def test_stack_cascades_evictions_down_and_spills(tmp_path):
    config = TierConfig(
        tiers=("host", "disk"), host_blocks=2, disk_blocks=3, disk_dir=str(tmp_path)
    )
    stack = TierStack.from_config(config)
    for i in range(4):
        stack.save(key(i), None, stored(i))
    assert stack.blocks() == {"host": 2, "disk": 2}  # keys 0, 1 went down
    assert stack.where(key(0)) == "disk" and stack.where(key(3)) == "host"
    codes, tier = stack.get(key(0), None)
    assert tier == "disk" and same(codes, stored(0))
    assert stack.spill(0) == 2 and stack.blocks() == {"host": 0, "disk": 3}
    assert stack.discard(key(3)) == ["disk"] and key(3) not in stack
    stack.check_integrity()
    stack.close()


def test_integrity_check_catches_a_miscount():
    host = HostTier(2)
    host.put(key(1), None, stored(1))
    host._nbytes += 1
    with pytest.raises(IntegrityError, match="bytes"):
        host.check_integrity()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tiers=()), "empty"),
        (dict(tiers=("host", "host")), "twice"),
        (dict(tiers=("tape",)), "unknown"),
        (dict(host_blocks=0), "host_blocks=0 must be > 0"),
        (dict(write="sometimes"), "TierConfig.write='sometimes' is unknown"),
        (dict(load="never"), "TierConfig.load='never' is unknown"),
    ],
)
def test_tier_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TierConfig(**kwargs)


def test_engine_config_needs_paged_hash_for_tiers():
    with pytest.raises(ValueError, match="prefix_caching='hash'"):
        kvlab.EngineConfig(cache="paged", prefix_caching="radix", tiers=TierConfig())
    with pytest.raises(ValueError, match="cache='paged'"):
        kvlab.EngineConfig(tiers=TierConfig())
    config = kvlab.EngineConfig(cache="paged", prefix_caching="hash", tiers={"tiers": ["host"]})
    with pytest.raises(ValueError, match="must be a kvlab.cache.tiers.TierConfig"):
        check_config(config)  # when an engine is built, before anything else
    with pytest.raises(ValueError, match="session_ttl_s=0 must be > 0"):
        kvlab.EngineConfig(session_ttl_s=0)


def test_swapped_requests_take_room_in_the_host_tier():
    host = HostTier(3)
    for i in range(3):
        host.put(key(i), None, stored(i))
    evicted = host.hold(owner=7, blocks=2)  # a swapped-out request of two blocks
    assert [k for k, _, _ in evicted] == [key(0), key(1)] and host.keys() == [key(2)]
    host.check_integrity()
    host.release(7)
    host.put(key(3), None, stored(3))
    assert host.keys() == [key(2), key(3)] and not host.held
    host.hold(owner=8, blocks=5)  # more than the capacity: never refused, nothing cached stays
    assert host.keys() == [] and host.held == {8: 5}
    host.check_integrity()
