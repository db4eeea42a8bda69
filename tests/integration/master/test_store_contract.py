"""Store contract: the same behaviour on Postgres and SQLite (parametrized ``store`` fixture)."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import create_engine

from stagetree.core.batch import Point
from stagetree.core.errors import AlreadyExists, FailedPrecondition, NotFound
from stagetree.master.store import store as st
from stagetree.master.store.schema import check_schema, head_revision, upgrade
from stagetree.master.store.store import NewNode, NewRequest, SqlStore, make_engine
from tests.integration.master.helpers import unique


def _plan_with_node(store: SqlStore) -> tuple[int, int]:
    pid = store.ensure_plan(unique("key")[:32], "{}")
    store.insert_nodes(pid, [NewNode(None, 0, "d0", '{"lr":[]}')])
    (node,) = store.load_nodes(pid)
    return pid, node.id


def test_study_create_get_list_and_duplicate_name(store: SqlStore) -> None:
    owner = unique("owner")
    a = store.create_study(owner, "s1", None)
    assert store.get_study(a.id) == a
    assert [s.id for s in store.list_studies(owner)] == [a.id]
    with pytest.raises(AlreadyExists):
        store.create_study(owner, "s1", None)
    with pytest.raises(NotFound):
        store.get_study("nope")


def test_ensure_plan_is_idempotent(store: SqlStore) -> None:
    key = unique("k")
    assert store.ensure_plan(key, "{}") == store.ensure_plan(key, "{}")
    assert store.plan_ids_by_key([key]) == {key: store.ensure_plan(key, "{}")}


def test_nodes_insert_or_ignore_on_the_unique_key(store: SqlStore) -> None:
    pid = store.ensure_plan(unique("k"), "{}")
    store.insert_nodes(pid, [NewNode(None, 0, "root", "A")])
    store.insert_nodes(pid, [NewNode(None, 0, "root", "B"), NewNode(None, 0, "other", "C")])
    nodes = store.load_nodes(pid)
    assert [n.config_json for n in nodes] == ["A", "C"]
    root = nodes[0].id
    store.insert_nodes(pid, [NewNode(root, 10, "x", "D"), NewNode(root, 10, "x", "E")])
    later = store.load_nodes(pid, after=nodes[-1].id)
    assert [(n.parent, n.start, n.config_json) for n in later] == [(root, 10, "D")]


def test_requests_are_idempotent_per_client_id_and_answer_known_metrics(store: SqlStore) -> None:
    pid, node = _plan_with_node(store)
    study = store.create_study(unique("o"), "s", None)
    store.record_metrics(pid, node, 5, {"loss": 0.5})
    first = store.add_requests(study.id, pid, [NewRequest("a", node, 10), NewRequest("b", node, 5)])
    assert [r.state for r in first] == [st.NOT_SCHED, st.DONE]
    assert first[1].metrics == {"loss": 0.5}
    again = store.add_requests(study.id, pid, [NewRequest("a", node, 10), NewRequest("c", node, 10)])
    assert again[0].id == first[0].id
    assert len(store.get_requests(study.id)) == 3


def test_metrics_complete_waiting_requests(store: SqlStore) -> None:
    pid, node = _plan_with_node(store)
    study = store.create_study(unique("o"), "s", None)
    (r,) = store.add_requests(study.id, pid, [NewRequest("a", node, 7)])
    assert store.metrics_at(node, 7) is None
    assert store.record_metrics(pid, node, 7, {"acc": 0.9}) == [r.id]
    (done,) = store.done_since(study.id, [r.id])
    assert done.state == st.DONE and done.metrics == {"acc": 0.9}


def test_non_finite_metrics_are_stored_and_read_back_as_floats(store: SqlStore) -> None:
    # a diverged trial: Postgres's JSON type refuses the bare NaN / Infinity tokens
    pid, node = _plan_with_node(store)
    study = store.create_study(unique("o"), "s", None)
    (r,) = store.add_requests(study.id, pid, [NewRequest("a", node, 3)])
    assert store.record_metrics(pid, node, 3, {"loss": math.nan, "gn": math.inf, "acc": 0.1}) == [r.id]
    got = store.metrics_at(node, 3)
    assert got is not None and math.isnan(got["loss"]) and got["gn"] == math.inf and got["acc"] == 0.1
    (done,) = store.get_requests(study.id, [r.id])
    assert math.isnan(done.metrics["loss"]) and all(isinstance(v, float) for v in done.metrics.values())


def test_cancel_not_sched_and_sched(store: SqlStore) -> None:
    pid, node = _plan_with_node(store)
    study = store.create_study(unique("o"), "s", None)
    a, b = store.add_requests(study.id, pid, [NewRequest("a", node, 3), NewRequest("b", node, 4)])
    rec, abort = store.cancel_request(study.id, a.id)
    assert rec.state == st.CANCELLED and abort is None
    nm = unique("nm")
    store.register_node_manager(nm, "x:1", [("gpu0", "a100")])
    batch = store.dispatch(pid, lambda bid, att: f"spec-{bid}-{att}", [b.id], nm, "gpu0")
    assert batch is not None
    rec, abort = store.cancel_request(study.id, b.id)
    assert rec.state == st.CANCELLED and abort == batch.id
    with pytest.raises(NotFound):
        store.cancel_request(study.id, 10**9)


def test_dispatch_marks_sched_and_assignments_are_sent_once(store: SqlStore) -> None:
    pid, node = _plan_with_node(store)
    study = store.create_study(unique("o"), "s", None)
    (r,) = store.add_requests(study.id, pid, [NewRequest("a", node, 3)])
    nm = unique("nm")
    store.register_node_manager(nm, "x:1", [("gpu0", "a100"), ("gpu1", "a100")])
    batch = store.dispatch(pid, lambda bid, att: f"spec-{bid}-{att}", [r.id], nm, "gpu0")
    assert batch is not None and batch.spec_json == f"spec-{batch.id}-1"
    assert store.dispatch(pid, lambda bid, att: "x", [r.id], nm, "gpu1") is None  # already SCHED
    assert r.id not in {rid for rid, _ in store.pending().get(pid, [])}
    assert (nm, "gpu0") in store.busy_slots()
    sent = store.take_assignments(nm)
    assert [(a.batch_id, a.attempt) for a in sent] == [(batch.id, 1)]
    assert store.take_assignments(nm) == []


def test_dispatch_many_commits_a_rounds_batches_together_and_skips_taken_ones(store: SqlStore) -> None:
    pid, node = _plan_with_node(store)
    study = store.create_study(unique("o"), "s", None)
    a, b = store.add_requests(study.id, pid, [NewRequest("a", node, 3), NewRequest("b", node, 6)])
    nm = unique("nm")
    store.register_node_manager(nm, "x:1", [("gpu0", "a100"), ("gpu1", "a100")])
    assert store.dispatch(pid, lambda bid, att: "first", [b.id], nm, "gpu1") is not None  # b is taken
    got = store.dispatch_many(
        [
            st.DispatchItem(pid, lambda bid, att: f"spec-{bid}-{att}", [a.id], nm, "gpu0"),
            st.DispatchItem(pid, lambda bid, att: "never", [b.id], nm, "gpu1"),
        ]
    )
    assert got[1] is None and got[0] is not None and got[0].spec_json == f"spec-{got[0].id}-1"
    assert {x.spec_json for x in store.running_batches() if x.plan_id == pid} == {"first", got[0].spec_json}
    assert sorted(x.slot_id for x in store.take_assignments(nm)) == ["gpu0", "gpu1"]
    assert store.plan_of_batch(got[0].id) == pid
    assert store.dispatch_many([]) == []


def test_lost_node_manager_requeues_and_stale_report_is_ignored(store: SqlStore) -> None:
    pid, node = _plan_with_node(store)
    study = store.create_study(unique("o"), "s", None)
    (r,) = store.add_requests(study.id, pid, [NewRequest("a", node, 3)])
    nm = unique("nm")
    store.register_node_manager(nm, "x:1", [("gpu0", "a100")])
    batch = store.dispatch(pid, lambda bid, att: "spec", [r.id], nm, "gpu0")
    assert batch is not None
    assert store.mark_lost(nm) == [batch.id]
    assert (r.id, Point(node, 3)) in store.pending()[pid]
    assert store.finish_batch(batch.id, 1, ok=True) == []  # the attempt is no longer running
    assert store.get_batch(batch.id).state == st.LOST


def test_failed_batch_requeues_unserved_requests(store: SqlStore) -> None:
    pid, node = _plan_with_node(store)
    study = store.create_study(unique("o"), "s", None)
    a, b = store.add_requests(study.id, pid, [NewRequest("a", node, 3), NewRequest("b", node, 6)])
    nm = unique("nm")
    store.register_node_manager(nm, "x:1", [("gpu0", "a100")])
    batch = store.dispatch(pid, lambda bid, att: "spec", [a.id, b.id], nm, "gpu0")
    assert batch is not None
    store.record_metrics(pid, node, 3, {"loss": 1.0})
    assert store.finish_batch(batch.id, 1, ok=False) == [b.id]
    assert [rid for rid, _ in store.pending()[pid]] == [b.id]


def test_heartbeat_unknown_node_manager(store: SqlStore) -> None:
    with pytest.raises(NotFound):
        store.heartbeat(unique("nm"))


def test_checkpoints_cost_profiles_and_plan_state(store: SqlStore) -> None:
    pid, node = _plan_with_node(store)
    store.record_checkpoint(node, 10, "file:///c", 123, "central")
    store.record_checkpoint(node, 10, "file:///dup", 1, "central")
    assert store.checkpoints(pid) == {Point(node, 10): "file:///c"}
    assert store.cost_profile(pid, "a100") is None
    store.set_cost_profile(pid, "a100", 0.25)
    store.set_cost_profile(pid, "a100", 0.5)
    assert store.cost_profile(pid, "a100") == 0.5
    store.record_metrics(pid, node, 10, {"loss": 0.1})
    _counts, ckpts, mets = store.plan_state(pid)
    assert ckpts == {node: [10]} and mets == {node: [10]}


def test_old_schema_refuses_with_the_upgrade_command(tmp_path: object) -> None:
    url = f"sqlite:///{tmp_path}/old.db"
    engine = make_engine(url)
    with pytest.raises(FailedPrecondition, match=r"stagetree master db upgrade --url sqlite:///"):
        SqlStore(engine)
    upgrade(engine, "0001")  # a database left at an older release
    with pytest.raises(FailedPrecondition, match=r"stagetree master db upgrade"):
        SqlStore(engine)
    upgrade(engine)
    check_schema(engine)
    SqlStore(engine)
    assert head_revision() == "0004"
    engine.dispose()


def test_migrations_match_the_models(db_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from stagetree.master.store.models import Base

    engine = create_engine(db_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []


def test_finished_attempts_are_the_ones_that_ran_to_their_end_since_a_time(store: SqlStore) -> None:
    pid, node = _plan_with_node(store)
    study = store.create_study(unique("o"), "s", None)
    a, b = store.add_requests(study.id, pid, [NewRequest("a", node, 3), NewRequest("b", node, 6)])
    nm = unique("nm")
    store.register_node_manager(nm, "x:1", [("gpu0", "a100"), ("gpu1", "a100")])
    ok = store.dispatch(pid, lambda bid, att: f"ok-{bid}", [a.id], nm, "gpu0")
    bad = store.dispatch(pid, lambda bid, att: f"bad-{bid}", [b.id], nm, "gpu1")
    assert ok is not None and bad is not None
    before = store.finished_attempts(0.0)
    store.take_assignments(nm)
    store.report_batch(ok.id, 1, True, [(node, 3, {"loss": 1.0})], [])
    store.report_batch(bad.id, 1, False, [], [], error="boom")  # a failed attempt teaches nothing
    got = [f for f in store.finished_attempts(0.0) if f not in before]
    assert [(f.batch_id, f.attempt, f.spec_json, f.gpu_type) for f in got] == [(ok.id, 1, f"ok-{ok.id}", "a100")]
    assert got[0].seconds >= 0 and got[0].finished_at > 0
    assert ok.id not in {f.batch_id for f in store.finished_attempts(got[0].finished_at + 1)}


def test_reports_of_several_batches_apply_in_one_call_each_with_its_own_outcome(store: SqlStore) -> None:
    pid, node = _plan_with_node(store)
    study = store.create_study(unique("o"), "s", None)
    a, b, c = store.add_requests(
        study.id, pid, [NewRequest("a", node, 3), NewRequest("b", node, 6), NewRequest("c", node, 9)]
    )
    nm = unique("nm")
    store.register_node_manager(nm, "x:1", [("g0", "a100"), ("g1", "a100")])
    ok = store.dispatch(pid, lambda bid, att: "ok", [a.id], nm, "g0")
    bad = store.dispatch(pid, lambda bid, att: "bad", [b.id, c.id], nm, "g1")
    assert ok is not None and bad is not None
    got = store.report_batches(
        [
            st.BatchReportIn(ok.id, 1, True, [(node, 3, {"loss": 1.0})], []),
            st.BatchReportIn(10**9, 1, True, [], []),  # no such batch: its own error, the rest applies
            st.BatchReportIn(bad.id, 1, False, [(node, 6, {"loss": 2.0})], [], error="boom"),
            st.BatchReportIn(ok.id, 1, True, [(node, 3, {"loss": 1.0})], []),  # the same report again: stale
        ]
    )
    assert got[0] == ([a.id], [])
    assert isinstance(got[1], NotFound)
    assert got[2] == ([b.id], [c.id])  # b got its metrics; c goes back, its first failure counted
    assert got[3] == ([a.id], [])  # the metrics were there; the batch had ended
    states = {r.id: r.state for r in store.get_requests(study.id)}
    assert states == {a.id: st.DONE, b.id: st.DONE, c.id: st.NOT_SCHED}
    assert store.get_batch(ok.id).state == st.BATCH_DONE and store.get_batch(bad.id).state == st.FAILED
