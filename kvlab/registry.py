"""Registries: the named variants of one kind of engine part, each a class in a file.

    CODECS = Registry("KV codec", "kv_codec")

    @CODECS.register("int8")
    class Int8(TokenCodec): ...

A new cache, codec, prefix index (and, as they come, proposer, tier or policy) is one file
that registers its class; `EngineConfig` validation, the cache factory, the CLI's help,
`kvlab compare`'s config names and the planner read the registries, so nothing else
changes. Each class carries its capabilities as class attributes (what a cache can share,
a codec's alignment and kernel, ...), documented on the interface it implements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> registered classes of one kind. `field` is the EngineConfig field naming one."""

    def __init__(self, kind: str, field: str):
        self.kind, self.field = kind, field
        self._parts: dict[str | None, T] = {}

    def register(self, name: str | None) -> Callable[[T], T]:
        """Class decorator: register the class under `name` (sets its `name` attribute)."""

        def add(part: T) -> T:
            if name in self._parts:
                raise ValueError(f"{self.kind} {name!r} is registered already")
            part.name = name
            self._parts[name] = part
            return part

        return add

    def unregister(self, name: str | None) -> None:
        """Forget a part (tests that register their own clean up with this)."""
        del self._parts[name]

    def __getitem__(self, name: str | None) -> T:
        if name not in self._parts:
            raise ValueError(
                f"EngineConfig.{self.field}={name!r} is unknown; choose one of {self.names()}"
            )
        return self._parts[name]

    def __contains__(self, name: object) -> bool:
        return name in self._parts

    def __iter__(self) -> Iterator[str | None]:
        return iter(self._parts)

    def names(self) -> tuple:
        """Registered names, in registration order (None, the default, excluded)."""
        return tuple(n for n in self._parts if n is not None)

    def items(self) -> list[tuple[str | None, T]]:
        return list(self._parts.items())
