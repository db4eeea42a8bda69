"""What a master does when node managers and masters come back: a node manager that registers listing the
attempts it knows gets the others requeued; a master that starts leading gives node managers it has not
heard from one heartbeat TTL before it requeues their work (while no master ran, nobody renewed their
heartbeat keys); a node manager that leaves gets no more work, and what it did not list is requeued at
once."""

from __future__ import annotations

import time

import pytest

from stagetree.core.errors import NotFound, PermissionDenied
from stagetree.master.app import MasterApp
from stagetree.master.auth import Principal
from stagetree.master.scheduling import SchedulingLoop
from stagetree.master.service import SubmitItem
from stagetree.master.settings import SchedulingSettings
from tests.integration.master.helpers import config_json, fixed, unique
from tests.reports import attempt_report

ALICE = Principal("alice")
ADMIN = Principal("admin", admin=True)


def _dispatched(app: MasterApp, nm: str, n: int = 2) -> list[int]:
    study = app.service.create_study(ALICE, unique("s"))
    f = fixed()
    app.service.submit(ALICE, study.id, [SubmitItem(f"r{i}", config_json(f, lr=0.01 * (i + 1)), 10) for i in range(n)])
    dispatched = app.scheduler.run_round().dispatched
    assert sorted(a.batch_id for a in app.service.take_assignments(ADMIN, nm)) == sorted(dispatched)
    return sorted(dispatched)


def test_registration_listing_known_attempts_requeues_only_the_others(app: MasterApp) -> None:
    nm = unique("nm")
    app.service.register_node_manager(ADMIN, nm, "local", [("g0", "cpu"), ("g1", "cpu")])
    app.coordination.heartbeat(nm, 30)
    kept, lost = _dispatched(app, nm)
    app.service.register_node_manager(ADMIN, nm, "local", [("g0", "cpu"), ("g1", "cpu")], known=[(kept, 1)])
    assert app.store.batches.get_batch(kept).state == "RUNNING"
    assert app.store.batches.get_batch(lost).state == "LOST"
    # a registration that lists nothing (an older node manager) requeues nothing
    app.service.register_node_manager(ADMIN, nm, "local", [("g0", "cpu"), ("g1", "cpu")])
    assert app.store.batches.get_batch(kept).state == "RUNNING"
    # the requeued work is dispatched again (attempts are sent once: the new batch is new work)
    again = app.scheduler.run_round().dispatched
    assert len(again) == 1 and again[0] not in (kept, lost)


def test_a_new_leader_gives_silent_node_managers_one_ttl_before_requeueing(app: MasterApp) -> None:
    nm = unique("nm")
    app.service.register_node_manager(ADMIN, nm, "local", [("g0", "cpu")])
    app.coordination.heartbeat(nm, 3.0)  # alive while work is dispatched to it, however slow the machine
    (bid,) = _dispatched(app, nm, 1)
    while app.coordination.alive([nm]):  # its key lapses while (say) the master is down
        time.sleep(0.1)
    settings = SchedulingSettings(heartbeat_ttl_s=3.0)  # seconds: the next line may come late under load
    restarted = SchedulingLoop(app.store, app.scheduler.plans, app.coordination, settings, "master-2")
    assert restarted.requeue_lost() == []  # within the grace period
    assert app.store.batches.get_batch(bid).state == "RUNNING"
    deadline = time.monotonic() + 60
    while (lost := restarted.requeue_lost()) == []:
        assert time.monotonic() < deadline, "never requeued after the grace period"
        time.sleep(0.1)
    assert lost == [nm]
    assert app.store.batches.get_batch(bid).state == "LOST"


def _leader_then_node_manager(app: MasterApp, instance: str) -> tuple[SchedulingLoop, str]:
    """A leader that started first, and a node manager that registered to it with a 0.1-s heartbeat."""
    settings = SchedulingSettings(heartbeat_ttl_s=30)
    leader = SchedulingLoop(app.store, app.scheduler.plans, app.coordination, settings, instance)
    nm = unique("nm")
    time.sleep(0.01)
    app.service.register_node_manager(ADMIN, nm, "local", [("g0", "cpu")])  # after the leader started
    app.coordination.heartbeat(nm, 0.1)
    return leader, nm


def test_a_node_manager_that_heartbeated_to_the_new_leader_is_lost_at_once(app: MasterApp) -> None:
    leader, nm = _leader_then_node_manager(app, "master-3")
    time.sleep(0.2)
    assert nm in leader.requeue_lost()


def test_a_node_manager_judged_lost_from_a_read_made_before_it_registered_again_keeps_its_work(
    app: MasterApp,
) -> None:
    leader, nm = _leader_then_node_manager(app, "master-5")
    (bid,) = _dispatched(app, nm, 1)
    read = [r for r in app.store.nodes.node_managers() if r.id == nm]  # the round's read
    time.sleep(0.2)  # its key lapses
    # between that read and the round's judgement, it registers again listing the attempt it runs
    app.service.register_node_manager(ADMIN, nm, "local", [("g0", "cpu")], known=[(bid, 1)])
    assert leader.requeue_lost(read) == []
    assert app.store.batches.get_batch(bid).state == "RUNNING"
    assert next(r for r in app.store.nodes.node_managers() if r.id == nm).state == "ALIVE"
    # judged on a fresh read, with its key still lapsed, it is lost
    assert leader.requeue_lost() == [nm]
    assert app.store.batches.get_batch(bid).state == "LOST"


def test_a_master_over_the_same_database_schedules_in_its_first_round_while_a_batch_runs(app: MasterApp) -> None:
    # the new master's plan cache is empty: every read of a plan (here the lookahead's cost of the running
    # batch, before any snapshot) must load it, or the round fails and the free slot waits for the batch
    # the first master sends nothing ahead: with its lookahead, once its cost learner has read the "warm"
    # batch (a refresh away, so on a loaded machine at times), "waits" would go to the slot "short" frees
    app.scheduler.settings = app.scheduler.settings.model_copy(update={"lookahead_s": 0.0})
    nm = unique("nm")
    app.service.register_node_manager(ADMIN, nm, "local", [("g0", "cpu"), ("g1", "cpu")])
    app.coordination.heartbeat(nm, 30)
    study = app.service.create_study(ALICE, unique("s"))
    f = fixed()
    app.service.submit(ALICE, study.id, [SubmitItem("warm", config_json(f, lr=0.01), 10)])
    (warm,) = app.scheduler.run_round().dispatched
    time.sleep(0.01)
    app.service.report_batch(ADMIN, attempt_report(warm, 1, ok=True))  # the plan's costs are learnt from it
    long_req, short_req = app.service.submit(
        ALICE,
        study.id,
        [SubmitItem("long", config_json(f, lr=0.02), 100_000), SubmitItem("short", config_json(f, lr=0.03), 10)],
    )
    assert len(app.scheduler.run_round().dispatched) == 2  # both slots busy
    (waits,) = app.service.submit(ALICE, study.id, [SubmitItem("waits", config_json(f, lr=0.5), 10)])
    assert app.scheduler.run_round().dispatched == []
    long, short = (r.batch_id for r in app.service.get_requests(ALICE, study.id, [long_req.id, short_req.id]))
    assert long is not None and short is not None
    app.service.take_assignments(ADMIN, nm)

    restarted = MasterApp.build(app.settings, coordination=app.coordination)
    try:
        restarted.service.report_batch(ADMIN, attempt_report(short, 1, ok=True))
        (sent,) = restarted.scheduler.run_round().dispatched  # the slot freed: the waiting work goes at once
        (got,) = restarted.service.get_requests(ALICE, study.id, [waits.id])
        assert got.batch_id == sent and got.state == "SCHED"
        assert restarted.store.batches.get_batch(long).state == "RUNNING"
    finally:
        restarted.store.dispose()


def test_a_node_manager_that_left_gets_no_more_work_and_what_it_did_not_list_is_requeued_at_once(
    app: MasterApp,
) -> None:
    nm, other = unique("nm"), unique("nm")
    app.service.register_node_manager(ADMIN, nm, "local", [("g0", "cpu"), ("g1", "cpu")])
    app.coordination.heartbeat(nm, 30)
    kept, dropped = _dispatched(app, nm)
    with pytest.raises(PermissionDenied):
        app.service.leave_node_manager(ALICE, nm, [])
    with pytest.raises(NotFound, match="not registered"):
        app.service.leave_node_manager(ADMIN, unique("nm"), [])
    assert app.service.leave_node_manager(ADMIN, nm, [(kept, 1)]) == [dropped]
    (rec,) = [n for n in app.service.list_node_managers(ADMIN) if n.id == nm]
    assert rec.state == "LEFT"
    assert app.store.batches.get_batch(kept).state == "RUNNING"  # its report is on its way
    assert app.store.batches.get_batch(dropped).state == "LOST"
    assert app.scheduler.run_round().dispatched == []  # its heartbeat key is alive, but it left
    app.service.heartbeat(ADMIN, nm, [(kept, 1)])  # one sent before the leave, processed after it
    (rec,) = [n for n in app.service.list_node_managers(ADMIN) if n.id == nm]
    assert rec.state == "LEFT" and app.scheduler.run_round().dispatched == []
    app.service.register_node_manager(ADMIN, other, "local", [("g0", "cpu")])
    app.coordination.heartbeat(other, 30)
    assert len(app.scheduler.run_round().dispatched) == 1  # the requeued work, elsewhere
    # what it listed and never reported is requeued a heartbeat TTL after it left, once; it stays LEFT
    settings = SchedulingSettings(heartbeat_ttl_s=0.5)
    loop = SchedulingLoop(app.store, app.scheduler.plans, app.coordination, settings, "master-4")
    time.sleep(0.6)
    assert loop.requeue_lost() == [nm] and loop.requeue_lost() == []
    assert app.store.batches.get_batch(kept).state == "LOST"
    (rec,) = [n for n in app.service.list_node_managers(ADMIN) if n.id == nm]
    assert rec.state == "LEFT"
    app.service.register_node_manager(ADMIN, nm, "local", [("g0", "cpu")])  # back: ALIVE again
    (rec,) = [n for n in app.service.list_node_managers(ADMIN) if n.id == nm]
    assert rec.state == "ALIVE"


def test_a_round_decided_before_a_node_manager_left_sends_it_nothing(app: MasterApp) -> None:
    """The round reads, the node manager leaves, the round applies: the dispatch to it is dropped (its
    row is held against the leave while the dispatch commits) and the work stays pending."""
    nm = unique("nm")
    app.service.register_node_manager(ADMIN, nm, "local", [("g0", "cpu")])
    app.coordination.heartbeat(nm, 30)
    study = app.service.create_study(ALICE, unique("s"))
    app.service.submit(ALICE, study.id, [SubmitItem("r0", config_json(fixed(), lr=0.01), 10)])
    scheduler = app.scheduler
    decided = scheduler.decide()
    assert decided.decision.dispatches  # it would go to the node manager
    assert app.service.leave_node_manager(ADMIN, nm, []) == []
    applied = scheduler.applier.apply(decided.decision, decided.read, scheduler.settings, scheduler.files)
    assert applied.dispatched == [] and app.service.take_assignments(ADMIN, nm) == []
    assert [r.state for r in app.service.get_requests(ALICE, study.id, None)] == ["NOT_SCHED"]
