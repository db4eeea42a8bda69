"""The checkpoint store full or read-only, with real training (issue 17's data-tier fault in this area):
a node manager whose checkpoint directory is a tiny tmpfs (full: ENOSPC) or one remounted read-only
(EROFS), and one whose s3 bucket is gone. Each batch fails with the store's error, is retried up to
``max_attempts``, then the request is FAILED with that error; no checkpoint is recorded that is not
whole, so nothing can ever resume from a partial one. Skipped, with the reason, where tmpfs cannot be
mounted (not root)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagetree.core.lifecycle import RetryPolicy
from stagetree.master.app import MasterApp
from tests.integration.nodemanager.helpers import config_json, finished, fixed_part, start_node_manager, submit
from tests.s3server import S3Server

pytestmark = [pytest.mark.timeout(600), pytest.mark.parametrize("fresh_db_url", ["sqlite"], indirect=True)]


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or 'not root'})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _remount_ro(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def _whole_checkpoints(app: MasterApp, root: Path) -> None:
    """Every checkpoint the catalog holds is a directory that is there, whole, under ``root``."""
    for rows in app.store.checkpoints.checkpoint_records().values():
        for _point, uri, nbytes, _kind, _used in rows:
            path = Path(uri.removeprefix("file://"))
            assert path.is_dir() and sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) == nbytes


async def _run_and_expect_failure(app: MasterApp, target: str, tmp: Path, error: str, **nm: object) -> None:
    app.service.retry = RetryPolicy(2)
    app.scheduler.settings.peripheral_every_steps = 3  # saves early and often: the store is hit at once
    fixed = fixed_part(seed=uuid.uuid4().int % 1000)
    node_manager = await start_node_manager(target, tmp, **nm)
    try:
        study, ids = await submit(app, [(config_json(fixed, lr=0.1, bs=32), 12)])
        (rec,) = await finished(app, study, ids, timeout=90)
    finally:
        await node_manager.close()
        app.scheduler.settings.peripheral_every_steps = 0
    assert rec.state == "FAILED", rec
    assert error in (rec.error or ""), rec.error
    ends = [end for _, end in node_manager.reporter.ends]
    assert [e.status for e in ends] == ["failed", "failed"], ends  # retried once, then the request failed


async def test_a_full_checkpoint_store_fails_the_request_with_its_error(
    scheduling: MasterApp, grpc_target: str, tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "full", "16k") as root:
        await _run_and_expect_failure(scheduling, grpc_target, tmp_path, "is full", checkpoint_root=str(root))
        _whole_checkpoints(scheduling, root)
        assert not [p for p in root.iterdir() if p.name != ".tmp"]  # nothing half-written was published
        assert not any((root / ".tmp").iterdir())


async def test_a_read_only_checkpoint_store_fails_the_request_with_its_error(
    scheduling: MasterApp, grpc_target: str, tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "ro", "8m") as root:
        (root / ".tmp").mkdir()
        _remount_ro(root)
        await _run_and_expect_failure(scheduling, grpc_target, tmp_path, "is read-only", checkpoint_root=str(root))
        _whole_checkpoints(scheduling, root)


async def test_a_missing_s3_bucket_fails_the_request_with_its_error(
    scheduling: MasterApp, grpc_target: str, tmp_path: Path, s3: S3Server
) -> None:
    bucket = f"stagetree-gone-{uuid.uuid4().hex[:8]}"  # never created
    store = {"checkpoint_root": f"s3://{bucket}/ck", "s3_endpoint_url": s3.url}
    await _run_and_expect_failure(scheduling, grpc_target, tmp_path, "refused checkpoint", **store)
    assert scheduling.store.checkpoints.checkpoint_bytes() == 0  # nothing recorded
