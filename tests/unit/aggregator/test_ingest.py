"""Ingest semantics on SQLite: the effects of each message kind, idempotence, rejection, and parity with
the master's direct path (``MasterService.report_batch``)."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from stagetree.bus.messages import GpuTelemetry, Message
from stagetree.core.lifecycle import BatchState, CheckpointPoint, MetricPoint, RankChange, RequestState, RetryPolicy
from stagetree.master.auth import Principal
from stagetree.master.service import MasterService
from stagetree.master.settings import LimitSettings
from stagetree.master.store import models as m
from stagetree.master.store.ingest import Ingestor
from stagetree.master.store.records import metric_value
from stagetree.master.store.store import Store, make_engine
from tests.reports import attempt_report
from tests.unit.aggregator.helpers import BRANCH, World, applied_count, make_world


def started_at(store: Store, batch_id: int) -> float | None:
    with store.db.tx("read") as s:
        return s.execute(select(m.BatchAttempt.started_at).where(m.BatchAttempt.batch_id == batch_id)).scalar()


def test_metrics_are_stored_and_complete_the_requests_waiting_there(world: World) -> None:
    batch, (a, b, c) = world.dispatch([(world.root, 10), (world.root, 20), (world.child, 80)])
    ing = Ingestor(world.store)
    res = ing.apply([world.metrics(batch.id, world.root, 10), world.metrics(batch.id, world.child, 80)])
    assert (res.applied, res.points, res.duplicates, res.rejected) == (2, 2, 0, 0)
    assert sorted(res.completed) == sorted([a.id, c.id])
    assert res.results_changed and not res.round_needed
    assert world.request_states([a.id, b.id, c.id]) == [RequestState.DONE, RequestState.SCHED, RequestState.DONE]
    assert world.store.requests.metrics_at(world.root, 10) == {"loss": 1.0 / 11}
    (done,) = world.store.requests.done_since(world.study, [c.id])
    assert done.metrics == {"loss": 1.0 / 81}


def test_a_not_yet_scheduled_request_at_the_point_is_completed_too(world: World) -> None:
    batch, _ = world.dispatch([(world.root, 10)])
    (waiting,) = world.requests([(world.root, 10)])  # another study's trial, same point, still NOT_SCHED
    res = Ingestor(world.store).apply([world.metrics(batch.id, world.root, 10)])
    assert waiting.id in res.completed
    assert world.request_states([waiting.id]) == [RequestState.DONE]


def test_a_message_delivered_twice_changes_nothing_the_second_time(world: World) -> None:
    batch, reqs = world.dispatch([(world.root, 10), (world.root, 20)])
    msgs: list[Message] = [
        world.metrics(batch.id, world.root, 10),
        world.checkpoint(batch.id, world.root, 20),
        world.metrics(batch.id, world.root, 20, {"loss": 0.5}),
        world.finished(batch.id, 20),
    ]
    ing = Ingestor(world.store)
    first = ing.apply(msgs)
    assert (first.applied, first.duplicates) == (4, 0)
    after_first = world.state()

    # Redelivered, and with a different value at the same point: the first value stays.
    again = ing.apply(msgs)
    assert (again.applied, again.duplicates, again.points) == (0, 4, 0)
    assert again.completed == again.finished == again.requeued == []
    assert not again.results_changed and not again.round_needed
    assert world.state() == after_first
    # A fresh ingestor (an aggregator restarted) agrees: the dedup lives in the database.
    assert Ingestor(world.store).apply(msgs).applied == 0
    assert applied_count(world.store, world.nm) == 4
    assert world.request_states([r.id for r in reqs]) == [RequestState.DONE, RequestState.DONE]


def test_the_same_message_twice_in_one_apply_is_applied_once(world: World) -> None:
    batch, _ = world.dispatch([(world.root, 10)])
    m = world.metrics(batch.id, world.root, 10)
    res = Ingestor(world.store).apply([m, m])
    assert (res.applied, res.duplicates) == (1, 1)


def test_points_are_canonicalized_a_branch_start_is_the_parents_point(world: World) -> None:
    batch, (r,) = world.dispatch([(world.root, BRANCH)])
    res = Ingestor(world.store).apply(
        [world.metrics(batch.id, world.child, BRANCH), world.checkpoint(batch.id, world.child, BRANCH)]
    )
    assert res.completed == [r.id]
    assert world.store.requests.metrics_at(world.root, BRANCH) is not None
    assert world.store.checkpoints.checkpoints(world.plan_id) == {
        (world.root, BRANCH): f"file:///ckpt/{world.child}/{BRANCH}"
    }


def test_finish_requeues_only_what_got_no_metrics_and_frees_the_slot(world: World) -> None:
    batch, (a, b) = world.dispatch([(world.root, 10), (world.root, 20)])
    res = Ingestor(world.store).apply([world.metrics(batch.id, world.root, 10), world.finished(batch.id, 20)])
    assert res.completed == [a.id] and res.requeued == [b.id] and res.finished == [batch.id]
    assert res.round_needed and res.results_changed
    assert world.request_states([a.id, b.id]) == [RequestState.DONE, RequestState.NOT_SCHED]
    assert world.store.batches.get_batch(batch.id).state == BatchState.DONE
    assert (world.nm, "gpu0") not in world.store.rounds.busy_slots()


def test_metrics_and_finish_in_one_apply_never_requeue_the_work_just_done(world: World) -> None:
    # The terminal event arrives last on the batch's partition; the apply keeps that order.
    batch, reqs = world.dispatch([(world.root, s) for s in (10, 20, 30)])
    msgs: list[Message] = [world.metrics(batch.id, world.root, s) for s in (10, 20, 30)]
    res = Ingestor(world.store).apply([*msgs, world.finished(batch.id, 30)])
    assert res.requeued == []
    assert world.request_states([r.id for r in reqs]) == [RequestState.DONE] * 3


def test_failures_are_bounded_and_out_of_memory_is_named(world: World) -> None:
    ing = Ingestor(world.store, max_failures=2)
    batch, (r,) = world.dispatch([(world.root, 10)])
    first = ing.apply([world.failed(batch.id, "CUDA error", oom=True)])
    assert first.requeued == [r.id] and first.failed_requests == []
    (rec,) = world.store.requests.get_requests(world.study, [r.id])
    assert rec.state == RequestState.NOT_SCHED
    assert world.store.batches.get_batch(batch.id).state == BatchState.OUT_OF_MEMORY

    retry = world.dispatch_ids([r.id])
    second = ing.apply([world.failed(retry.id, "CUDA error", oom=True)])
    assert second.failed_requests == [r.id] and second.requeued == []
    assert second.results_changed
    (rec,) = world.store.requests.get_requests(world.study, [r.id])
    assert rec.state == RequestState.FAILED and rec.error == "out of memory: CUDA error"


def test_a_preemption_records_its_checkpoint_and_is_not_a_failure(world: World) -> None:
    ing = Ingestor(world.store, max_failures=1)
    batch, (_a, b) = world.dispatch([(world.root, 10), (world.root, 40)])
    res = ing.apply([world.metrics(batch.id, world.root, 10), world.preempted(batch.id, world.root, 25)])
    assert res.requeued == [b.id] and res.failed_requests == [] and res.checkpoints == 1
    assert world.store.batches.get_batch(batch.id).state == BatchState.PREEMPTED
    assert world.store.checkpoints.checkpoints(world.plan_id) == {(world.root, 25): "file:///pre/25"}
    assert world.state()["checkpoints"] == [(world.root, 25, "file:///pre/25", "peripheral", 1)]
    (rec,) = world.store.requests.get_requests(world.study, [b.id])
    assert rec.state == RequestState.NOT_SCHED


def test_a_report_for_an_attempt_that_is_not_running_is_ignored(world: World) -> None:
    batch, (r,) = world.dispatch([(world.root, 10)])
    world.store.ledger.mark_lost(world.nm)  # the master gave up on it; the request is NOT_SCHED again
    before = world.state()
    res = Ingestor(world.store).apply([world.finished(batch.id, 10), world.failed(batch.id, attempt=7)])
    assert res.stale == 2 and res.finished == [] and res.requeued == []
    assert world.state() == before
    assert world.request_states([r.id]) == [RequestState.NOT_SCHED]


def test_messages_that_can_never_apply_are_rejected_and_the_rest_is_applied(world: World) -> None:
    batch, (r,) = world.dispatch([(world.root, 10)])
    bad: list[Message] = [
        world.metrics(10**12, world.root, 10),  # no such batch
        world.metrics(batch.id, 10**12, 10),  # no such node
        world.metrics(batch.id, world.child, BRANCH - 1),  # before the node's start
        world.metrics(batch.id, world.root, 2**40),  # a step the column cannot hold
    ]
    good = world.metrics(batch.id, world.root, 10)
    ing = Ingestor(world.store)
    res = ing.apply([*bad, good])
    assert (res.applied, res.rejected, res.points) == (1, 4, 1)
    assert res.completed == [r.id]
    again = ing.apply(bad)  # recorded as handled: a redelivery is a duplicate, not logged again
    assert (again.duplicates, again.rejected) == (4, 0)


def test_kinds_without_a_database_effect_are_counted_and_leave_no_trace(world: World) -> None:
    world.dispatch([(world.root, 10)])
    telemetry = GpuTelemetry(
        msg_id="t-1", node_manager=world.nm, gpu_index=0, utilization=50, memory_used=1, memory_total=2, ts=1.0
    )
    before = world.state()
    res = Ingestor(world.store).apply([telemetry])
    assert (res.ignored, res.applied) == (1, 0)
    assert world.state() == before
    assert applied_count(world.store) == 0


def test_log_lines_are_kept_with_their_attempt_once_and_shown_with_the_requests_it_carried(world: World) -> None:
    batch, (r,) = world.dispatch([(world.root, 10)])
    lines: list[Message] = [
        world.log_line(batch.id, 0, "epoch 1", world.root, 4, at=10.0),
        world.log_line(batch.id, 1, "epoch 2", world.root, 8, at=11.0),
    ]
    ing = Ingestor(world.store)
    res = ing.apply(lines)
    assert (res.applied, res.log_lines, res.duplicates) == (2, 2, 0)
    assert not res.results_changed and not res.round_needed  # nothing to wake for
    after_first = world.state()
    assert after_first["log_lines"] == [
        (batch.id, 1, 0, world.root, 4, 10.0, "epoch 1"),
        (batch.id, 1, 1, world.root, 8, 11.0, "epoch 2"),
    ]
    # the same messages again, in one apply and in a later one: one row each
    again = ing.apply([*lines, *lines])
    assert (again.applied, again.log_lines, again.duplicates) == (0, 0, 4)
    assert world.state() == after_first
    # the same line under another id (a producer that numbers its messages afresh): the same row
    assert ing.apply([world.log_line(batch.id, 1, "epoch 2", world.root, 8, at=11.0)]).log_lines == 1
    assert world.state() == after_first
    got = world.store.batches.request_log_lines(r.id)
    assert [(ln.seq, ln.node, ln.step, ln.line) for ln in got] == [
        (0, world.root, 4, "epoch 1"),
        (1, world.root, 8, "epoch 2"),
    ]


def test_a_requests_log_holds_every_batch_that_carried_it_in_the_order_they_ran(world: World) -> None:
    first, (r,) = world.dispatch([(world.root, 10)])
    ing = Ingestor(world.store, max_failures=3)
    ing.apply([world.log_line(first.id, 0, "first try"), world.failed(first.id)])  # requeued: r moves on
    second = world.dispatch_ids([r.id])
    ing.apply([world.log_line(second.id, 0, "second try"), world.metrics(second.id, world.root, 10)])
    got = world.store.batches.request_log_lines(r.id)
    assert [(ln.batch_id, ln.line) for ln in got] == [(first.id, "first try"), (second.id, "second try")]
    assert world.store.batches.request_log_lines(10**12) == []


def test_a_log_line_of_an_unknown_batch_or_attempt_is_not_kept(world: World) -> None:
    batch, _ = world.dispatch([(world.root, 10)])
    res = Ingestor(world.store).apply(
        [world.log_line(10**12, 0, "no such batch"), world.log_line(batch.id, 0, "no such attempt", attempt=9)]
    )
    assert (res.rejected, res.log_lines) == (1, 0)
    assert world.state()["log_lines"] == []


def test_forgetting_a_plan_drops_its_batches_log_lines(world: World) -> None:
    batch, _ = world.dispatch([(world.root, 10)])
    Ingestor(world.store).apply([world.log_line(batch.id, 0, "x"), world.metrics(batch.id, world.root, 10)])
    assert len(world.state()["log_lines"]) == 1
    world.store.retention.forget_plan(world.plan_id)
    assert world.state()["log_lines"] == []


def _attempt_work(store: Store, batch_id: int) -> tuple[Any, ...]:
    a = m.BatchAttempt
    with store.db.tx("read") as s:
        row = s.execute(
            select(a.reached_step, a.given_at, a.startup_s, a.checkpoint_s, a.train_s).where(a.batch_id == batch_id)
        ).one()
    return tuple(row)


def test_progress_and_checkpoints_record_the_furthest_step_an_attempt_trained_to_in_any_order(world: World) -> None:
    batch, _ = world.dispatch([(world.root, 40)])
    ing = Ingestor(world.store)
    res = ing.apply([world.progress(batch.id, world.root, 5), world.checkpoint(batch.id, world.root, 12)])
    assert (res.progress, res.ignored) == (1, 0)
    assert _attempt_work(world.store, batch.id)[0] == 12
    ing.apply([world.progress(batch.id, world.root, 9)])  # late, or redelivered: the furthest stays
    assert _attempt_work(world.store, batch.id)[0] == 12
    ing.apply([world.progress(batch.id, world.root, 17)])  # progress alone: no claim, no other effect
    assert _attempt_work(world.store, batch.id)[0] == 17
    assert applied_count(world.store) == 1  # the checkpoint's
    other, _ = world.dispatch([(world.root, 30)])
    ing.apply([world.progress(other.id, world.root, 29), world.finished(other.id, 30)])
    assert _attempt_work(world.store, other.id)[0] is None  # it ran to its end: all its steps count anyway


def test_a_workers_measure_of_its_time_is_recorded_on_its_attempt(world: World) -> None:
    batch, _ = world.dispatch([(world.root, 10)])
    ing = Ingestor(world.store)
    res = ing.apply([world.timing(batch.id, 1234.5, 2.0, 0.5, 7.25), world.finished(batch.id, 10)])
    assert res.timings == 1
    assert _attempt_work(world.store, batch.id)[1:] == (1234.5, 2.0, 0.5, 7.25)
    ing.apply([world.timing(batch.id, 1234.5, 2.0, 0.5, 7.25)])  # a redelivery says the same
    assert _attempt_work(world.store, batch.id)[1:] == (1234.5, 2.0, 0.5, 7.25)


def test_a_batch_start_is_recorded_once_and_the_cost_estimator_learns_from_it(world: World) -> None:
    batch, (_r,) = world.dispatch([(world.root, 10)])
    ing = Ingestor(world.store)
    res = ing.apply([world.started(batch.id)])
    assert (res.started, res.applied, res.ignored) == (1, 0, 0)
    assert applied_count(world.store) == 0  # needs no claim: the first word wins
    first = started_at(world.store, batch.id)
    assert first is not None
    time.sleep(0.01)
    ing.apply([world.started(batch.id)])  # a redelivery keeps the first time
    assert started_at(world.store, batch.id) == first
    ing.apply([world.finished(batch.id, 10)])
    [done] = world.store.batches.finished_attempts(0.0)
    with world.store.db.tx("read") as s:
        finished = s.execute(select(m.BatchAttempt.finished_at).where(m.BatchAttempt.batch_id == batch.id)).scalar()
    assert done.seconds == pytest.approx(finished - first)  # from the start, not the dispatch


def test_a_batch_start_takes_the_node_managers_time_but_never_one_ahead_of_now(world: World) -> None:
    (b1, _), (b2, _) = world.dispatch([(world.root, 10)]), world.dispatch([(world.root, 20)])
    ing = Ingestor(world.store)
    t = time.time()
    ing.apply([world.started(b1.id, at=t - 5.0), world.started(b2.id, at=t + 3600)])
    assert started_at(world.store, b1.id) == pytest.approx(t - 5.0)
    assert t <= (started_at(world.store, b2.id) or 0.0) <= time.time()  # a clock an hour ahead: now


def test_a_diverged_run_reports_nan_and_infinity(world: World) -> None:
    batch, _ = world.dispatch([(world.root, 10)])
    Ingestor(world.store).apply([world.metrics(batch.id, world.root, 10, {"loss": math.nan, "gn": -math.inf})])
    stored = world.store.requests.metrics_at(world.root, 10)
    assert stored is not None
    assert math.isnan(metric_value(stored["loss"])) and metric_value(stored["gn"]) == -math.inf


def test_an_apply_is_one_transaction(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    batch, (_a, _b) = world.dispatch([(world.root, 10), (world.root, 20)])
    ing = Ingestor(world.store)
    before = world.state()

    def crash(*_: Any) -> None:
        raise RuntimeError("crash after the metrics, before the finish")

    monkeypatch.setattr(ing.ledger, "end_attempts_in", crash)
    with pytest.raises(RuntimeError):
        ing.apply([world.metrics(batch.id, world.root, 10), world.finished(batch.id, 20)])
    assert world.state() == before
    assert applied_count(world.store) == 0
    monkeypatch.undo()
    assert ing.apply([world.metrics(batch.id, world.root, 10), world.finished(batch.id, 20)]).applied == 2


def test_applied_ids_can_be_pruned(world: World) -> None:
    batch, _ = world.dispatch([(world.root, 10)])
    ing = Ingestor(world.store)
    ing.apply([world.metrics(batch.id, world.root, 10)])
    assert ing.prune_applied(3600) == 0
    assert ing.prune_applied(1e-9) == 1


# -- parity with the master's direct path ---------------------------------------------------------------

SCENARIOS = ["finished", "failed", "oom", "preempted", "stale", "rescaled"]
RESUMED = 5  # "rescaled": the batch (on 2 ranks) resumed a 1-rank checkpoint of the root at this step


def _run_direct(world: World, scenario: str) -> None:
    svc = MasterService(world.store, LimitSettings())
    svc.retry = RetryPolicy(2)
    admin = Principal("admin", admin=True)
    batch, _ = world.dispatch([(world.root, 10), (world.child, 70), (world.root, 30)])
    metrics = [MetricPoint(world.root, 10, {"loss": 0.5}), MetricPoint(world.child, 70, {"loss": 0.25})]
    ranks = 2 if scenario == "rescaled" else 1
    ckpts = [CheckpointPoint(world.child, BRANCH, f"file:///ckpt/{world.child}/{BRANCH}", 1, "central", ranks)]
    rescaled = RankChange(world.root, RESUMED, f"file:///ckpt/{world.root}/{RESUMED}", 1, 2)
    if scenario == "stale":
        world.store.ledger.mark_lost(world.nm)
    if scenario == "preempted":
        ckpts.append(CheckpointPoint(world.root, 20, "file:///pre/20", 0, "peripheral"))  # as a node manager would
    ok = scenario in ("finished", "stale", "rescaled")
    for _ in range(2 if scenario in ("failed", "oom", "rescaled") else 1):  # "rescaled": a report retried
        report = attempt_report(
            batch.id,
            1,
            ok,
            metrics,
            ckpts,
            error="boom",
            oom=scenario == "oom",
            preempted=scenario == "preempted",
            rescaled=rescaled if scenario == "rescaled" else None,
        )
        svc.report_batch(admin, report)
        if scenario in ("failed", "oom"):
            pending = [rid for rid, _ in world.store.rounds.pending().get(world.plan_id, [])]
            if pending:
                batch = world.dispatch_ids(pending)


def _run_bus(world: World, scenario: str) -> None:
    ing = Ingestor(world.store, max_failures=2)
    batch, _ = world.dispatch([(world.root, 10), (world.child, 70), (world.root, 30)])
    if scenario == "stale":
        world.store.ledger.mark_lost(world.nm)
    resumed = [world.rescaled(batch.id, world.root, RESUMED, 1, 2)] if scenario == "rescaled" else []
    for _ in range(2 if scenario in ("failed", "oom", "rescaled") else 1):  # "rescaled": redelivered
        msgs: list[Message] = [
            *resumed,
            world.checkpoint(batch.id, world.child, BRANCH, ranks=2 if scenario == "rescaled" else 1),
            world.metrics(batch.id, world.root, 10, {"loss": 0.5}),
            world.metrics(batch.id, world.child, 70, {"loss": 0.25}),
        ]
        if scenario in ("finished", "stale", "rescaled"):
            msgs.append(world.finished(batch.id, 70))
        elif scenario == "preempted":
            msgs.append(world.preempted(batch.id, world.root, 20))
        else:
            msgs.append(world.failed(batch.id, "boom", oom=scenario == "oom"))
        ing.apply(msgs)
        if scenario in ("failed", "oom"):
            pending = [rid for rid, _ in world.store.rounds.pending().get(world.plan_id, [])]
            if pending:
                batch = world.dispatch_ids(pending)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_bus_path_has_the_same_effects_as_the_direct_report(
    scenario: str, migrated_sqlite: Path, tmp_path: Path
) -> None:
    states = []
    for name, run in (("direct", _run_direct), ("bus", _run_bus)):
        path = tmp_path / f"{name}.db"
        shutil.copyfile(migrated_sqlite, path)
        store = Store.open(make_engine(f"sqlite:///{path}"))
        try:
            world = make_world(store)
            run(world, scenario)
            state = world.state()
        finally:
            store.dispose()
        # the checkpoint bytes and kinds differ by design (a preemption reports no size); compare the rest
        state["checkpoints"] = [(*c[:3], c[4]) for c in state["checkpoints"]]
        states.append(state)
    direct, bus = states
    assert bus == direct
    # a resume on another number of ranks is recorded once per attempt, whatever was delivered twice
    rescaled = scenario == "rescaled"
    assert [c[3:] for c in bus["path_changes"]] == ([(RESUMED, 1, 2)] if rescaled else [])
    assert {c[-1] for c in bus["checkpoints"] if c[1] == BRANCH} == {2 if rescaled else 1}
