"""The disk tier: a bounded directory, one file per block, each with a checksum.

A file is one JSON header line (the key, the salt, each stored tensor's name, dtype and
shape, the payload length and a BLAKE2b digest of key + salt + payload) followed by the
tensors' raw bytes. A read checks the length and the digest: a truncated or corrupted file
is deleted and counted (`stats.corrupt`) and the block is recomputed, never served.
The index of what is on disk (and its LRU order) lives in memory; a directory the tier
did not create keeps only the files the tier never wrote.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
import weakref
from collections import OrderedDict
from pathlib import Path

import torch

from kvlab.cache.codecs import StoredKV
from kvlab.cache.tiers.base import Entry, Key, TableTier
from kvlab.cache.tiers.registry import TIERS
from kvlab.integrity import require

SUFFIX = ".kvblock"


def _digest(key: Key, salt: str | None, payload: bytes) -> str:
    digest = hashlib.blake2b(key, digest_size=16)
    digest.update(b"" if salt is None else b"salt:" + salt.encode())
    digest.update(payload)
    return digest.hexdigest()


def encode_block(key: Key, salt: str | None, stored: StoredKV) -> bytes:
    """A block's file contents: a JSON header line, then the raw bytes of every tensor."""
    chunks, fields = [], []
    for name, tensor in stored.tensors.items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        chunks.append(flat.view(torch.uint8).numpy().tobytes())
        fields.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)])
    payload = b"".join(chunks)
    header = {"key": key.hex(), "salt": salt, "fields": fields, "payload": len(payload),
              "blake2b": _digest(key, salt, payload)}  # fmt: skip
    return json.dumps(header).encode() + b"\n" + payload


def decode_block(key: Key, salt: str | None, data: bytes) -> StoredKV | None:
    """The StoredKV a file holds, or None if its header, length or checksum is wrong."""
    try:
        line, payload = data.split(b"\n", 1)
        header = json.loads(line)
        if header["key"] != key.hex() or header["salt"] != salt:
            return None
        if len(payload) != header["payload"] or _digest(key, salt, payload) != header["blake2b"]:
            return None
        tensors, offset = {}, 0
        for name, dtype_name, shape in header["fields"]:
            dtype = getattr(torch, dtype_name)
            count = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            raw = torch.frombuffer(bytearray(payload[offset : offset + count]), dtype=torch.uint8)
            tensors[name] = raw.view(dtype).reshape(shape)
            offset += count
        return StoredKV(tensors) if offset == len(payload) else None
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        return None


@TIERS.register("disk")
class DiskTier(TableTier):
    describe = "a directory, one checksummed file per block, LRU, bounded in blocks"

    def __init__(self, capacity_blocks: int, directory: str | Path | None = None):
        super().__init__(capacity_blocks)
        owned = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="kvlab-disk-tier-") if owned else directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.entries: OrderedDict[Key, tuple[str | None, int]] = OrderedDict()  # salt, bytes
        self._nbytes = 0
        self.owned = owned  # a temporary directory of its own, removed on close
        if owned:
            self._finalizer = weakref.finalize(self, shutil.rmtree, self.directory, True)
        else:
            self._finalizer = weakref.finalize(self, _remove_files, self.directory, self.entries)

    @classmethod
    def from_config(cls, config) -> DiskTier:
        return cls(config.disk_blocks, config.disk_dir)

    def path(self, key: Key) -> Path:
        return self.directory / (key.hex() + SUFFIX)

    def get(self, key: Key, salt: str | None) -> StoredKV | None:
        entry = self._lookup(key, salt)
        if entry is None:
            return None
        start = time.perf_counter()
        try:
            data = self.path(key).read_bytes()
        except OSError:
            data = b""
        stored = decode_block(key, salt, data)
        self.stats.load_s += time.perf_counter() - start
        if stored is None:  # truncated, corrupted or gone: recompute, never serve
            self.stats.corrupt += 1
            self._drop(key)
            return None
        self.entries.move_to_end(key)
        self.stats.loads += 1
        self.stats.bytes_loaded += entry[1]
        return stored

    def put(self, key: Key, salt: str | None, stored: StoredKV) -> list[Entry]:
        if key in self.entries:
            self.entries.move_to_end(key)
            return []
        start = time.perf_counter()
        self.path(key).write_bytes(encode_block(key, salt, stored))
        self.entries[key] = (salt, stored.nbytes)
        self._nbytes += stored.nbytes
        self.stats.saves += 1
        self.stats.bytes_saved += stored.nbytes
        while len(self.entries) > self.capacity_blocks:
            self._drop(next(iter(self.entries)))
            self.stats.evictions += 1
        self.stats.save_s += time.perf_counter() - start
        return []  # the last tier: what it evicts is gone

    def _drop(self, key: Key) -> None:
        _, nbytes = self.entries.pop(key)
        self._nbytes -= nbytes
        self.path(key).unlink(missing_ok=True)

    def discard(self, key: Key) -> bool:
        if key not in self.entries:
            return False
        self._drop(key)
        self.stats.discards += 1
        return True

    def check_integrity(self) -> None:
        require(len(self.entries) <= self.capacity_blocks, "disk tier holds more than its capacity")
        require(
            sum(n for _, n in self.entries.values()) == self._nbytes,
            "disk tier's byte count disagrees with its entries",
        )
        files = {p.name for p in self.directory.glob("*" + SUFFIX)}
        ours = {k.hex() + SUFFIX for k in self.entries}
        require(ours <= files, "a disk-tier entry has no file")
        require(not (files - ours) or not self.owned, "a disk-tier file has no entry (a leak)")

    def close(self) -> None:
        self._finalizer()


def _remove_files(directory: Path, entries) -> None:
    for key in list(entries):
        (directory / (key.hex() + SUFFIX)).unlink(missing_ok=True)
