"""A study's stats count what its batches trained and where their time went, against real databases:
the steps of an attempt lost with its node manager count (also those a later batch resumed from its
checkpoint), and the time a batch waited for its slot is queueing, never compute."""

from __future__ import annotations

import json
import time

import pytest

from stagetree.bus.messages import CheckpointSaved, Metrics, Progress, make_msg_id
from stagetree.core.batch import BatchSpec
from stagetree.core.lifecycle import AttemptTiming, MetricPoint
from stagetree.master.app import MasterApp
from stagetree.master.auth import Principal
from stagetree.master.service import SubmitItem
from stagetree.master.store.ingest import Ingestor
from tests.integration.master.helpers import config_json, fixed, unique
from tests.reports import attempt_report

ALICE = Principal("alice")
ADMIN = Principal("admin", admin=True)


def _node_manager(app: MasterApp, slots: int = 1) -> str:
    nm = unique("nm")
    app.service.register_node_manager(ADMIN, nm, "local", [(f"g{i}", "cpu") for i in range(slots)])
    app.coordination.heartbeat(nm, 30)
    return nm


def _spec(app: MasterApp, batch_id: int) -> BatchSpec:
    return BatchSpec.from_json(json.loads(app.store.batches.get_batch(batch_id).spec_json))


def test_the_steps_of_an_attempt_lost_with_its_node_manager_count(app: MasterApp) -> None:
    study = app.service.create_study(ALICE, unique("s"))
    (req,) = app.service.submit(ALICE, study.id, [SubmitItem("r", config_json(fixed(), lr=0.1), 40)])
    lost_nm = _node_manager(app)
    (lost,) = app.scheduler.run_round().dispatched
    node = _spec(app, lost).stages[-1].node
    seq = iter(range(100))

    def ids(batch: int) -> dict[str, object]:
        return {"msg_id": make_msg_id(lost_nm, batch, 1, next(seq)), "node_manager": lost_nm, "batch_id": batch}

    ingest = Ingestor(app.store, app.service.plans)
    # it trained to step 31 and saved at 25, then its node manager went away
    ingest.apply(
        [
            Progress(**ids(lost), attempt=1, node=node, step=12),  # type: ignore[arg-type]
            CheckpointSaved(**ids(lost), attempt=1, node=node, step=25, uri="file:///c/25", bytes=1, kind="peripheral"),  # type: ignore[arg-type]
            Progress(**ids(lost), attempt=1, node=node, step=31),  # type: ignore[arg-type]
        ]
    )
    app.store.ledger.mark_lost(lost_nm)
    nm = _node_manager(app)
    (again,) = app.scheduler.run_round().dispatched
    assert _spec(app, again).source.point.step == 25  # resumed from the lost attempt's checkpoint
    assert app.service.take_assignments(ADMIN, nm)
    report = attempt_report(again, 1, True, [MetricPoint(node, 40, {"loss": 0.5})])
    assert app.service.report_batch(ADMIN, report) == [req.id]

    stats = app.service.study_stats(ALICE, study.id)
    # 31 steps by the lost attempt (6 of them trained again), 15 by the one that resumed at 25
    assert (stats.steps_executed, stats.unique_steps) == (31 + 15, 40)
    assert app.store.batches.executed_steps(app.store.batches.get_batch(again).plan_id) == 31 + 15
    assert app.service.delete_study(ALICE, study.id) == 1  # with the record of its requeue


def test_a_batch_whose_metrics_answered_before_its_end_was_applied_counts_what_it_trained(app: MasterApp) -> None:
    """The metrics that answer a request are applied before the batch's end (which comes on its own
    message): stats read as the study's last request is answered count the batch that answered it."""
    study = app.service.create_study(ALICE, unique("s"))
    (req,) = app.service.submit(ALICE, study.id, [SubmitItem("r", config_json(fixed(), lr=0.1), 40)])
    nm = _node_manager(app)
    (batch,) = app.scheduler.run_round().dispatched
    node = _spec(app, batch).stages[-1].node
    assert app.service.take_assignments(ADMIN, nm)
    ids = {"msg_id": make_msg_id(nm, batch, 1, 0), "node_manager": nm, "batch_id": batch}
    Ingestor(app.store, app.service.plans).apply([Metrics(**ids, attempt=1, node=node, step=40, metrics={"loss": 0.5})])  # type: ignore[arg-type]
    assert app.service.get_requests(ALICE, study.id, [req.id])[0].state == "DONE"  # answered, batch RUNNING
    assert app.store.batches.get_batch(batch).state == "RUNNING"
    stats = app.service.study_stats(ALICE, study.id)
    assert (stats.steps_executed, stats.unique_steps) == (40, 40)


def test_time_a_batch_waits_for_its_slot_is_queueing_and_never_compute(app: MasterApp) -> None:
    study = app.service.create_study(ALICE, unique("s"))
    f = fixed()
    app.service.submit(ALICE, study.id, [SubmitItem(f"r{i}", config_json(f, lr=0.1 * (i + 1)), 10) for i in range(2)])
    nm = _node_manager(app)
    app.scheduler.settings = app.scheduler.settings.model_copy(update={"lookahead_s": 60.0})
    (first,) = app.scheduler.run_round().dispatched
    (second,) = app.scheduler.run_round().dispatched  # sent ahead: it waits behind the first on the slot
    assert len(app.service.take_assignments(ADMIN, nm)) == 2
    dispatched = time.time()
    time.sleep(0.5)  # the first batch runs; the second waits
    node_of = {b: _spec(app, b).stages[-1].node for b in (first, second)}
    given = time.time()
    app.service.report_batch(
        ADMIN,
        attempt_report(
            first,
            1,
            True,
            [MetricPoint(node_of[first], 10, {"loss": 1.0})],
            timing=AttemptTiming(dispatched, 0.05, 0.01, 0.4),
        ),
    )
    # the second's worker is handed it only now: its half second behind the first is queueing
    app.service.report_batch(
        ADMIN,
        attempt_report(
            second,
            1,
            True,
            [MetricPoint(node_of[second], 10, {"loss": 1.0})],
            timing=AttemptTiming(given, 0.05, 0.01, 0.2),
        ),
    )
    stats = app.service.study_stats(ALICE, study.id)
    assert stats.compute_seconds == pytest.approx(0.4 + 0.2)
    assert stats.queue_seconds >= 0.5
    assert (stats.startup_seconds, stats.checkpoint_seconds) == pytest.approx((0.1, 0.02))
    assert stats.steps_executed == 20
