"""A table filled once, at import, by decorators: FLOP formulas, shape rules, the bridge's
converters and gradients. A key registered twice is an error naming both entries, so two
modules can never silently disagree about which one runs."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def describe(value: Any) -> str:
    """``module.qualname`` of a function (or of the function a registered entry holds)."""
    fn = getattr(value, "fn", value)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class Registry(Generic[K, V]):
    """``key -> value``, each key once; read like a mapping."""

    def __init__(self, what: str) -> None:
        self.what = what  # "converter", "gradient", ...: named in errors
        self._entries: dict[K, V] = {}

    def add(self, entries: dict[K, V]) -> None:
        """Register every entry, or none of them if any key is taken."""
        for key, value in entries.items():
            if key in self._entries:
                raise ValueError(
                    f"a second {self.what} for {key}: {describe(value)} and {describe(self._entries[key])}"
                )
        self._entries.update(entries)

    def __setitem__(self, key: K, value: V) -> None:
        """Deliberately put ``value`` over ``key``'s entry (a test's or a user's override)."""
        self._entries[key] = value

    def __delitem__(self, key: K) -> None:
        del self._entries[key]

    def decorator(self, *keys: K, wrap: Callable[[Callable], V] | None = None) -> Callable[[Callable], Callable]:
        """``@registry.decorator(k1, k2)``: the decorated function (or ``wrap(fn)``) under each key."""

        def register(fn: Callable) -> Callable:
            value = wrap(fn) if wrap is not None else fn
            self.add({key: value for key in keys})  # type: ignore[misc]  # without wrap, V is the function type
            return fn

        return register

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._entries.get(key, default)

    def __getitem__(self, key: K) -> V:
        return self._entries[key]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[K, V]]:
        return list(self._entries.items())

    def values(self) -> list[V]:
        return list(self._entries.values())
