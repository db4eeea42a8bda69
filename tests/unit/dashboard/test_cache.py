"""``dashboard.cache.VersionedCache``: a value is built again exactly when its version moved, an answer
that must not be kept is not, and the cache stays bounded."""

from __future__ import annotations

from stagetree.dashboard.cache import VersionedCache


def test_a_value_is_built_again_only_when_its_version_moved() -> None:
    cache: VersionedCache[str] = VersionedCache()
    built: list[str] = []

    def build(v: str) -> str:
        built.append(v)
        return f"page at {v}"

    assert cache.get("study", 1, lambda: build("1")) == "page at 1"
    assert cache.get("study", 1, lambda: build("again")) == "page at 1"
    assert cache.get("study", 2, lambda: build("2")) == "page at 2"
    assert cache.get("other", 2, lambda: build("other")) == "page at other"  # per key
    assert built == ["1", "2", "other"] and cache.builds == 3


def test_an_answer_not_to_keep_is_built_each_time_and_drops_what_was_kept() -> None:
    cache: VersionedCache[int] = VersionedCache()
    cache.get("tree", "v", lambda: 1)
    assert cache.get("tree", "v", lambda: 2, cacheable=False) == 2  # a batch runs: built, not kept
    assert cache.get("tree", "v", lambda: 3) == 3  # the value kept before is gone too
    assert cache.get("tree", "v", lambda: 4) == 3


def test_the_oldest_half_goes_when_full() -> None:
    cache: VersionedCache[int] = VersionedCache(size=4)
    for k in range(4):
        cache.get(k, 0, lambda k=k: k)
    cache.get(0, 0, lambda: -1)  # kept: not built again, nor made younger
    cache.get(4, 0, lambda: 4)  # full: 0 and 1 go
    assert [cache.get(k, 0, lambda: -1) for k in (2, 3, 4)] == [2, 3, 4]
    assert cache.get(0, 0, lambda: 10) == 10 and cache.get(1, 0, lambda: 11) == 11
