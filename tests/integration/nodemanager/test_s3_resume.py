"""Two node managers on an s3:// checkpoint store (a real moto S3 server), sharing nothing else: the first
is stopped mid-batch (its worker saves a peripheral checkpoint to the store), the second resumes from it
and finishes with the metrics of an uninterrupted run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from stagetree.core.batch import BatchSpec
from stagetree.master.app import MasterApp
from stagetree.nodemanager.runtime.ckcache import CheckpointCache
from tests.integration.nodemanager.helpers import (
    FAULTY,
    config_json,
    finished,
    fixed_part,
    start_node_manager,
    submit,
    until,
)
from tests.integration.nodemanager.test_node_manager import reference_metrics
from tests.s3server import S3Server

pytestmark = pytest.mark.timeout(600)


def _cached(cache_dir: Path, uri: str) -> bool:
    with CheckpointCache(cache_dir, 1 << 30).use(uri) as d:
        return d is not None


@pytest.mark.parametrize("fresh_db_url", ["postgres"], indirect=True)
async def test_a_checkpoint_written_by_one_node_manager_is_resumed_by_another_with_identical_results(
    scheduling: MasterApp, grpc_target: str, tmp_path: Path, s3: S3Server, s3_bucket: str
) -> None:
    app = scheduling
    fixed = fixed_part(FAULTY, seed=4, sleep_s=0.02, dropout=0.1)
    tuned = {"lr": 0.1, "momentum": 0.9, "bs": 16}
    steps = 40
    store = {"checkpoint_root": f"s3://{s3_bucket}/ckpts", "s3_endpoint_url": s3.url}
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    a = await start_node_manager(grpc_target, host_a, **store)

    study, ids = await submit(app, [(config_json(fixed, **tuned), steps)])
    started = await until(lambda: a.reporter.of("batch_started"), 30, "the batch to start on host a")
    first = started[0]["batch_id"]
    await until(lambda: a.reporter.progress(first) >= 8, 30, "progress on host a")
    await a.close()  # a graceful stop: the worker saves where it is, then exits, and a leaves the master
    (stop,) = a.reporter.of("batch_preempted", first)
    assert {n.id: n.state for n in app.store.nodes.node_managers()}[a.nm.id] == "LEFT"  # no more work for a
    assert stop["uri"].startswith(f"s3://{s3_bucket}/ckpts/") and 8 <= stop["step"] < steps
    assert _cached(host_a / "work" / "checkpoint-cache", stop["uri"])  # the writer keeps its copy
    b = await start_node_manager(grpc_target, host_b, **store)
    try:
        (rec,) = await finished(app, study, ids, timeout=60)
    finally:
        await b.close()
    assert rec.state == "DONE", rec
    (end_b,) = [i.batch_id for i, end in b.reporter.ends if end.status == "finished"]
    spec = BatchSpec.from_json(json.loads(app.store.batches.get_batch(end_b).spec_json))
    assert spec.source is not None and spec.source.uri == stop["uri"]  # resumed from a's checkpoint
    assert b.reporter.steps_trained() == steps - stop["step"]
    assert _cached(host_b / "work" / "checkpoint-cache", stop["uri"])  # downloaded once into b's cache
    assert rec.metrics == await asyncio.to_thread(reference_metrics, tmp_path, fixed, tuned, steps)
