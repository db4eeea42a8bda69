"""Scheduling loop against real databases: dispatch to live node managers' free slots, requeue the work
of a lost node manager from its latest checkpoint, leader lease with a standby (real Redis)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import event

from stagetree.core.batch import BatchSpec, Point
from stagetree.core.config import Config
from stagetree.core.errors import NotFound, PermissionDenied
from stagetree.master import scheduling
from stagetree.master.app import MasterApp
from stagetree.master.auth import Principal
from stagetree.master.coordination import RedisCoordination
from stagetree.master.plans import config_text
from stagetree.master.scheduling import RoundReport, SchedulingLoop
from stagetree.master.service import SubmitItem
from stagetree.master.settings import SchedulingSettings
from stagetree.master.store.records import NewNode, NewRequest
from tests.integration.master.conftest import REDIS_URL
from tests.integration.master.helpers import config_json, fixed, unique
from tests.integration.nodemanager.helpers import until
from tests.reports import attempt_report

ALICE = Principal("alice")
ADMIN = Principal("admin", admin=True)


def _submit(app: MasterApp, n: int, step: int = 10) -> tuple[str, list[int]]:
    study = app.service.create_study(ALICE, unique("s"))
    f = fixed()
    items = [SubmitItem(f"r{i}", config_json(f, lr=0.01 * (i + 1)), step) for i in range(n)]
    return study.id, [r.id for r in app.service.submit(ALICE, study.id, items)]


def _node_manager(app: MasterApp, slots: int, ttl: float = 30) -> str:
    nm = unique("nm")
    app.service.register_node_manager(ADMIN, nm, "local", [(f"g{i}", "cpu") for i in range(slots)])
    app.coordination.heartbeat(nm, ttl)
    return nm


def test_round_fills_free_slots_and_never_sends_an_attempt_twice(app: MasterApp) -> None:
    _, _ = _submit(app, 3)
    nm = _node_manager(app, 2)
    # no lookahead: on a slow machine a busy slot's 10 s batch can look about to free by the last round
    app.scheduler.settings = app.scheduler.settings.model_copy(update={"lookahead_s": 0.0})
    first = app.scheduler.run_round()
    assert first.pending == 3 and len(first.dispatched) == 2 and first.queued == 1
    assert app.scheduler.run_round().dispatched == []  # no free slot left
    sent = app.service.take_assignments(ADMIN, nm)
    assert sorted(a.batch_id for a in sent) == sorted(first.dispatched)
    assert app.service.take_assignments(ADMIN, nm) == []
    specs = [BatchSpec.from_json(json.loads(a.spec_json)) for a in sent]
    assert {s.steps for s in specs} == {10}
    assert {(s.peripheral_every_steps, s.peripheral_every_s) for s in specs} == {(0, 60.0)}  # the defaults
    assert {a.slot_id for a in sent} == {"g0", "g1"}  # each batch names the slot it was placed on
    app.service.report_batch(ADMIN, attempt_report(specs[0].batch_id, 1, ok=True, metrics=[]))
    assert len(app.scheduler.run_round().dispatched) == 1  # the freed slot takes the queued batch


def test_a_slot_about_to_free_is_sent_its_next_batch_ahead_and_holds_one_at_most(app: MasterApp) -> None:
    _submit(app, 3)  # three 10-step batches, 10 s each by the default cost
    nm = _node_manager(app, 1)
    app.scheduler.settings = app.scheduler.settings.model_copy(update={"lookahead_s": 20.0})
    (first,) = app.scheduler.run_round().dispatched  # the free slot
    before = REGISTRY.get_sample_value("stagetree_master_batches_sent_ahead_total") or 0.0
    ahead = app.scheduler.run_round()  # the slot's batch ends within 20 s: its next goes now
    assert len(ahead.dispatched) == 1 and ahead.wake_at is None
    assert REGISTRY.get_sample_value("stagetree_master_batches_sent_ahead_total") == before + 1
    assert app.scheduler.run_round().dispatched == []  # one batch ahead at most
    sent = app.service.take_assignments(ADMIN, nm)
    assert [a.batch_id for a in sent] == [first, *ahead.dispatched] and {a.slot_id for a in sent} == {"g0"}
    app.service.report_batch(ADMIN, attempt_report(first, 1, ok=True, metrics=[]))
    assert len(app.scheduler.run_round().dispatched) == 1  # the batch sent ahead now runs alone: the third


def test_a_slot_further_from_its_end_is_not_sent_work_ahead_but_a_round_is_due_when_it_comes_close(
    app: MasterApp,
) -> None:
    _submit(app, 2)
    _node_manager(app, 1)
    app.scheduler.settings = app.scheduler.settings.model_copy(update={"lookahead_s": 3.0})
    assert len(app.scheduler.run_round().dispatched) == 1
    t = time.time()
    report = app.scheduler.run_round()
    assert report.dispatched == [] and report.wake_at is not None
    assert t + 10 - 3 - 1 < report.wake_at < time.time() + 10 - 3 + 1  # 10 s estimated, 3 s ahead
    app.scheduler.settings = app.scheduler.settings.model_copy(update={"lookahead_s": 0.0})
    off = app.scheduler.run_round()
    assert off.dispatched == [] and off.wake_at is None  # 0 turns it off


def test_lost_node_manager_work_restarts_from_its_latest_checkpoint(app: MasterApp) -> None:
    study, (rid,) = _submit(app, 1, step=20)
    lost = _node_manager(app, 1, ttl=0.3)
    (bid,) = app.scheduler.run_round().dispatched
    (sent,) = app.service.take_assignments(ADMIN, lost)
    spec_text = sent.spec_json
    spec = BatchSpec.from_json(json.loads(spec_text))
    node = spec.stages[-1].node
    app.store.checkpoints.record_checkpoint(
        node, 8, "file:///peripheral-8", 100, "peripheral"
    )  # as the aggregator would
    time.sleep(0.4)
    other = _node_manager(app, 1)
    report = app.scheduler.run_round()
    assert report.lost_node_managers == [lost]
    (new_bid,) = report.dispatched
    assert app.store.batches.get_batch(bid).state == "LOST"
    (again,) = app.service.take_assignments(ADMIN, other)
    attempt, text = again.attempt, again.spec_json
    again = BatchSpec.from_json(json.loads(text))
    assert attempt == 1 and again.batch_id == new_bid
    assert again.source.point == Point(node, 8) and again.source.uri == "file:///peripheral-8"
    assert again.steps == 12
    assert (
        app.service.report_batch(ADMIN, attempt_report(bid, 1, ok=True, metrics=[])) == []
    )  # late report of the lost attempt
    (req,) = app.service.get_requests(ALICE, study, [rid])
    assert req.state == "SCHED" and req.batch_id == new_bid


def _decide_cost(app: MasterApp, repeats: int = 5) -> tuple[float, int]:
    """The fastest of ``repeats`` reads-and-decides of a round (snapshot and decision, in ms; the fastest,
    since a loaded machine only ever adds to a run) and the SQL statements each one issued (all alike)."""
    engine = app.store.db.engine
    statements: list[int] = []

    def count(*_: object) -> None:
        statements[-1] += 1

    app.scheduler.decide()  # the first read loads the plans and the costs: the ones measured run warm
    fastest = float("inf")
    event.listen(engine, "before_cursor_execute", count)
    try:
        for _ in range(repeats):
            statements.append(0)
            decided = app.scheduler.decide()
            fastest = min(fastest, decided.read.snapshot_ms + decided.decide_ms)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert len(set(statements)) == 1, statements
    return fastest, statements[0]


def test_snapshot_of_many_pending_requests_scales_with_them(app: MasterApp) -> None:
    # costs read once (in the warm-up): a time-based re-read would make the statement counts differ
    app.scheduler.settings = app.scheduler.settings.model_copy(update={"cost_refresh_s": 3600.0})
    study = app.service.create_study(ALICE, unique("s"))
    f = fixed()

    def submit(plan: int, first: int, end: int) -> None:
        items = [
            SubmitItem(f"r{plan}-{i}", config_json(f, lr=0.001 * (i + 1), bs=plan + 1), 50) for i in range(first, end)
        ]
        app.service.submit(ALICE, study.id, items)

    _node_manager(app, 4)
    for plan in range(10):
        submit(plan, 0, 5)
    small_ms, small_statements = _decide_cost(app)  # the reference: ten plans of 5 pending requests
    for plan in range(10):
        submit(plan, 5, 50)
    large_ms, large_statements = _decide_cost(app)  # the same plans, ten times the requests
    # no statement per pending request, and at most linear in them (10x; 30x allows for the noise of
    # timing a few ms on a loaded machine; a quadratic snapshot would take about 100x)
    assert large_statements <= small_statements
    assert large_ms <= 30 * small_ms, (small_ms, large_ms)
    report = app.scheduler.run_round()
    assert report.pending == 500 and len(report.dispatched) == 4


async def test_standby_takes_over_when_the_lease_lapses(app: MasterApp) -> None:
    coord = RedisCoordination(REDIS_URL, prefix=unique("lease"))
    try:
        assert coord.acquire_lease("crashed-master", 0.6)  # a leader that will never renew
        standby = SchedulingLoop(
            app.store, app.service.plans, coord, SchedulingSettings(lease_ttl_s=0.3, round_interval_s=0.1), "standby"
        )
        stop = asyncio.Event()
        task = asyncio.create_task(standby.run(stop))
        await asyncio.sleep(0.3)
        assert not standby.is_leader
        deadline = time.monotonic() + 5
        while not standby.is_leader:
            assert time.monotonic() < deadline, "the standby never took the lease"
            await asyncio.sleep(0.05)
        assert not coord.acquire_lease("crashed-master", 5)
        stop.set()
        coord.notify("round")
        await asyncio.wait_for(task, 5)
        assert coord.acquire_lease("next", 5)  # released on a clean stop
    finally:
        coord.close()


def test_a_plan_whose_fixed_part_does_not_load_is_left_out_and_the_others_still_dispatch(app: MasterApp) -> None:
    # a plan row written by another version (or a test helper) whose fixed part has no trainer: every
    # dispatch renders the fixed part, so before the check one such plan failed every round
    bad_plan = app.store.plans.ensure_plan(unique("bad"), "{}")
    app.store.plans.insert_nodes(bad_plan, [NewNode(None, 0, "root", config_text(Config.of({"lr": 0.1})))])
    (root,) = app.store.plans.load_nodes(bad_plan)
    bad_study = app.store.studies.create_study("alice", unique("bad"), None)
    app.store.requests.add_requests(bad_study.id, bad_plan, [NewRequest("bad", root.id, 10)])
    good_study, good = _submit(app, 1)
    _node_manager(app, 2)
    first = app.scheduler.run_round()
    assert len(first.dispatched) == 1  # the good study's batch; the bad plan is left out
    assert [r.state for r in app.store.requests.get_requests(good_study, good)] == ["SCHED"]
    assert [r.state for r in app.store.requests.get_requests(bad_study.id)] == ["NOT_SCHED"]
    assert app.scheduler.run_round().dispatched == []  # and later rounds keep running


def test_heartbeats_that_arrive_together_fail_only_the_bad_ones(app: MasterApp) -> None:
    nm = _node_manager(app, 1)
    other = _node_manager(app, 1)
    errors = app.service.heartbeats([(ADMIN, nm, None), (ADMIN, "never-registered", []), (ALICE, other, None)])
    assert errors[0] is None
    assert isinstance(errors[1], NotFound) and "register it first" in errors[1].message
    assert isinstance(errors[2], PermissionDenied)
    assert {n.id: n.state for n in app.store.nodes.node_managers() if n.id in (nm, other)} == {
        nm: "ALIVE",
        other: "ALIVE",
    }
    with pytest.raises(NotFound):
        app.service.heartbeat(ADMIN, "never-registered")


def test_a_heartbeat_requeues_work_sent_long_ago_that_its_node_manager_never_got(app: MasterApp) -> None:
    # an assignment the stream took but the node manager never saw (seen once in 100k on the scale bench):
    # without this, its requests waited forever while the node manager stayed alive
    study, (rid,) = _submit(app, 1)
    nm = _node_manager(app, 1)
    (bid,) = app.scheduler.run_round().dispatched
    assert [a.batch_id for a in app.service.take_assignments(ADMIN, nm)] == [bid]  # sent
    app.service.heartbeat(ADMIN, nm, [])  # not listed, but sent only now: it may be on its way
    app.service.heartbeat(ADMIN, nm)  # an older node manager that does not list: nothing to judge
    app.service.heartbeat(ADMIN, nm, [(bid, 1)])
    assert [r.state for r in app.store.requests.get_requests(study, [rid])] == ["SCHED"]
    app.service.assignment_grace_s = 0.0  # as if a heartbeat TTL passed since it was sent
    app.service.heartbeat(ADMIN, nm, [(bid, 1)])  # listed: it runs there
    assert [r.state for r in app.store.requests.get_requests(study, [rid])] == ["SCHED"]
    app.service.heartbeat(ADMIN, nm, [])
    assert [r.state for r in app.store.requests.get_requests(study, [rid])] == ["NOT_SCHED"]
    (again,) = app.scheduler.run_round().dispatched  # and the freed slot takes it again
    assert again != bid


def test_a_plan_whose_first_trials_all_start_apart_keeps_no_snapshots_until_one_branches(app: MasterApp) -> None:
    settings = app.scheduler.settings
    probation = settings.snapshot_probation_roots
    assert probation > 0 and settings.snapshot_budget_bytes > 0
    study = app.service.create_study(ALICE, unique("s"))
    f = fixed()
    nm = _node_manager(app, probation + 4)

    def dispatch(items: list[SubmitItem]) -> list[int]:
        app.service.submit(ALICE, study.id, items)
        app.scheduler.run_round()
        specs = [BatchSpec.from_json(json.loads(a.spec_json)) for a in app.service.take_assignments(ADMIN, nm)]
        assert len(specs) == len(items)
        return [s.snapshot_budget_bytes for s in specs]

    # trials that differ from their first step: roots only; the first ones still keep snapshots
    apart = [SubmitItem(f"a{i}", config_json(f, lr=0.01 * (i + 1)), 10) for i in range(probation - 1)]
    assert dispatch(apart) == [settings.snapshot_budget_bytes] * (probation - 1)
    assert dispatch([SubmitItem("b", config_json(f, lr=0.5), 10)]) == [0]  # the probation-th root: none
    assert dispatch([SubmitItem("c", config_json(f, lr=0.6), 10)]) == [0]
    # a trial agreeing with "c" until step 5: the plan branched, and its batches keep them from now on
    late = {"kind": "multistep", "init": 0.6, "milestones": [5], "gamma": 0.5}
    assert dispatch([SubmitItem("d", config_json(f, lr=late), 10)]) == [settings.snapshot_budget_bytes]
    assert dispatch([SubmitItem("e", config_json(f, lr=0.7), 10)]) == [settings.snapshot_budget_bytes]


def _late_branch_while_running(app: MasterApp) -> tuple[str, BatchSpec]:
    """Trial "a" (20 steps) running on one of two CPU slots, and trial "b", which agrees with it until
    step 10, submitted meanwhile; the round that follows. The node manager and "a"'s spec."""
    study = app.service.create_study(ALICE, unique("s"))
    f = fixed()
    nm = _node_manager(app, 2)
    app.service.submit(ALICE, study.id, [SubmitItem("a", config_json(f, lr=0.6), 20)])
    app.scheduler.run_round()
    (sent,) = app.service.take_assignments(ADMIN, nm)
    spec = BatchSpec.from_json(json.loads(sent.spec_json))
    assert spec.snapshot_budget_bytes > 0  # one CPU slot: the batch keeps a snapshot of every step
    late = {"kind": "multistep", "init": 0.6, "milestones": [10], "gamma": 0.5}
    app.service.submit(ALICE, study.id, [SubmitItem("b", config_json(f, lr=late), 20)])
    # a free slot, yet "b" waits for the snapshot at step 10 instead of training steps 0-10 again
    waiting = app.scheduler.run_round()
    assert waiting.pending == 1 and waiting.dispatched == []
    return nm, spec


def _finish(app: MasterApp, spec: BatchSpec, checkpoints: list[tuple[int, int, str, int, str]]) -> None:
    node = spec.stages[0].node
    done = [(node, 20, {"loss": 0.5})]
    end = (node, 20, "file:///ckpt/a-20", 100, "central")
    app.service.report_batch(
        ADMIN, attempt_report(spec.batch_id, 1, ok=True, metrics=done, checkpoints=[*checkpoints, end])
    )
    assert len(app.scheduler.run_round().dispatched) == 1


def test_a_trial_branching_inside_a_running_batch_that_keeps_snapshots_waits_for_its_pack(app: MasterApp) -> None:
    nm, spec = _late_branch_while_running(app)
    node = spec.stages[0].node
    _finish(app, spec, [(node, s, f"file:///ckpt/pack-{s}", 100, "peripheral") for s in range(1, 20)])  # its pack
    (resumed,) = [BatchSpec.from_json(json.loads(a.spec_json)) for a in app.service.take_assignments(ADMIN, nm)]
    assert resumed.source.point == Point(node, 10) and resumed.source.uri == "file:///ckpt/pack-10"
    assert resumed.steps == 10


def test_work_waiting_for_a_snapshot_the_batch_did_not_keep_starts_from_the_checkpoint_before(
    app: MasterApp,
) -> None:
    nm, spec = _late_branch_while_running(app)
    _finish(app, spec, [])  # its trainer saves by itself (no snapshots): "a"'s own checkpoint only
    (fresh,) = [BatchSpec.from_json(json.loads(a.spec_json)) for a in app.service.take_assignments(ADMIN, nm)]
    assert fresh.source.uri is None and fresh.steps == 20  # from a fresh model: steps 0-10 again


def test_a_batch_on_a_gpu_keeps_no_snapshots(app: MasterApp) -> None:
    study = app.service.create_study(ALICE, unique("s"))
    nm = unique("nm")
    app.service.register_node_manager(ADMIN, nm, "local", [("gpu0", "A100")])
    app.coordination.heartbeat(nm, 30)
    app.service.submit(ALICE, study.id, [SubmitItem("a", config_json(fixed(), lr=0.6), 20)])
    app.scheduler.run_round()
    (sent,) = app.service.take_assignments(ADMIN, nm)
    # a copy per step would make every step wait for the device: the worker keeps none, and the round
    # must not wait for them
    assert BatchSpec.from_json(json.loads(sent.spec_json)).snapshot_budget_bytes == 0


async def test_a_wake_up_with_nothing_pending_after_a_quiet_round_runs_no_round(
    app: MasterApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that ends, a checkpoint written: with nothing pending, no round; work submitted: a round.
    A round that dispatched everything pending is quiet too."""
    monkeypatch.setattr(scheduling, "LIVENESS_CHECK_S", 60.0)  # no liveness round due meanwhile
    loop = SchedulingLoop(
        app.store, app.service.plans, app.coordination, SchedulingSettings(round_interval_s=30), unique("quiet")
    )
    reports: list[RoundReport] = []
    run_round = loop.run_round

    def counted(check_lost: bool = True) -> RoundReport:
        reports.append(run_round(check_lost))
        return reports[-1]

    loop.run_round = counted  # type: ignore[method-assign]
    skipped = REGISTRY.get_sample_value("stagetree_master_round_wakeups_skipped_total") or 0.0
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    try:
        await until(lambda: len(reports) == 1, 10, "the first round")
        assert reports[0].quiet and reports[0].pending == 0
        for _ in range(3):
            app.coordination.notify("round")
            await asyncio.sleep(0.1)
        assert len(reports) == 1
        assert REGISTRY.get_sample_value("stagetree_master_round_wakeups_skipped_total") == skipped + 3
        _node_manager(app, 1)
        study, ids = await asyncio.to_thread(_submit, app, 1)  # the submit wakes the loop
        await until(lambda: len(reports) == 2, 10, "the submit's round")
        assert reports[1].pending == 1 and len(reports[1].dispatched) == 1 and reports[1].quiet
        assert [r.state for r in app.service.get_requests(ALICE, study, ids)] == ["SCHED"]
        app.coordination.notify("round")  # the batch ended: nothing pending
        await asyncio.sleep(0.1)
        assert len(reports) == 2
    finally:
        stop.set()
        app.coordination.notify("round")
        await asyncio.wait_for(task, 5)
