"""The dashboard's heavy answers, kept while the rows they were built from are unchanged.

A study page, a stage tree or a plan's curves at 2,000 trials or 10,000 nodes take hundreds of
milliseconds to read and build, and a researcher opens them again and again (and every open page
refreshes on each change). Each entry is stored with the *version* of what it was built from, a
cheap aggregate query (``ActivityReader.request_version``, ``curve_version``, ``plan_marks_version``;
a plan's node count), and served only while the version read now is equal to it.

Consistency rules:
- the caller reads the version *before* it builds: rows that change during the build are at worst
  newer than the version says, so the next read sees another version and builds again; a stale
  answer is never served for a version it was not built at or after;
- every write that changes what a page shows moves a version (the docstrings of those queries say
  how), so an equal version means the build would give the same answer;
- what a page shows from rows no version covers (the study's sharing stats, a running batch's
  progress) is read fresh on every call, or the answer is not cached (``cacheable=False``).
Entries are few and bounded: when full, the oldest half goes. The dashboard keeps 16 study pages, 16
curve answers and 16 trees: at 2,000 trials a page holds about 4 MB, a curve answer of 20,000 points
3 MB, and a 10,000-node tree 2 MB of JSON, so about 150 MB at most for studies of that size.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class VersionedCache(Generic[V]):
    """key -> (version, value): ``get`` builds the value again when the version moved."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._d: dict[Hashable, tuple[Hashable, V]] = {}
        self._lock = threading.Lock()
        self.builds = 0  # how many times a value was built (tests read it)

    def get(self, key: Hashable, version: Hashable, build: Callable[[], V], cacheable: bool = True) -> V:
        """The value kept for ``key`` at ``version``, else ``build()`` kept at it; with ``cacheable``
        False (what the value shows moves without its version) built each time and not kept."""
        with self._lock:
            got = self._d.get(key)
        if cacheable and got is not None and got[0] == version:
            return got[1]
        value = build()
        with self._lock:
            self.builds += 1
            if not cacheable:
                self._d.pop(key, None)
                return value
            if key not in self._d and len(self._d) >= self.size:
                for k in list(self._d)[: max(1, self.size // 2)]:
                    del self._d[k]
            self._d.pop(key, None)  # the newest last: dropped last
            self._d[key] = (version, value)
        return value
