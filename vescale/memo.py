"""Bounded decision tables: the one memo mechanism of vescale's caches.

A decision that depends only on a key (an op call's layout and sizes, a spec and a rank's mesh
coordinate, a scalar's type) is worked out once and read afterwards. Keys hold global shapes, so a
program that keeps making new shapes would grow a table without bound: at ``limit`` entries the
table empties and relearns (an entry is cheap to remake, and a model uses a few hundred). A key that
does not hash (symbolic sizes while tracing) is decided every time. What an entry means, and how it
was checked before it was stored, is the owning cache's business (docs/dispatch.md).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Iterator

__all__ = ["Memo"]


class Memo:
    """A dict of decisions, emptied when it reaches ``limit`` entries; writes hold a lock."""

    __slots__ = ("name", "limit", "_entries", "_lock")

    def __init__(self, name: str, limit: int):
        self.name = name  # what the entries are, for reports
        self.limit = limit
        self._entries: dict = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The entry for ``key``, else ``default`` (also for a key that does not hash)."""
        try:
            return self._entries.get(key, default)
        except TypeError:  # symbolic sizes: not hashable
            return default

    def put(self, key: Hashable, value: Any) -> Any:
        """Store ``value`` for ``key`` (emptying the table first at the limit); returns ``value``.
        A key that does not hash is not stored."""
        with self._lock:
            if len(self._entries) >= self.limit:
                self._entries.clear()
            try:
                self._entries[key] = value
            except TypeError:
                pass
        return value

    def get_or_make(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The entry for ``key``, made by ``make()`` and stored on the first call."""
        found = self.get(key)
        return self.put(key, make()) if found is None else found

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def values(self) -> Iterator[Any]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return self.get(key) is not None

    def __repr__(self) -> str:
        return f"Memo({self.name!r}, {len(self._entries)}/{self.limit} entries)"
