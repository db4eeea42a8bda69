"""The ``CheckpointStore`` contract, run against every adapter in ``ADAPTERS``, plus what is
particular to ``LocalCheckpointStore``.

An adapter for another technology (an object store) adds one factory to ``ADAPTERS`` and passes the
same suite."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from stagetree.core.errors import AlreadyExists, InvalidArgument, NotFound
from stagetree.nodemanager.runtime.checkpoints import CheckpointStore, LocalCheckpointStore

ADAPTERS: dict[str, Callable[[Path], CheckpointStore]] = {
    "local": lambda tmp: LocalCheckpointStore(tmp / "root"),
    "local-file-uri-root": lambda tmp: LocalCheckpointStore((tmp / "uri root").as_uri(), fsync=False),
}


@pytest.fixture(params=sorted(ADAPTERS))
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    return ADAPTERS[request.param](tmp_path)


def _writer(files: dict[str, bytes]) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        for name, data in files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)

    return write


FILES = {"a.bin": b"x" * 1000, "user/trainer.pt": b"y" * 234}


def test_put_then_open_reads_what_was_written(any_store: CheckpointStore) -> None:
    stored = any_store.put("plan/n1/s10", _writer(FILES))
    assert stored.bytes == 1234
    assert any_store.exists(stored.uri)
    with any_store.open(stored.uri) as d:
        assert {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()} == FILES


def test_keys_are_immutable(any_store: CheckpointStore) -> None:
    any_store.put("k/1", _writer(FILES))
    with pytest.raises(AlreadyExists):
        any_store.put("k/1", _writer({"other": b"z"}))


def test_delete_removes_and_is_idempotent(any_store: CheckpointStore) -> None:
    stored = any_store.put("k/2", _writer(FILES))
    any_store.delete(stored.uri)
    assert not any_store.exists(stored.uri)
    any_store.delete(stored.uri)
    with pytest.raises(NotFound), any_store.open(stored.uri):
        pass
    assert any_store.put("k/2", _writer({"again": b"1"})).bytes == 1  # the key is free again


def test_failed_write_publishes_nothing(any_store: CheckpointStore) -> None:
    def broken(d: Path) -> None:
        (d / "half").write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        any_store.put("k/3", broken)
    stored = any_store.put("k/3", _writer({"whole": b"ok"}))  # the key was never taken
    with any_store.open(stored.uri) as d:
        assert sorted(p.name for p in d.iterdir()) == ["whole"]


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "sp ace", "a/./b", "../up"])
def test_bad_keys_are_refused(any_store: CheckpointStore, key: str) -> None:
    with pytest.raises(InvalidArgument):
        any_store.put(key, _writer(FILES))


def test_concurrent_puts_of_distinct_keys(any_store: CheckpointStore) -> None:
    uris: list[str] = []
    errors: list[BaseException] = []

    def put(i: int) -> None:
        try:
            uris.append(any_store.put(f"c/{i}", _writer({"f": bytes([i]) * (i + 1)})).uri)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(uris)) == 8
    assert all(any_store.exists(u) for u in uris)


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
