"""The ``CheckpointStore`` contract (``tests.checkpoint_contract``), run against the local adapters in
``ADAPTERS``, plus what is particular to ``LocalCheckpointStore``. The object-store adapter runs the same
suite against a real S3-compatible server in ``tests/integration/nodemanager/test_checkpoint_stores.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from stagetree.core.errors import InvalidArgument
from stagetree.nodemanager.runtime.checkpoints import CheckpointStore, LocalCheckpointStore, open_checkpoint_store
from tests.checkpoint_contract import FILES, CheckpointStoreContract
from tests.checkpoint_contract import writer as _writer

ADAPTERS: dict[str, Callable[[Path], CheckpointStore]] = {
    "local": lambda tmp: LocalCheckpointStore(tmp / "root"),
    "local-file-uri-root": lambda tmp: LocalCheckpointStore((tmp / "uri root").as_uri(), fsync=False),
    # the object-store adapter on fsspec's in-memory file system (s3 itself: tests/integration/nodemanager)
    "fsspec-memory": lambda tmp: open_checkpoint_store(f"memory://{tmp.name}/ck", cache_dir=tmp / "cache"),
}


class TestLocalAdapters(CheckpointStoreContract):
    @pytest.fixture(params=sorted(ADAPTERS))
    def any_store(self, request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
        return ADAPTERS[request.param](tmp_path)


# -- LocalCheckpointStore only ----------------------------------------------------------------


def test_local_store_is_invisible_until_renamed(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    seen: list[bool] = []

    def write(d: Path) -> None:
        (d / "f").write_bytes(b"1")
        seen.append(store.exists(store.uri_of("p/k")))

    stored = store.put("p/k", write)
    assert seen == [False] and stored.uri == store.uri_of("p/k")
    assert stored.uri.startswith("file:///")
    assert not any((tmp_path / ".tmp").iterdir())  # no temp dir left behind


def test_local_store_refuses_uris_outside_its_root(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path / "root")
    victim = tmp_path / "victim"
    victim.mkdir()
    for uri in (victim.as_uri(), (tmp_path / "root" / ".." / "victim").as_uri(), "s3://bucket/k"):
        with pytest.raises(InvalidArgument):
            store.delete(uri)
    assert victim.exists()


def test_local_store_shared_by_two_instances(tmp_path: Path) -> None:
    writer = LocalCheckpointStore(tmp_path.as_uri())
    reader = LocalCheckpointStore(tmp_path)
    stored = writer.put("x/y", _writer(FILES))
    with reader.open(stored.uri) as d:
        assert (d / "a.bin").read_bytes() == FILES["a.bin"]
