"""The ``CheckpointStore`` contract: one suite that every adapter passes the same way.

A test module subclasses ``CheckpointStoreContract`` and provides a ``store`` fixture (``any_store``)
building its adapter; the local adapters run it in ``tests/unit/runtime/test_checkpoints.py``, the object
store (s3 on a real S3-compatible server) in ``tests/integration/nodemanager/test_checkpoint_stores.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from stagetree.core.errors import AlreadyExists, InvalidArgument, NotFound
from stagetree.nodemanager.runtime.checkpoints import CheckpointStore

FILES = {"a.bin": b"x" * 1000, "user/trainer.pt": b"y" * 234}


def writer(files: dict[str, bytes]) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        for name, data in files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)

    return write


def read_all(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


class CheckpointStoreContract:
    """Tests every ``CheckpointStore`` adapter passes; the subclass's ``any_store`` fixture builds one."""

    def test_put_then_open_reads_what_was_written(self, any_store: CheckpointStore) -> None:
        stored = any_store.put("plan/n1/s10", writer(FILES))
        assert stored.bytes == 1234
        assert any_store.exists(stored.uri)
        with any_store.open(stored.uri) as d:
            assert read_all(d) == FILES

    def test_keys_are_immutable(self, any_store: CheckpointStore) -> None:
        any_store.put("k/1", writer(FILES))
        with pytest.raises(AlreadyExists):
            any_store.put("k/1", writer({"other": b"z"}))

    def test_delete_removes_and_is_idempotent(self, any_store: CheckpointStore) -> None:
        stored = any_store.put("k/2", writer(FILES))
        any_store.delete(stored.uri)
        assert not any_store.exists(stored.uri)
        any_store.delete(stored.uri)
        with pytest.raises(NotFound), any_store.open(stored.uri):
            pass
        assert any_store.put("k/2", writer({"again": b"1"})).bytes == 1  # the key is free again

    def test_failed_write_publishes_nothing(self, any_store: CheckpointStore) -> None:
        def broken(d: Path) -> None:
            (d / "half").write_bytes(b"partial")
            raise OSError("disk full")

        with pytest.raises(OSError, match="disk full"):
            any_store.put("k/3", broken)
        stored = any_store.put("k/3", writer({"whole": b"ok"}))  # the key was never taken
        with any_store.open(stored.uri) as d:
            assert sorted(p.name for p in d.iterdir()) == ["whole"]

    @pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "sp ace", "a/./b", "../up"])
    def test_bad_keys_are_refused(self, any_store: CheckpointStore, key: str) -> None:
        with pytest.raises(InvalidArgument):
            any_store.put(key, writer(FILES))

    def test_uris_of_another_store_are_refused(self, any_store: CheckpointStore, tmp_path: Path) -> None:
        for uri in ((tmp_path / "elsewhere" / "k").as_uri(), "s3://another-bucket/k", "memory://x/k"):
            with pytest.raises(InvalidArgument):
                any_store.delete(uri)
            with pytest.raises(InvalidArgument), any_store.open(uri):
                pass

    def test_concurrent_puts_of_distinct_keys(self, any_store: CheckpointStore) -> None:
        uris: list[str] = []
        errors: list[BaseException] = []

        def put(i: int) -> None:
            try:
                uris.append(any_store.put(f"c/{i}", writer({"f": bytes([i]) * (i + 1)})).uri)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(set(uris)) == 8
        assert all(any_store.exists(u) for u in uris)
