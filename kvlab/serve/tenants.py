"""Who sent a request (its API key's tenant), and the cache namespace it may use.

    kvlab serve --api-key sk-one                   # vLLM's flag: one key, tenant "default"
    kvlab serve --api-keys-file keys.json          # {"sk-alice-...": "alice", ...}
    kvlab serve --api-keys-file keys.json --admin-api-key sk-admin-...   # + the operator

With keys, every /v1 request needs `Authorization: Bearer <key>` (401 otherwise, as
vLLM answers). Each tenant's prompts are hashed with its own salt (`engine_salt`), so
the prefix cache never hands one tenant's KV block to another, whatever they send;
vLLM's `cache_salt` request field splits a tenant further (one user from another). The
tenant part of the salt comes from the key, never from the body, and the pair is
encoded so that no choice of cache_salt can spell another tenant's salt.

Without keys the server is open and tenant-less: every request shares one prefix cache
(unless it sends a cache_salt), as a plain `vllm serve` does.

Admin routes (`POST /reset_prefix_cache`, which forgets every tenant's cached blocks) take
the admin key alone (`--admin-api-key`): a tenant's key gets 403, no key 401. An open
server (no key of either kind) leaves them open, as vLLM's development mode does. A tenant
that wants a cold cache of its own sends a fresh `cache_salt`: a namespace nobody has
filled, with no effect on anyone else.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TENANT = "default"  # the tenant of --api-key


@dataclass(frozen=True)
class Tenants:
    """API keys -> tenant names; empty: no authentication."""

    keys: tuple[tuple[str, str], ...] = ()  # (key, tenant)
    admin_key: str | None = None  # --admin-api-key: the admin routes' key (None: no admin)

    def __post_init__(self) -> None:
        for key, tenant in self.keys:
            if not (isinstance(key, str) and key.strip() and isinstance(tenant, str) and tenant):
                raise ValueError(f"an API key and its tenant must be non-empty strings: {tenant!r}")
        if self.admin_key is not None:
            if not (isinstance(self.admin_key, str) and self.admin_key.strip()):
                raise ValueError("--admin-api-key must be a non-empty string")
            if any(key.strip() == self.admin_key.strip() for key, _ in self.keys):
                raise ValueError("--admin-api-key must differ from every tenant's API key")

    @classmethod
    def from_flags(
        cls, api_key: str | None = None, keys_file: str | None = None, admin_key: str | None = None
    ) -> Tenants:
        """Tenants of `--api-key` (tenant "default") and `--api-keys-file` (a JSON object
        {key: tenant}), and the admin key of `--admin-api-key`."""
        keys = [(api_key, DEFAULT_TENANT)] if api_key else []
        if keys_file:
            try:
                table = json.loads(Path(keys_file).read_text())
            except (OSError, ValueError) as error:
                raise ValueError(f"--api-keys-file {keys_file}: {error}") from None
            if not isinstance(table, dict):
                raise ValueError(f"--api-keys-file {keys_file}: must be a JSON object")
            keys += list(table.items())
        return cls(tuple(keys), admin_key)

    @property
    def required(self) -> bool:
        return bool(self.keys)

    @property
    def guards_admin(self) -> bool:
        """Whether admin routes need the admin key: on any server with a key."""
        return bool(self.keys) or self.admin_key is not None

    def names(self) -> list[str]:
        return sorted({tenant for _, tenant in self.keys})

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer <key>` header; None if it names no key.
        Every key is compared, each in constant time."""
        key = _bearer(authorization)
        if key is None:
            return None
        found = None
        for known, tenant in self.keys:
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        return found

    def is_admin(self, authorization: str | None) -> bool:
        """Whether an `Authorization: Bearer <key>` header holds the admin key."""
        key = _bearer(authorization)
        if key is None or self.admin_key is None:
            return False
        return hmac.compare_digest(self.admin_key.strip().encode(), key.encode())


def _bearer(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def engine_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The engine's cache namespace of a request: None (the shared cache) without tenant
    and cache_salt; the cache_salt itself without a tenant (an open server, as vLLM: its
    block hashes then equal vLLM's for the same cache_salt); otherwise a string no other
    (tenant, cache_salt) pair yields. A keyed server gives every request a tenant, so no
    cache_salt there can spell a tenant's salt."""
    if tenant is None:
        return cache_salt
    return json.dumps([tenant, cache_salt])
