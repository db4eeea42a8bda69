"""A real master (Postgres and SQLite, scheduling loop running) and a node manager in this process
running real digits training in worker processes: requests complete with the metrics an uninterrupted
run gives, a branch point's prefix is trained once, crashes are retried and then fail the request,
preemption resumes exactly from its peripheral checkpoint, a cancel aborts the worker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from stagetree.core.batch import BatchSpec, Point, Source
from stagetree.core.lifecycle import RetryPolicy
from stagetree.core.sequences import MultiStep
from stagetree.master.app import MasterApp
from stagetree.nodemanager.examples.digits import digits_batch
from stagetree.nodemanager.examples.faults import EXIT_CODE
from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
from stagetree.nodemanager.runtime.executor import run_batch
from stagetree.nodemanager.runtime.trainer import load_trainer_class
from tests.integration.nodemanager.helpers import (
    ADMIN,
    ALICE,
    FAULTY,
    config_json,
    finished,
    fixed_part,
    start_node_manager,
    submit,
    until,
)

pytestmark = pytest.mark.timeout(600)


def reference_metrics(tmp: Path, fixed: dict[str, Any], tuned: dict[str, Any], steps: int) -> dict[str, float]:
    """The metrics of an uninterrupted run of this config, in this process."""
    import torch

    got: list[dict[str, float]] = []
    spec = digits_batch(
        [(1, 0, steps, tuned)],
        seed=fixed["seed"],
        fixed_values=fixed["values"],
        trainer=fixed["trainer"],
        evals=[(1, steps)],
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_batch(
            spec,
            load_trainer_class(fixed["trainer"]),
            LocalCheckpointStore(tmp / "reference", fsync=False),
            lambda kind, payload: got.append(payload["metrics"]) if kind == "metrics" else None,
        )
    finally:
        torch.set_num_threads(threads)
    return got[-1]


async def test_requests_complete_with_the_metrics_of_a_straight_run(
    scheduling: MasterApp, grpc_target: str, tmp_path: Path
) -> None:
    app = scheduling
    fixed = fixed_part(seed=3)
    nm = await start_node_manager(grpc_target, tmp_path)
    try:
        study, ids = await submit(app, [(config_json(fixed, lr=0.1, bs=32), 12)])
        (rec,) = await finished(app, study, ids)
        assert rec.state == "DONE", rec
        assert rec.metrics == reference_metrics(tmp_path, fixed, {"lr": 0.1, "bs": 32}, 12)
        ((_, end),) = nm.reporter.ends
        assert end.status == "finished" and end.by_worker
        # the worker's measure of its time came with the report: 12 steps of training, apart from the rest
        stats = app.service.study_stats(ALICE, study)
        assert stats.steps_executed == 12 and stats.compute_seconds > 0 and stats.startup_seconds > 0
        assert stats.checkpoint_seconds > 0  # the end's checkpoint, waited for
    finally:
        await nm.close()


async def test_two_children_share_their_parent_prefix(scheduling: MasterApp, grpc_target: str, tmp_path: Path) -> None:
    app = scheduling
    fixed = fixed_part(seed=5)
    tuned = [{"lr": MultiStep(0.1, [8], g), "bs": 32} for g in (0.5, 0.2)]
    nm = await start_node_manager(grpc_target, tmp_path)
    try:
        study, ids = await submit(app, [(config_json(fixed, **t), 16) for t in tuned])
        recs = await finished(app, study, ids)
        assert [r.state for r in recs] == ["DONE", "DONE"], recs
        assert nm.reporter.steps_trained() == 8 + 8 + 8  # the shared [0, 8) once, then each child's [8, 16)
        batches = sorted({info.batch_id for info, _ in nm.reporter.ends})
        specs = [BatchSpec.from_json(json.loads(app.store.batches.get_batch(b).spec_json)) for b in batches]
        first, second = specs
        central = [p for p in nm.reporter.of("checkpoint_saved", first.batch_id) if p["step"] == 8]
        assert central and central[0]["kind"] == "central"
        assert second.source.point.step == 8 and second.source.uri == central[0]["uri"]
    finally:
        await nm.close()
    for rec, t in zip(recs, tuned, strict=True):
        assert rec.metrics == await asyncio.to_thread(reference_metrics, tmp_path, fixed, t, 16)


async def test_a_crash_is_retried_and_fails_the_request_after_max_attempts(
    scheduling: MasterApp, grpc_target: str, tmp_path: Path
) -> None:
    app = scheduling
    app.service.retry = RetryPolicy(2)
    once = fixed_part(FAULTY, fault="exit", fault_step=3, fault_once=str(tmp_path / "crashed-once"))
    always = fixed_part(FAULTY, fault="exit", fault_step=3)
    nm = await start_node_manager(grpc_target, tmp_path, cpu_slots=2)
    try:
        study, ids = await submit(app, [(config_json(once, lr=0.1), 10), (config_json(always, lr=0.1), 10)])
        recovered, failed = await finished(app, study, ids)
    finally:
        await nm.close()
    assert recovered.state == "DONE" and recovered.metrics
    assert failed.state == "FAILED"
    assert f"worker exited with status {EXIT_CODE}" in (failed.error or "")
    ends = [end for _, end in nm.reporter.ends]
    assert sorted(e.status for e in ends) == ["failed", "failed", "failed", "finished"]
    assert all(not e.by_worker and not e.oom for e in ends if e.status == "failed")


async def test_preempted_batch_resumes_from_its_checkpoint_exactly(
    scheduling: MasterApp, grpc_target: str, tmp_path: Path
) -> None:
    app = scheduling
    fixed = fixed_part(FAULTY, seed=2, sleep_s=0.02, dropout=0.1)
    tuned = {"lr": 0.1, "momentum": 0.9, "bs": 16}
    steps = 50
    nm = await start_node_manager(grpc_target, tmp_path)
    try:
        study, ids = await submit(app, [(config_json(fixed, **tuned), steps)])
        started = await until(lambda: nm.reporter.of("batch_started"), 30, "the batch to start")
        first = started[0]["batch_id"]
        await until(lambda: nm.reporter.progress(first) >= 5, 30, "progress")
        assert await asyncio.to_thread(app.service.preempt, ADMIN, first)
        (rec,) = await finished(app, study, ids)
    finally:
        await nm.close()
    assert rec.state == "DONE"
    assert app.store.batches.get_batch(first).state == "PREEMPTED"
    (stop,) = nm.reporter.of("batch_preempted", first)
    assert 5 <= stop["step"] < steps
    saved = [p for p in nm.reporter.of("checkpoint_saved", first) if p["kind"] == "peripheral"]
    (ckpt,) = [p for p in saved if p["step"] == stop["step"]]
    assert ckpt["uri"] == stop["uri"] and LocalCheckpointStore(nm.checkpoint_root).exists(ckpt["uri"])
    # the steps before it were kept in memory and written as one pack when the batch stopped
    assert sorted(p["step"] for p in saved if p is not ckpt) == list(range(1, stop["step"]))
    resumed = [i.batch_id for i, end in nm.reporter.ends if end.status == "finished"]
    (second,) = resumed
    spec = BatchSpec.from_json(json.loads(app.store.batches.get_batch(second).spec_json))
    assert spec.source == Source(Point(stop["node"], stop["step"]), stop["uri"])
    assert nm.reporter.steps_trained() == steps - stop["step"]
    assert rec.metrics == await asyncio.to_thread(reference_metrics, tmp_path, fixed, tuned, steps)


async def test_cancel_aborts_the_running_worker(scheduling: MasterApp, grpc_target: str, tmp_path: Path) -> None:
    app = scheduling
    fixed = fixed_part(FAULTY, sleep_s=0.05)
    nm = await start_node_manager(grpc_target, tmp_path)
    try:
        study, (rid,) = await submit(app, [(config_json(fixed, lr=0.1), 400)])
        started = await until(lambda: nm.reporter.of("batch_started"), 30, "the batch to start")
        batch = started[0]["batch_id"]
        rec = await asyncio.to_thread(app.service.cancel, ALICE, study, rid)
        assert rec.state == "CANCELLED"
        await until(lambda: nm.reporter.ends, 15, "the worker to be killed")
        ((info, end),) = nm.reporter.ends
        assert info.batch_id == batch and end.status == "aborted"
        assert nm.nm.running() == []
        assert app.store.batches.get_batch(batch).state == "ABORTED"
        assert not nm.reporter.of("batch_finished")
    finally:
        await nm.close()
