"""Where checkpoints live: the ``CheckpointStore`` port and its local-directory adapter.

A checkpoint is a directory of files written by one callback and named by a URI. ``put`` makes it
visible atomically (readers see all of it or nothing), ``open`` gives a local directory to read it from
(an object-store adapter downloads into a temporary one), ``delete`` and ``exists`` manage it.

``LocalCheckpointStore`` keeps checkpoints under a root directory, local or shared (NFS, GlusterFS):
it writes into ``<root>/.tmp/`` and renames into place, so a crashed writer leaves only a temp dir.
``FsspecCheckpointStore`` (``runtime.objectstore``) keeps them in an object store (``s3://``) behind a
local cache. ``open_checkpoint_store`` picks the adapter from the root's scheme. A store that cannot take
a write (full, read-only, a missing bucket) raises ``StoreRefused`` saying so, never a half checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from stagetree.core.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable

log = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[A-Za-z0-9_.=-]+(/[A-Za-z0-9_.=-]+)*$")
_TMP = ".tmp"


@dataclass(frozen=True)
class StoredCheckpoint:
    uri: str
    bytes: int


class CheckpointStore(ABC):
    """A place to keep checkpoint directories, addressed by URI."""

    @property
    @abstractmethod
    def location(self) -> str:
        """The store's root as the workers take it (``--checkpoint-root``): a directory or a URI."""

    @abstractmethod
    def put(self, key: str, write: Callable[[Path], None]) -> StoredCheckpoint:
        """Call ``write(dir)`` on an empty local directory, then publish it atomically under ``key``
        (``a/b/c``: letters, digits, ``_.=-``). Raises ``AlreadyExists`` if ``key`` is taken."""

    @abstractmethod
    def open(self, uri: str) -> contextlib.AbstractContextManager[Path]:
        """A local directory holding the checkpoint's files, valid inside the ``with`` block."""

    @abstractmethod
    def exists(self, uri: str) -> bool: ...

    @abstractmethod
    def delete(self, uri: str) -> None:
        """Remove the checkpoint; deleting a missing one is not an error."""


class StoreRefused(Unavailable):
    """The checkpoint store cannot take a write (full, read-only, its bucket gone, access denied): the
    batch fails with this message and is retried (on another host, another store may accept it)."""


def store_trouble(path: Path) -> str | None:
    """Why writes under ``path`` fail, when the file system says so: read-only, or (nearly) full."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return "is read-only: remount it read-write or point STAGETREE_NM_CHECKPOINT_ROOT elsewhere"
    free = st.f_bavail * st.f_frsize
    if free < _FULL_BYTES:
        return f"is full ({free} bytes free): free space, or lower the master's checkpoint budget"
    return None


_FULL_BYTES = 1024 * 1024


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.match(key) or any(p in (".", "..") for p in key.split("/")):
        raise InvalidArgument(f"checkpoint key {key!r}: use path segments of letters, digits and _.=-")
    return key


def _dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    return total


def _fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories; the data files are synced
        pass
    finally:
        os.close(fd)


class LocalCheckpointStore(CheckpointStore):
    """Checkpoints as directories under ``root`` (a path or a ``file://`` URI); URIs are ``file://``."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        text = os.fspath(root)
        if text.startswith("file://"):
            text = unquote(urlparse(text).path)
        self.root = Path(text).resolve()
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / _TMP).mkdir(exist_ok=True)

    @property
    def location(self) -> str:
        return str(self.root)

    def uri_of(self, key: str) -> str:
        return (self.root / check_key(key)).as_uri()

    def path_of(self, uri: str) -> Path:
        parsed = urlparse(uri)
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            raise InvalidArgument(f"checkpoint uri {uri!r}: this store takes file:// URIs")
        path = Path(unquote(parsed.path))
        try:
            rel = path.relative_to(self.root)
        except ValueError:
            raise InvalidArgument(f"checkpoint uri {uri!r} lies outside the store root {self.root}") from None
        check_key(rel.as_posix())
        return path

    def put(self, key: str, write: Callable[[Path], None]) -> StoredCheckpoint:
        final = self.root / check_key(key)
        if final.exists():
            raise AlreadyExists(f"checkpoint {key!r} exists; checkpoints are immutable, use a new key")
        tmp = self.root / _TMP / f"{key.replace('/', '_')}.{uuid.uuid4().hex}"
        try:
            tmp.mkdir()
            write(tmp)
            size = _dir_bytes(tmp)
            if self.fsync:
                _fsync_tree(tmp)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, final)
            except OSError as e:
                if final.exists():
                    raise AlreadyExists(f"checkpoint {key!r} was written concurrently") from e
                raise
            if self.fsync:
                _fsync_dir(final.parent)
        except Exception as e:
            trouble = store_trouble(tmp.parent)  # before the temp dir goes: it may be what filled the disk
            shutil.rmtree(tmp, ignore_errors=True)
            if trouble is not None:
                raise StoreRefused(
                    f"checkpoint store {self.root} {trouble}: checkpoint {key!r} not written ({e})"
                ) from e
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.debug("checkpoint written", extra={"uri": final.as_uri(), "bytes": size})
        return StoredCheckpoint(final.as_uri(), size)

    @contextlib.contextmanager
    def _open(self, uri: str) -> Iterator[Path]:
        path = self.path_of(uri)
        if not path.is_dir():
            raise NotFound(f"checkpoint {uri} does not exist (deleted, or written by another store root?)")
        yield path

    def open(self, uri: str) -> contextlib.AbstractContextManager[Path]:
        return self._open(uri)

    def exists(self, uri: str) -> bool:
        return self.path_of(uri).is_dir()

    def delete(self, uri: str) -> None:
        path = self.path_of(uri)
        if not path.exists():
            return
        # Rename first so a concurrent reader never sees a half-deleted checkpoint.
        doomed = self.root / _TMP / f"deleted.{uuid.uuid4().hex}"
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)


DEFAULT_CACHE_BYTES = 2 * 1024**3


def open_checkpoint_store(
    root: str,
    *,
    s3_endpoint_url: str = "",
    cache_dir: str | os.PathLike[str] | None = None,
    cache_max_bytes: int = DEFAULT_CACHE_BYTES,
) -> CheckpointStore:
    """The store for ``root``: a plain path or ``file://`` URI is a ``LocalCheckpointStore``; any other
    scheme (``s3://bucket/prefix``) an ``FsspecCheckpointStore`` with a local cache in ``cache_dir``
    (bounded to ``cache_max_bytes``), on ``s3_endpoint_url`` for S3-compatible servers."""
    scheme = urlparse(root).scheme if "://" in root else ""
    if scheme in ("", "file"):
        return LocalCheckpointStore(root)
    from stagetree.nodemanager.runtime.ckcache import CheckpointCache
    from stagetree.nodemanager.runtime.objectstore import FsspecCheckpointStore, s3_filesystem

    if cache_dir is None:
        raise InvalidArgument(f"checkpoint root {root!r} is remote: it needs a local cache directory")
    cache = CheckpointCache(cache_dir, cache_max_bytes)
    if scheme == "s3":
        fs = s3_filesystem(s3_endpoint_url)
    else:
        import fsspec

        try:
            fs = fsspec.filesystem(scheme)
        except (ImportError, ValueError) as e:
            raise InvalidArgument(f"checkpoint root {root!r}: no file system for {scheme}:// ({e})") from e
    return FsspecCheckpointStore(root, fs, cache)
