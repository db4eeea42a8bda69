"""``CheckpointCache``: bounded in bytes, least recently used first, and never evicting a copy in use."""

from __future__ import annotations

import os
import time
from pathlib import Path

from stagetree.nodemanager.runtime.ckcache import CheckpointCache


def _add(cache: CheckpointCache, uri: str, nbytes: int) -> None:
    tmp = cache.new_tmp()
    (tmp / "f").write_bytes(b"x" * nbytes)
    cache.adopt(uri, tmp)


def _cached(cache: CheckpointCache, uri: str) -> bool:
    with cache.use(uri) as d:
        return d is not None


def test_least_recently_used_goes_first(tmp_path: Path) -> None:
    cache = CheckpointCache(tmp_path, max_bytes=250)
    _add(cache, "s3://b/a", 100)
    _add(cache, "s3://b/b", 100)
    past = time.time() - 60
    os.utime(cache.root / cache._name("s3://b/b"), (past, past))  # b: used long ago
    assert _cached(cache, "s3://b/a")
    _add(cache, "s3://b/c", 100)
    assert [_cached(cache, u) for u in ("s3://b/a", "s3://b/b", "s3://b/c")] == [True, False, True]
    assert cache.size() <= 250


def test_a_copy_in_use_is_never_evicted(tmp_path: Path) -> None:
    cache = CheckpointCache(tmp_path, max_bytes=100)
    _add(cache, "s3://b/held", 100)
    with cache.use("s3://b/held") as held:
        assert held is not None
        _add(cache, "s3://b/new", 100)  # over the budget: the held one stays, readable
        assert (held / "f").read_bytes() == b"x" * 100
    _add(cache, "s3://b/newer", 50)  # no longer held: now it can go
    assert not _cached(cache, "s3://b/held")


def test_a_second_copy_of_the_same_checkpoint_is_discarded(tmp_path: Path) -> None:
    cache = CheckpointCache(tmp_path, max_bytes=1000)
    _add(cache, "s3://b/x", 10)
    _add(cache, "s3://b/x", 10)
    assert cache.size() == 10 and not list((cache.root / ".tmp").iterdir())


def test_discard_forgets_a_copy(tmp_path: Path) -> None:
    cache = CheckpointCache(tmp_path, max_bytes=1000)
    _add(cache, "s3://b/x", 10)
    cache.discard("s3://b/x")
    assert not _cached(cache, "s3://b/x") and cache.size() == 0
