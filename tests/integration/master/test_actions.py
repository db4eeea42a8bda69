"""Control actions on the assignment stream, bounded retries and the checkpoint budget, against real
databases: a cancel that leaves a batch useless aborts it on its node manager; a preempted batch's rest
resumes from its checkpoint without counting as a failure; a request whose work fails ``max_attempts``
times fails with the error; checkpoints over budget are evicted (never a pinned one) and deleted."""

from __future__ import annotations

import json

import pytest

from stagetree.core.batch import BatchSpec, Point
from stagetree.core.errors import InvalidArgument, NotFound, PermissionDenied
from stagetree.core.lifecycle import CheckpointPoint, MetricPoint
from stagetree.master.app import MasterApp
from stagetree.master.service import SubmitItem
from tests.integration.master.test_scheduling import ADMIN, ALICE, _node_manager, _submit
from tests.reports import attempt_report


def _dispatch_one(app: MasterApp, nm: str) -> BatchSpec:
    (bid,) = app.scheduler.run_round().dispatched
    (a,) = app.service.take_assignments(ADMIN, nm)
    assert a.kind == "RUN" and a.batch_id == bid
    return BatchSpec.from_json(json.loads(a.spec_json))


def test_cancel_of_the_last_request_aborts_the_batch_on_its_node_manager(app: MasterApp) -> None:
    study, (rid,) = _submit(app, 1)
    nm = _node_manager(app, 1)
    spec = _dispatch_one(app, nm)
    app.service.cancel(ALICE, study, rid)
    (abort,) = app.service.take_assignments(ADMIN, nm)
    assert (abort.kind, abort.batch_id, abort.attempt) == ("ABORT", spec.batch_id, 1)
    assert app.store.batches.get_batch(spec.batch_id).state == "ABORTED"
    assert app.service.take_assignments(ADMIN, nm) == []  # sent once
    # the aborted attempt's late report changes nothing
    assert app.service.report_batch(ADMIN, attempt_report(spec.batch_id, 1, ok=True, metrics=[])) == []


def test_preempted_batch_resumes_from_its_checkpoint_without_counting_a_failure(app: MasterApp) -> None:
    study, (rid,) = _submit(app, 1, step=20)
    nm = _node_manager(app, 1)
    spec = _dispatch_one(app, nm)
    assert app.service.preempt(ADMIN, spec.batch_id)
    (order,) = app.service.take_assignments(ADMIN, nm)
    assert (order.kind, order.batch_id) == ("PREEMPT", spec.batch_id)
    node = spec.stages[-1].node
    app.service.report_batch(
        ADMIN,
        attempt_report(
            spec.batch_id,
            1,
            ok=False,
            checkpoints=[CheckpointPoint(node, 7, "file:///p7", 10, "peripheral")],
            preempted=True,
        ),
    )
    assert app.store.batches.get_batch(spec.batch_id).state == "PREEMPTED"
    again = _dispatch_one(app, nm)
    assert again.source.point == Point(node, 7) and again.steps == 13
    app.service.report_batch(
        ADMIN, attempt_report(again.batch_id, 1, ok=True, metrics=[MetricPoint(node, 20, {"loss": 0.5})])
    )
    (req,) = app.service.get_requests(ALICE, study, [rid])
    assert req.state == "DONE" and req.metrics == {"loss": 0.5} and req.error is None


def test_request_fails_with_the_error_after_max_attempts(app: MasterApp) -> None:
    study, (rid,) = _submit(app, 1)
    nm = _node_manager(app, 2)  # 2 slots: the retry after the out of memory takes both (TreeML §5.2)
    for attempt in range(app.service.retry.max_failures):
        spec = _dispatch_one(app, nm)
        (req,) = app.service.get_requests(ALICE, study, [rid])
        assert req.state == "SCHED", attempt
        app.service.report_batch(
            ADMIN, attempt_report(spec.batch_id, 1, ok=False, error="ValueError: bad lr", oom=attempt == 0)
        )
    (req,) = app.service.get_requests(ALICE, study, [rid])
    assert req.state == "FAILED" and req.error == "ValueError: bad lr"
    assert app.scheduler.run_round().dispatched == []  # not retried forever
    (done,) = app.service.finished(ALICE, study, [rid])
    assert done.state == "FAILED"


def test_an_out_of_memory_with_no_wider_node_manager_fails_at_once_saying_why(app: MasterApp) -> None:
    study, (rid,) = _submit(app, 1)
    nm = _node_manager(app, 1)
    spec = _dispatch_one(app, nm)
    app.service.report_batch(ADMIN, attempt_report(spec.batch_id, 1, ok=False, error="CUDA out of memory", oom=True))
    assert app.scheduler.run_round().dispatched == []
    (req,) = app.service.get_requests(ALICE, study, [rid])
    assert req.state == "FAILED" and req.error is not None
    assert "out of memory on 1 slot(s): the retry would take 2 slots and the largest node manager has 1" in req.error


def test_checkpoints_over_budget_are_evicted_and_deleted_but_never_a_pinned_one(app: MasterApp) -> None:
    study, _ = _submit(app, 2, step=30)
    nm = _node_manager(app, 2)
    report = app.scheduler.run_round()
    assert len(report.dispatched) == 2
    specs = [BatchSpec.from_json(json.loads(a.spec_json)) for a in app.service.take_assignments(ADMIN, nm)]
    for spec in specs:
        node = spec.stages[-1].node
        ckpts = [CheckpointPoint(node, s, f"file:///{node}-{s}", 1000, "peripheral") for s in (10, 20, 30)]
        app.service.report_batch(
            ADMIN,
            attempt_report(
                spec.batch_id, 1, ok=True, metrics=[MetricPoint(node, 30, {"loss": 0.1})], checkpoints=ckpts
            ),
        )
    assert app.store.checkpoints.checkpoint_bytes() == 6000
    # a new request at step 40 of the first config will start from its step-30 checkpoint: pinned
    first = specs[0].stages[-1].node
    app.service.submit(ALICE, study, [app_item(specs[0], 40)])
    app.scheduler.settings.checkpoint_budget_bytes = 2500
    try:
        decided = app.scheduler.decide()  # the round chooses; only its evictions are carried out here
        evicted = decided.decision.evictions
        app.scheduler.applier.evict(evicted, decided.read, app.scheduler.files)
    finally:
        app.scheduler.settings.checkpoint_budget_bytes = None
    assert Point(first, 30) not in evicted
    assert len(evicted) == 4 and app.store.checkpoints.checkpoint_bytes() == 2000
    (delete,) = app.service.take_assignments(ADMIN, nm)
    assert delete.kind == "DELETE_CHECKPOINTS"
    assert sorted(delete.checkpoint_uris) == sorted(f"file:///{p.node}-{p.step}" for p in evicted)


def app_item(spec: BatchSpec, step: int) -> SubmitItem:
    """The config of the batch's last stage, asked at another step (as the plan view gives it)."""
    cfg = {"fixed": spec.fixed.to_json(), "tuned": spec.stages[-1].config.to_json()}
    return SubmitItem(f"more-{step}", json.dumps(cfg), step)


def test_reports_of_several_batches_in_one_call_reject_only_the_bad_message(app: MasterApp) -> None:
    study, rids = _submit(app, 3)
    nm = _node_manager(app, 3)
    assert len(app.scheduler.run_round().dispatched) == 3
    specs = [BatchSpec.from_json(json.loads(a.spec_json)) for a in app.service.take_assignments(ADMIN, nm)]
    good, bad_step, other = specs
    reports = [
        attempt_report(good.batch_id, 1, True, [MetricPoint(good.end.node, 10, {"loss": 0.1})]),
        attempt_report(bad_step.batch_id, 1, True, [MetricPoint(bad_step.end.node, 2**31, {"loss": 0.2})]),
        attempt_report(987_654_321, 1, True, []),
        attempt_report(other.batch_id, 1, True, [MetricPoint(other.end.node, 10, {"loss": 0.3})]),
    ]
    with pytest.raises(PermissionDenied):
        app.service.report_batches(ALICE, reports)
    assert {r.state for r in app.service.get_requests(ALICE, study, rids)} == {"SCHED"}  # nothing applied

    got = app.service.report_batches(ADMIN, reports)
    assert isinstance(got[1], InvalidArgument) and "out of range" in str(got[1])
    assert isinstance(got[2], NotFound) and "987654321" in str(got[2])
    assert got[0] == [r.id for r in app.service.get_requests(ALICE, study, rids) if r.batch_id == good.batch_id]
    state_of = {r.batch_id: (r.state, r.metrics) for r in app.service.get_requests(ALICE, study, rids)}
    assert state_of[good.batch_id] == ("DONE", {"loss": 0.1}) and state_of[other.batch_id] == ("DONE", {"loss": 0.3})
    # as on the bus, the rest of its report applies: it ended without the metrics, so its request goes back
    assert bad_step.batch_id not in state_of
    assert app.store.batches.get_batch(bad_step.batch_id).state == "DONE"
    assert {r.state for r in app.service.get_requests(ALICE, study, rids) if r.batch_id is None} == {"NOT_SCHED"}
