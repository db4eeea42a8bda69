"""The node manager's local cache of checkpoints kept in an object store: a directory bounded in bytes, LRU.

Consistency rules (checkpoints are immutable, so an entry never goes stale; it can only go away):

- An entry is a directory ``<root>/<hash of uri>/`` that appears by one ``rename`` (a reader sees all of
  it or nothing); ``adopt`` moves a directory written or downloaded under ``<root>/.tmp/`` into place. When
  two processes adopt the same uri, the first one wins and the other's copy is discarded (they are equal).
- Use is marked by the entry's mtime (LRU) and guarded by a shared ``flock`` on ``<hash>.lock`` for as long as
  a reader holds the directory; eviction takes the lock exclusively without waiting and skips an entry in
  use, so a training process never loses files under its feet. The budget can thus be exceeded while
  every entry is in use; it is restored when a reader of a new entry is done, or at the next ``adopt``.
- Several worker processes of one node manager share the cache through the file system only: nothing
  is kept in memory between calls.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_TMP = ".tmp"


def dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    return total


class CheckpointCache:
    """Checkpoint directories by uri under ``root``, at most ``max_bytes`` of them (least recently used go)."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("the checkpoint cache's size must be >= 0 bytes")
        self.root = Path(root).resolve()
        self.max_bytes = max_bytes
        (self.root / _TMP).mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0

    def _name(self, uri: str) -> str:
        return hashlib.sha256(uri.encode()).hexdigest()[:32]

    def _entry(self, uri: str) -> Path:
        return self.root / self._name(uri)

    def new_tmp(self) -> Path:
        """An empty directory on the cache's file system, to write or download a checkpoint into."""
        tmp = self.root / _TMP / uuid.uuid4().hex
        tmp.mkdir()
        return tmp

    @contextlib.contextmanager
    def _locked(self, name: str, exclusive: bool, wait: bool = True) -> Iterator[bool]:
        fd = os.open(self.root / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
            try:
                fcntl.flock(fd, flags)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing releases the lock

    @contextlib.contextmanager
    def use(self, uri: str) -> Iterator[Path | None]:
        """The cached directory of ``uri`` held for reading inside the block, or None when not cached."""
        name = self._name(uri)
        with self._locked(name, exclusive=False):
            entry = self.root / name
            if not entry.is_dir():
                self.misses += 1
                yield None
                return
            self.hits += 1
            with contextlib.suppress(OSError):
                os.utime(entry)
            yield entry

    def adopt(self, uri: str, tmp: Path) -> None:
        """Move ``tmp`` (from ``new_tmp``) into the cache as ``uri``'s copy, then evict down to the budget."""
        with self._locked(self._name(uri), exclusive=False):
            self._place(uri, tmp)
        self.evict()

    @contextlib.contextmanager
    def adopt_and_use(self, uri: str, tmp: Path) -> Iterator[Path]:
        """``adopt``, holding the new entry for reading inside the block (eviction cannot take it then,
        even when it alone is over the budget)."""
        name = self._name(uri)
        with self._locked(name, exclusive=False):
            entry = self._place(uri, tmp)
            self.evict()
            yield entry
        self.evict()  # an entry over the budget by itself goes once read

    def _place(self, uri: str, tmp: Path) -> Path:
        entry = self._entry(uri)
        try:
            os.rename(tmp, entry)
        except OSError:  # cached meanwhile by another process: theirs is the same checkpoint
            shutil.rmtree(tmp, ignore_errors=True)
        return entry

    def discard(self, uri: str) -> None:
        """Forget ``uri``'s copy (its checkpoint was deleted); waits for its readers."""
        name = self._name(uri)
        with self._locked(name, exclusive=True):
            self._remove(self.root / name)

    def _remove(self, entry: Path) -> None:
        doomed = self.root / _TMP / f"evicted.{uuid.uuid4().hex}"
        try:
            os.rename(entry, doomed)
        except OSError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, directory) of every entry, least recently used first."""
        out = []
        for p in self.root.iterdir():
            if p.name.startswith(".") or not p.is_dir():
                continue
            with contextlib.suppress(OSError):
                out.append((p.stat().st_mtime, dir_bytes(p), p))
        return sorted(out)

    def size(self) -> int:
        return sum(b for _, b, _ in self.entries())

    def evict(self) -> int:
        """Remove least recently used entries not in use until the rest fit ``max_bytes``; returns bytes freed."""
        items = self.entries()
        total = sum(b for _, b, _ in items)
        freed = 0
        for _used, nbytes, entry in items:
            if total <= self.max_bytes:
                break
            with self._locked(entry.name, exclusive=True, wait=False) as got:
                if got and entry.is_dir():
                    self._remove(entry)
                    total -= nbytes
                    freed += nbytes
        if freed:
            log.debug("checkpoint cache evicted", extra={"bytes": freed, "bytes_after": total})
        self._sweep_tmp()
        return freed

    def _sweep_tmp(self, older_than_s: float = 3600.0) -> None:
        """Temp directories a crashed process left behind."""
        now = time.time()
        for p in (self.root / _TMP).iterdir():
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > older_than_s:
                    shutil.rmtree(p, ignore_errors=True)
