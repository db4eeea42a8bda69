"""Deleting the data of checkpoints the master has forgotten: the ``CheckpointFiles`` port.

The catalog (``store.checkpoints``) forgets a checkpoint and queues its deletion on the live node managers
through the outbox (they also drop their cached copies). A checkpoint in an object store is deleted by the
master too, so an eviction frees the store's bytes even when no node manager is alive:
``ObjectStoreCheckpointFiles`` deletes ``s3://`` URIs on ``STAGETREE_MASTER_S3_ENDPOINT_URL`` (credentials
from the standard AWS environment), in a background thread so a scheduling round never waits on the
network. ``file://`` checkpoints are left to the node managers (the directory is theirs to reach).
The layout of a checkpoint in the store is ``nodemanager.runtime.objectstore``'s: manifest first.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


class CheckpointFiles(ABC):
    """Removes the stored data of checkpoints the catalog no longer holds."""

    @abstractmethod
    def delete(self, uris: Sequence[str]) -> Future[int] | None:
        """Start deleting ``uris`` (missing ones are fine); the future, when any, says how many went."""


class NodeManagersDeleteFiles(CheckpointFiles):
    """Nothing besides the outbox: the node managers delete (a local or shared directory)."""

    def delete(self, uris: Sequence[str]) -> Future[int] | None:
        return None


class ObjectStoreCheckpointFiles(CheckpointFiles):
    """Deletes ``s3://`` checkpoints from the object store; other URIs are left to the node managers."""

    def __init__(self, endpoint_url: str = "", fs: Any = None) -> None:
        self.endpoint_url = endpoint_url
        self._fs = fs
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-delete")

    def _filesystem(self) -> Any:
        if self._fs is None:
            from stagetree.nodemanager.runtime.objectstore import s3_filesystem

            self._fs = s3_filesystem(self.endpoint_url)
        return self._fs

    def delete(self, uris: Sequence[str]) -> Future[int] | None:
        mine = [u for u in uris if u.startswith("s3://")]
        return self._pool.submit(self._delete, mine) if mine else None

    def _delete(self, uris: Sequence[str]) -> int:
        from stagetree.nodemanager.runtime.objectstore import MANIFEST

        fs, n = self._filesystem(), 0
        for uri in uris:
            path = uri.removeprefix("s3://").rstrip("/")
            try:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(f"{path}/{MANIFEST}")  # first: from then on nobody starts reading it
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(path, recursive=True)
                n += 1
            except Exception:  # the next eviction does not retry it: log, so an operator can clean up
                log.exception("checkpoint not deleted from the object store", extra={"uri": uri})
        log.info("checkpoints deleted from the object store", extra={"deleted": n, "asked": len(uris)})
        return n

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def checkpoint_files(s3_endpoint_url: str) -> CheckpointFiles:
    """The master's adapter: the object store one always (it ignores what is not ``s3://``); s3fs is
    only imported when an ``s3://`` checkpoint is first deleted."""
    return ObjectStoreCheckpointFiles(s3_endpoint_url)
