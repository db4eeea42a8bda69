"""The ``CheckpointStore`` contract on the object-store adapter (s3 through s3fs, on a real moto S3
server), and what is particular to it: the manifest makes a checkpoint visible, a second host (its own
cache) reads what the first wrote, the local cache spares a download and stays within its bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stagetree.core.errors import NotFound
from stagetree.nodemanager.runtime.checkpoints import CheckpointStore, open_checkpoint_store
from stagetree.nodemanager.runtime.objectstore import MANIFEST, FsspecCheckpointStore
from tests.checkpoint_contract import FILES, CheckpointStoreContract, read_all, writer
from tests.s3server import S3Server


def _s3_store(s3: S3Server, bucket: str, cache: Path, max_bytes: int = 1 << 30) -> FsspecCheckpointStore:
    store = open_checkpoint_store(
        f"s3://{bucket}/ckpts", s3_endpoint_url=s3.url, cache_dir=cache, cache_max_bytes=max_bytes
    )
    assert isinstance(store, FsspecCheckpointStore)
    return store


class TestS3Adapter(CheckpointStoreContract):
    @pytest.fixture
    def any_store(self, s3: S3Server, s3_bucket: str, tmp_path: Path) -> CheckpointStore:
        return _s3_store(s3, s3_bucket, tmp_path / "cache")


class _Counting:
    """Counts the downloads an fsspec file system makes."""

    def __init__(self, fs: Any) -> None:
        self.fs, self.downloads = fs, 0

    def get_file(self, *a: Any, **kw: Any) -> Any:
        self.downloads += 1
        return self.fs.get_file(*a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)


def test_another_host_reads_what_one_wrote_and_each_reads_its_own_copy_without_downloading(
    s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    host_a = _s3_store(s3, s3_bucket, tmp_path / "a")
    host_b = _s3_store(s3, s3_bucket, tmp_path / "b")
    host_a.fs = counting_a = _Counting(host_a.fs)
    host_b.fs = counting_b = _Counting(host_b.fs)
    stored = host_a.put("plan/n1/s5-central", writer(FILES))
    assert stored.uri == f"s3://{s3_bucket}/ckpts/plan/n1/s5-central" and stored.bytes == 1234
    with host_a.open(stored.uri) as d:  # the writer's cache holds it: no download
        assert read_all(d) == FILES
    assert counting_a.downloads == 0
    for _ in range(2):  # the other host downloads it once, then reads its cached copy
        with host_b.open(stored.uri) as d:
            assert read_all(d) == FILES
    assert counting_b.downloads == len(FILES)
    assert host_b.cache.misses == 1 and host_b.cache.hits == 1
    host_a.delete(stored.uri)  # deleted by one: gone for the other, whose copy stays harmless
    assert not host_b.exists(stored.uri)


def test_objects_without_a_manifest_are_not_a_checkpoint(s3: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    store = _s3_store(s3, s3_bucket, tmp_path / "c")
    stored = store.put("p/k", writer(FILES))
    store.fs.rm_file(f"{s3_bucket}/ckpts/p/k/{MANIFEST}")  # as if its writer had died before the manifest
    store.cache.discard(stored.uri)
    assert not store.exists(stored.uri)
    with pytest.raises(NotFound), store.open(stored.uri):
        pass


def test_a_truncated_object_is_never_read_as_a_checkpoint(s3: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    writer_host = _s3_store(s3, s3_bucket, tmp_path / "w")
    stored = writer_host.put("p/t", writer(FILES))
    writer_host.fs.pipe_file(f"{s3_bucket}/ckpts/p/t/a.bin", b"x" * 10)  # corrupted in the store
    reader = _s3_store(s3, s3_bucket, tmp_path / "r")
    with pytest.raises(Exception, match="expected 1000"), reader.open(stored.uri):
        pass
    assert not reader.cache.entries()  # nothing half-read was cached


def test_the_cache_stays_within_its_bytes_least_recently_used_first(
    s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    store = _s3_store(s3, s3_bucket, tmp_path / "lru", max_bytes=2500)  # room for two 1234-byte checkpoints
    uris = [store.put(f"lru/{i}", writer(FILES)).uri for i in range(2)]
    with store.open(uris[0]):  # 0 is now more recently used than 1
        pass
    uris.append(store.put("lru/2", writer(FILES)).uri)
    assert store.cache.size() <= 2500
    with store.cache.use(uris[1]) as gone, store.cache.use(uris[0]) as kept:
        assert gone is None and kept is not None
    with store.open(uris[1]) as d:  # evicted from the cache, still in the store
        assert read_all(d) == FILES
    tiny = _s3_store(s3, s3_bucket, tmp_path / "tiny", max_bytes=0)  # a zero budget still reads
    with tiny.open(uris[2]) as d:
        assert read_all(d) == FILES
    assert tiny.cache.size() == 0
