"""Checkpoints in an object store through fsspec (``s3://bucket/prefix`` with s3fs): ``FsspecCheckpointStore``.

A checkpoint ``key`` lives under ``<root>/<key>/``: its files, then a ``_MANIFEST.json`` object naming
each file and its size, written last. The manifest is what makes a checkpoint visible: ``exists`` and
``open`` look only at it, so a writer that died mid-upload leaves objects nobody reads (a delete removes
the manifest first for the same reason). A download is checked against the manifest's sizes.

Every checkpoint this node manager writes or reads passes through a local ``CheckpointCache`` (bounded in
bytes, LRU): ``put`` writes into it and uploads from it, ``open`` reads from it and downloads only on a
miss, so a resume on the host that saved the checkpoint reads no byte from the store. ``put`` runs
wherever its caller runs it: the worker's executor calls it on its background writer thread, never on the
training thread.

Credentials come from the standard AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION``) or any other source botocore reads; the endpoint of an S3-compatible server
(MinIO, Ceph, moto) from ``endpoint_url``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stagetree.core.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from stagetree.nodemanager.runtime.checkpoints import (
    CheckpointStore,
    StoredCheckpoint,
    StoreRefused,
    check_key,
    store_trouble,
)
from stagetree.nodemanager.runtime.ckcache import CheckpointCache

log = logging.getLogger(__name__)

MANIFEST = "_MANIFEST.json"


def s3_filesystem(endpoint_url: str = "") -> Any:
    """An s3fs file system on ``endpoint_url`` (empty: AWS) with credentials from the environment and no
    listing cache (another host's writes must be seen at once)."""
    try:
        import s3fs
    except ImportError as e:  # pragma: no cover - an install without the nodemanager/master extra
        raise InvalidArgument("s3:// checkpoint storage needs s3fs: pip install 'stagetree[nodemanager]'") from e
    client_kwargs: dict[str, Any] = {}
    if endpoint_url:
        client_kwargs["endpoint_url"] = endpoint_url
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if region:
        client_kwargs["region_name"] = region
    return s3fs.S3FileSystem(client_kwargs=client_kwargs, skip_instance_cache=True, use_listings_cache=False)


def _split_root(root: str) -> tuple[str, str]:
    """(protocol, path without protocol and trailing slash) of a root URI."""
    proto, sep, rest = root.partition("://")
    if not sep or not proto or not rest.strip("/"):
        raise InvalidArgument(f"checkpoint root {root!r}: expected <protocol>://<bucket>[/<prefix>]")
    return proto, rest.strip("/")


class FsspecCheckpointStore(CheckpointStore):
    """Checkpoints under ``root`` (``s3://bucket/prefix``) of the fsspec file system ``fs``, through ``cache``."""

    def __init__(self, root: str, fs: Any, cache: CheckpointCache) -> None:
        self.protocol, self.base = _split_root(root)
        self.root = f"{self.protocol}://{self.base}"
        self.fs = fs
        self.cache = cache

    @property
    def location(self) -> str:
        return self.root

    def uri_of(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _path_of(self, uri: str) -> str:
        """The file system path of ``uri``, refusing one outside the root (another store, another tenant)."""
        prefix = self.root + "/"
        if not isinstance(uri, str) or not uri.startswith(prefix):
            raise InvalidArgument(f"checkpoint uri {uri!r} lies outside the store root {self.root}")
        return f"{self.base}/{check_key(uri[len(prefix) :])}"

    def _manifest(self, path: str) -> dict[str, int] | None:
        try:
            raw = self.fs.cat_file(f"{path}/{MANIFEST}")
        except FileNotFoundError:
            return None
        except OSError as e:
            raise Unavailable(f"checkpoint store {self.root}: {e}") from e
        files = json.loads(raw)["files"]
        return {str(k): int(v) for k, v in files.items()}

    def put(self, key: str, write: Callable[[Path], None]) -> StoredCheckpoint:
        uri = self.uri_of(key)
        path = self._path_of(uri)
        if self._manifest(path) is not None:
            raise AlreadyExists(f"checkpoint {key!r} exists; checkpoints are immutable, use a new key")
        try:
            tmp = self.cache.new_tmp()
        except OSError as e:
            raise self._refused(key, e, None) from e
        try:
            try:
                write(tmp)
            except OSError as e:
                raise self._refused(key, e, tmp) from e
            files: dict[str, int] = {}
            for dirpath, _dirs, names in os.walk(tmp):
                for n in names:
                    local = Path(dirpath) / n
                    files[local.relative_to(tmp).as_posix()] = local.stat().st_size
            try:
                for rel in sorted(files):
                    self.fs.put_file(str(tmp / rel), f"{path}/{rel}")
                self.fs.pipe_file(f"{path}/{MANIFEST}", json.dumps({"files": files}).encode())
            except Exception as e:
                with contextlib.suppress(Exception):
                    self.fs.rm(path, recursive=True)
                raise StoreRefused(f"checkpoint store {self.root} refused checkpoint {key!r}: {e}") from e
            except BaseException:
                with contextlib.suppress(Exception):
                    self.fs.rm(path, recursive=True)
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.cache.adopt(uri, tmp)
        size = sum(files.values())
        log.debug("checkpoint uploaded", extra={"uri": uri, "bytes": size, "files": len(files)})
        return StoredCheckpoint(uri, size)

    def _refused(self, key: str, e: OSError, tmp: Path | None) -> Exception:
        """The local cache cannot take the checkpoint: say why, when its file system tells."""
        trouble = store_trouble(tmp or self.cache.root)
        if trouble is None:
            return e
        where = f"the checkpoint cache {self.cache.root} (STAGETREE_NM_CHECKPOINT_CACHE_DIR)"
        return StoreRefused(f"{where} {trouble.split(':')[0]}; {key!r} not written ({e})")

    @contextlib.contextmanager
    def _open(self, uri: str) -> Iterator[Path]:
        path = self._path_of(uri)
        with self.cache.use(uri) as cached:
            if cached is not None:
                yield cached
                return
        tmp = self._download(uri, path)
        with self.cache.adopt_and_use(uri, tmp) as entry:
            yield entry

    def _download(self, uri: str, path: str) -> Path:
        files = self._manifest(path)
        if files is None:
            raise NotFound(f"checkpoint {uri} does not exist (deleted, or written to another store?)")
        tmp = self.cache.new_tmp()
        try:
            for rel, size in files.items():
                local = tmp / rel
                local.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(f"{path}/{rel}", str(local))
                if local.stat().st_size != size:
                    raise Unavailable(f"checkpoint {uri}: {rel} has {local.stat().st_size} bytes, expected {size}")
        except FileNotFoundError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise NotFound(f"checkpoint {uri} was deleted while it was read") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.debug("checkpoint downloaded", extra={"uri": uri, "bytes": sum(files.values())})
        return tmp

    def open(self, uri: str) -> contextlib.AbstractContextManager[Path]:
        return self._open(uri)

    def exists(self, uri: str) -> bool:
        return self._manifest(self._path_of(uri)) is not None

    def delete(self, uri: str) -> None:
        path = self._path_of(uri)
        self.cache.discard(uri)
        # The manifest first: from then on nobody starts reading it.
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{path}/{MANIFEST}")
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
