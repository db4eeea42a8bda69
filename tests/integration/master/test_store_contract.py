"""Store contract: the same behaviour on Postgres and SQLite (parametrized ``store`` fixture)."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import create_engine

from stagetree.core.batch import Point
from stagetree.core.config import Config
from stagetree.core.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from stagetree.core.lifecycle import BatchState, RequestState
from stagetree.master.plans import config_text
from stagetree.master.store.ingest import Ingestor
from stagetree.master.store.records import DispatchItem, NewNode, NewRequest, NewTreeNode
from stagetree.master.store.schema import check_schema, head_revision, upgrade
from stagetree.master.store.store import Store, make_engine
from tests.integration.conftest import migrate
from tests.integration.master.helpers import unique
from tests.reports import attempt_report


def _plan_with_node(store: Store) -> tuple[int, int]:
    pid = store.plans.ensure_plan(unique("key")[:32], "{}")
    store.plans.insert_nodes(pid, [NewNode(None, 0, "d0", config_text(Config.of({"lr": 0.1})))])
    (node,) = store.plans.load_nodes(pid)
    return pid, node.id


def test_study_create_get_list_and_duplicate_name(store: Store) -> None:
    owner = unique("owner")
    a = store.studies.create_study(owner, "s1", None)
    assert store.studies.get_study(a.id) == a
    assert [s.id for s in store.studies.list_studies(owner)] == [a.id]
    with pytest.raises(AlreadyExists):
        store.studies.create_study(owner, "s1", None)
    with pytest.raises(NotFound):
        store.studies.get_study("nope")


def test_ensure_plan_is_idempotent(store: Store) -> None:
    key = unique("k")
    assert store.plans.ensure_plan(key, "{}") == store.plans.ensure_plan(key, "{}")
    assert store.plans.plan_ids_by_key([key]) == {key: store.plans.ensure_plan(key, "{}")}


def test_nodes_insert_or_ignore_on_the_unique_key(store: Store) -> None:
    pid = store.plans.ensure_plan(unique("k"), "{}")
    store.plans.insert_nodes(pid, [NewNode(None, 0, "root", "A")])
    store.plans.insert_nodes(pid, [NewNode(None, 0, "root", "B"), NewNode(None, 0, "other", "C")])
    nodes = store.plans.load_nodes(pid)
    assert [n.config_json for n in nodes] == ["A", "C"]
    root = nodes[0].id
    store.plans.insert_nodes(pid, [NewNode(root, 10, "x", "D"), NewNode(root, 10, "x", "E")])
    later = store.plans.load_nodes(pid, after=nodes[-1].id)
    assert [(n.parent, n.start, n.config_json) for n in later] == [(root, 10, "D")]


def _chain(root_parent: int | None, configs: list[str]) -> list[NewTreeNode]:
    """A forest of one chain: node -1 under ``root_parent``, -2 under -1, ... (the trial per milestone of
    a step schedule), each branching at 10 x its depth."""
    out = []
    for i, cj in enumerate(configs):
        parent = root_parent if i == 0 else -i
        out.append(NewTreeNode(-(i + 1), parent, 10 * i, f"d{i}", cj))
    return out


def test_a_forest_is_written_with_each_child_under_its_new_parent(store: Store) -> None:
    pid = store.plans.ensure_plan(unique("k"), "{}")
    ids = store.plans.insert_node_tree(pid, _chain(None, ["A", "B", "C", "D"]))
    assert sorted(ids) == [-4, -3, -2, -1]
    by_id = {n.id: n for n in store.plans.load_nodes(pid)}
    assert [(by_id[ids[-i]].parent, by_id[ids[-i]].config_json) for i in (1, 2, 3, 4)] == [
        (None, "A"),
        (ids[-1], "B"),
        (ids[-2], "C"),
        (ids[-3], "D"),
    ]
    assert store.plans.insert_node_tree(pid, _chain(None, ["A", "B"])) == {-1: ids[-1], -2: ids[-2]}  # theirs: ours


def test_a_forest_below_a_key_another_writer_holds_is_not_written(store: Store) -> None:
    pid = store.plans.ensure_plan(unique("k"), "{}")
    (root,) = store.plans.insert_node_tree(pid, _chain(None, ["A"])).values()
    # another writer's node holds the second level's key with another config
    store.plans.insert_nodes(pid, [NewNode(root, 10, "d1", "theirs")])
    ids = store.plans.insert_node_tree(pid, _chain(None, ["A", "B", "C"]))
    assert ids == {-1: root}  # the root is the same node; B was placed for our config: neither B nor C is ours
    nodes = store.plans.load_nodes(pid)
    assert sorted(n.config_json for n in nodes) == ["A", "theirs"]


def test_requests_are_idempotent_per_client_id_and_answer_known_metrics(store: Store) -> None:
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    store.requests.record_metrics(node, 5, {"loss": 0.5})
    first = store.requests.add_requests(study.id, pid, [NewRequest("a", node, 10), NewRequest("b", node, 5)])
    assert [r.state for r in first] == [RequestState.NOT_SCHED, RequestState.DONE]
    assert first[1].metrics == {"loss": 0.5}
    again = store.requests.add_requests(study.id, pid, [NewRequest("a", node, 10), NewRequest("c", node, 10)])
    assert again[0].id == first[0].id
    assert len(store.requests.get_requests(study.id)) == 3


def test_metrics_complete_waiting_requests(store: Store) -> None:
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    (r,) = store.requests.add_requests(study.id, pid, [NewRequest("a", node, 7)])
    assert store.requests.metrics_at(node, 7) is None
    assert store.requests.record_metrics(node, 7, {"acc": 0.9}) == [r.id]
    (done,) = store.requests.done_since(study.id, [r.id])
    assert done.state == RequestState.DONE and done.metrics == {"acc": 0.9}


def test_non_finite_metrics_are_stored_and_read_back_as_floats(store: Store) -> None:
    # a diverged trial: Postgres's JSON type refuses the bare NaN / Infinity tokens
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    (r,) = store.requests.add_requests(study.id, pid, [NewRequest("a", node, 3)])
    assert store.requests.record_metrics(node, 3, {"loss": math.nan, "gn": math.inf, "acc": 0.1}) == [r.id]
    got = store.requests.metrics_at(node, 3)
    assert got is not None and math.isnan(got["loss"]) and got["gn"] == math.inf and got["acc"] == 0.1
    (done,) = store.requests.get_requests(study.id, [r.id])
    assert math.isnan(done.metrics["loss"]) and all(isinstance(v, float) for v in done.metrics.values())


def test_cancel_not_sched_and_sched(store: Store) -> None:
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    a, b = store.requests.add_requests(study.id, pid, [NewRequest("a", node, 3), NewRequest("b", node, 4)])
    rec, abort = store.requests.cancel_request(study.id, a.id)
    assert rec.state == RequestState.CANCELLED and abort is None
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "x:1", [("gpu0", "a100")])
    batch = store.ledger.dispatch(pid, lambda bid, att: f"spec-{bid}-{att}", [b.id], nm, "gpu0")
    assert batch is not None
    rec, abort = store.requests.cancel_request(study.id, b.id, "killed by a policy")
    assert rec.state == RequestState.CANCELLED and abort == batch.id and rec.error == "killed by a policy"
    again, _ = store.requests.cancel_request(study.id, b.id, "another reason")  # finished: unchanged
    assert again.error == "killed by a policy"
    with pytest.raises(NotFound):
        store.requests.cancel_request(study.id, 10**9)


def test_dispatch_marks_sched_and_assignments_are_sent_once(store: Store) -> None:
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    (r,) = store.requests.add_requests(study.id, pid, [NewRequest("a", node, 3)])
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "x:1", [("gpu0", "a100"), ("gpu1", "a100")])
    batch = store.ledger.dispatch(pid, lambda bid, att: f"spec-{bid}-{att}", [r.id], nm, "gpu0")
    assert batch is not None and batch.spec_json == f"spec-{batch.id}-1"
    assert store.ledger.dispatch(pid, lambda bid, att: "x", [r.id], nm, "gpu1") is None  # already SCHED
    assert r.id not in {rid for rid, _ in store.rounds.pending().get(pid, [])}
    assert (nm, "gpu0") in store.rounds.busy_slots()
    sent = store.nodes.take_assignments(nm)
    assert [(a.batch_id, a.attempt) for a in sent] == [(batch.id, 1)]
    assert store.nodes.take_assignments(nm) == []


def test_grouped_heartbeats_takes_and_requeue_checks_match_one_at_a_time(store: Store) -> None:
    """What the master does for the heartbeats and stream wake-ups that arrive together, in one
    transaction each, gives what it did one node manager at a time."""
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    reqs = store.requests.add_requests(study.id, pid, [NewRequest(c, node, 3 + i) for i, c in enumerate("abcd")])
    nms = [unique("nm") for _ in range(3)]
    for nm in nms:
        store.nodes.register_node_manager(nm, "x:1", [("gpu0", "a100"), ("gpu1", "a100")])
    assert store.nodes.heartbeat_many([*nms, "never-registered"]) == set(nms)
    batches = store.ledger.dispatch_many(
        [
            DispatchItem(pid, lambda bid, att: f"s{bid}", [reqs[0].id], nms[0], ("gpu0",)),
            DispatchItem(pid, lambda bid, att: f"s{bid}", [reqs[1].id], nms[0], ("gpu1",)),
            DispatchItem(pid, lambda bid, att: f"s{bid}", [reqs[2].id], nms[1], ("gpu0",)),
            DispatchItem(pid, lambda bid, att: f"s{bid}", [reqs[3].id], nms[1], ("gpu1",)),
        ]
    )
    b = [x.id for x in batches if x is not None]
    assert len(b) == 4
    sent = store.nodes.take_assignments_many([nms[1], nms[0], nms[2], nms[0]])
    assert {nm: [(a.batch_id, a.spec_json) for a in got] for nm, got in sent.items()} == {
        nms[0]: [(b[0], f"s{b[0]}"), (b[1], f"s{b[1]}")],
        nms[1]: [(b[2], f"s{b[2]}"), (b[3], f"s{b[3]}")],
        nms[2]: [],
    }
    assert store.nodes.take_assignments_many(nms) == {nm: [] for nm in nms}  # sent once
    assert store.nodes.with_unsent() & set(nms) == set()
    # nm0 knows both of its attempts, nm1 only one, nm2 has none: only nm1's unknown one is requeued
    lost = store.ledger.requeue_unknown_many([(nms[0], [(b[0], 1), (b[1], 1)]), (nms[1], [(b[2], 1)]), (nms[2], [])])
    assert lost == {nms[1]: [b[3]]}
    assert {rid for rid, _ in store.rounds.pending().get(pid, [])} == {reqs[3].id}
    assert store.ledger.requeue_unknown(nms[1], [(b[2], 1)]) == []  # already requeued: nothing more
    # an attempt sent after the cut-off may still be on its way: kept
    assert store.ledger.requeue_unknown_many([(nms[0], [])], sent_before=0.0) == {}


def test_dispatch_many_commits_a_rounds_batches_together_and_skips_taken_ones(store: Store) -> None:
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    a, b = store.requests.add_requests(study.id, pid, [NewRequest("a", node, 3), NewRequest("b", node, 6)])
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "x:1", [("gpu0", "a100"), ("gpu1", "a100")])
    assert store.ledger.dispatch(pid, lambda bid, att: "first", [b.id], nm, "gpu1") is not None  # b is taken
    got = store.ledger.dispatch_many(
        [
            DispatchItem(pid, lambda bid, att: f"spec-{bid}-{att}", [a.id], nm, ("gpu0",)),
            DispatchItem(pid, lambda bid, att: "never", [b.id], nm, ("gpu1",)),
        ]
    )
    assert got[1] is None and got[0] is not None and got[0].spec_json == f"spec-{got[0].id}-1"
    assert {x.spec_json for x in store.batches.running_batches() if x.plan_id == pid} == {"first", got[0].spec_json}
    assert sorted(x.slot_id for x in store.nodes.take_assignments(nm)) == ["gpu0", "gpu1"]
    assert store.batches.plan_of_batch(got[0].id) == pid
    assert store.ledger.dispatch_many([]) == []


def test_lost_node_manager_requeues_and_stale_report_is_ignored(store: Store) -> None:
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    (r,) = store.requests.add_requests(study.id, pid, [NewRequest("a", node, 3)])
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "x:1", [("gpu0", "a100")])
    batch = store.ledger.dispatch(pid, lambda bid, att: "spec", [r.id], nm, "gpu0")
    assert batch is not None
    assert store.ledger.mark_lost(nm) == [batch.id]
    assert (r.id, Point(node, 3)) in store.rounds.pending()[pid]
    got = Ingestor(store).apply(attempt_report(batch.id, 1, True))
    assert (got.stale, got.completed, got.requeued) == (1, [], [])  # no longer running
    assert store.batches.get_batch(batch.id).state == BatchState.LOST


def test_failed_batch_requeues_unserved_requests(store: Store) -> None:
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    a, b = store.requests.add_requests(study.id, pid, [NewRequest("a", node, 3), NewRequest("b", node, 6)])
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "x:1", [("gpu0", "a100")])
    batch = store.ledger.dispatch(pid, lambda bid, att: "spec", [a.id, b.id], nm, "gpu0")
    assert batch is not None
    store.requests.record_metrics(node, 3, {"loss": 1.0})
    got = Ingestor(store).apply(attempt_report(batch.id, 1, False))
    assert (got.completed, got.requeued) == ([], [b.id])
    assert [rid for rid, _ in store.rounds.pending()[pid]] == [b.id]


def test_heartbeat_unknown_node_manager(store: Store) -> None:
    with pytest.raises(NotFound):
        store.nodes.heartbeat(unique("nm"))


def test_checkpoints_and_plan_state(store: Store) -> None:
    pid, node = _plan_with_node(store)
    store.checkpoints.record_checkpoint(node, 10, "file:///c", 123, "central")
    store.checkpoints.record_checkpoint(node, 10, "file:///dup", 1, "central")
    assert store.checkpoints.checkpoints(pid) == {Point(node, 10): "file:///c"}
    store.requests.record_metrics(node, 10, {"loss": 0.1})
    _counts, ckpts, mets = store.plans.plan_state(pid)
    assert ckpts == {node: [10]} and mets == {node: [10]}


def test_a_batch_holds_its_slots_in_rank_order(store: Store) -> None:
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    a, b = store.requests.add_requests(study.id, pid, [NewRequest("a", node, 3), NewRequest("b", node, 6)])
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "x:1", [(f"gpu{i}", "a100") for i in range(4)])
    wide = store.ledger.dispatch(pid, lambda bid, att: "wide", [a.id], nm, "gpu3", "gpu1", "gpu2")
    one = store.ledger.dispatch(pid, lambda bid, att: "one", [b.id], nm, "gpu0")
    assert wide is not None and one is not None and wide.slot_ids == ("gpu3", "gpu1", "gpu2")
    assert store.batches.get_batch(wide.id).slot_ids == ("gpu3", "gpu1", "gpu2")  # rank order, as placed
    assert store.batches.get_batch(one.id).slot_ids == ("gpu0",)
    running = {x.id: x.slot_ids for x in store.batches.running_batches()}
    assert running[wide.id] == ("gpu3", "gpu1", "gpu2") and running[one.id] == ("gpu0",)
    assert {(nm, f"gpu{i}") for i in range(4)} <= store.rounds.busy_slots()
    reads = store.rounds.round_reads()
    assert {x.id: x.slot_ids for x in reads.running}[wide.id] == ("gpu3", "gpu1", "gpu2")
    assert {(nm, f"gpu{i}") for i in range(4)} <= reads.busy
    # the attempt names rank 0's slot
    assert [x.slot_id for x in store.nodes.take_assignments(nm) if x.batch_id == wide.id] == ["gpu3"]
    with pytest.raises(InvalidArgument):
        store.ledger.dispatch(pid, lambda bid, att: "none", [b.id], nm)


def test_migration_0017_moves_joined_slot_text_into_rows_and_back(tmp_path: object) -> None:
    from sqlalchemy import text

    from stagetree.master.store.schema import alembic_config

    engine = make_engine(f"sqlite:///{tmp_path}/slots.db")
    upgrade(engine, "0016")
    with engine.begin() as c:
        c.execute(text("INSERT INTO plans (id, key, fixed_json, created_at, scope) VALUES (1, 'k', '{}', 0, '')"))
        for bid, slots in ((1, "g0,g1,g2"), (2, "g3"), (3, None)):
            c.execute(
                text(
                    "INSERT INTO batches (id, plan_id, state, attempt, spec_json, node_manager_id, slot_id, created_at,"
                    " updated_at) VALUES (:b, 1, 'DONE', 1, '{}', 'nm', :s, 0, 0)"
                ),
                {"b": bid, "s": slots},
            )
    upgrade(engine)
    with engine.connect() as c:
        rows = c.execute(text("SELECT batch_id, rank, slot_id FROM batch_slots ORDER BY batch_id, rank")).all()
    assert [tuple(r) for r in rows] == [(1, 0, "g0"), (1, 1, "g1"), (1, 2, "g2"), (2, 0, "g3")]
    from alembic import command

    cfg = alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0016")
    with engine.connect() as c:
        back = c.execute(text("SELECT id, slot_id FROM batches ORDER BY id")).all()
    assert [tuple(r) for r in back] == [(1, "g0,g1,g2"), (2, "g3"), (3, None)]
    engine.dispose()


def test_old_schema_refuses_with_the_upgrade_command(tmp_path: object) -> None:
    url = f"sqlite:///{tmp_path}/old.db"
    engine = make_engine(url)
    with pytest.raises(FailedPrecondition, match=r"stagetree master db upgrade --url sqlite:///"):
        Store.open(engine)
    upgrade(engine, "0001")  # a database left at an older release
    with pytest.raises(FailedPrecondition, match=r"stagetree master db upgrade"):
        Store.open(engine)
    upgrade(engine)
    check_schema(engine)
    Store.open(engine)
    assert head_revision() == "0017"
    engine.dispose()


def _schema(url: str) -> dict[str, object]:
    """Every table's columns, keys, indexes and constraints as the database reports them."""
    from sqlalchemy import inspect

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            insp = inspect(conn)

            def index(ix: dict) -> tuple:
                where = {k: str(v) for k, v in ix.get("dialect_options", {}).items() if k.endswith("_where")}
                return ix["name"], tuple(ix["column_names"]), bool(ix["unique"]), tuple(sorted(where.items()))

            return {
                t: (
                    sorted(
                        (c["name"], str(c["type"]), c["nullable"], str(c.get("default"))) for c in insp.get_columns(t)
                    ),
                    insp.get_pk_constraint(t)["constrained_columns"],
                    sorted(
                        (tuple(f["constrained_columns"]), f["referred_table"], tuple(f["referred_columns"]))
                        for f in insp.get_foreign_keys(t)
                    ),
                    sorted(index(ix) for ix in insp.get_indexes(t)),
                    sorted(tuple(u["column_names"]) for u in insp.get_unique_constraints(t)),
                )
                for t in sorted(insp.get_table_names())
            }
    finally:
        engine.dispose()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_an_empty_database_gets_the_schema_the_migrations_build(kind: str, tmp_path: object) -> None:
    from tests.integration.conftest import fresh_pg

    def made(name: str, migrated: bool) -> dict[str, object]:
        def build(url: str) -> dict[str, object]:
            if migrated:
                migrate(url)
            else:
                engine = make_engine(url)
                upgrade(engine)  # the empty database's shortcut: the models' tables and the head's revision
                check_schema(engine)
                engine.dispose()
            return _schema(url)

        if kind == "sqlite":
            return build(f"sqlite:///{tmp_path}/{name}.db")
        with fresh_pg(migrated=False) as url:
            return build(url)

    migrated, created = made("migrated", True), made("created", False)
    assert "alembic_version" in created
    assert created == migrated
    assert head_revision() == _alembic_head()  # read from the file names, as Alembic reads the files


def _alembic_head() -> str:
    from alembic.script import ScriptDirectory

    from stagetree.master.store.schema import alembic_config

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def test_migrations_match_the_models(db_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from stagetree.master.store.models import Base

    engine = create_engine(db_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []


def test_finished_attempts_are_the_ones_that_ran_to_their_end_since_a_time(store: Store) -> None:
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    a, b = store.requests.add_requests(study.id, pid, [NewRequest("a", node, 3), NewRequest("b", node, 6)])
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "x:1", [("gpu0", "a100"), ("gpu1", "a100")])
    ok = store.ledger.dispatch(pid, lambda bid, att: f"ok-{bid}", [a.id], nm, "gpu0")
    bad = store.ledger.dispatch(pid, lambda bid, att: f"bad-{bid}", [b.id], nm, "gpu1")
    assert ok is not None and bad is not None
    before = store.batches.finished_attempts(0.0)
    store.nodes.take_assignments(nm)
    Ingestor(store).apply(attempt_report(ok.id, 1, True, [(node, 3, {"loss": 1.0})]))
    Ingestor(store).apply(attempt_report(bad.id, 1, False, error="boom"))  # a failed attempt teaches nothing
    got = [f for f in store.batches.finished_attempts(0.0) if f not in before]
    assert [(f.batch_id, f.attempt, f.spec_json, f.gpu_type) for f in got] == [(ok.id, 1, f"ok-{ok.id}", "a100")]
    assert got[0].seconds >= 0 and got[0].finished_at > 0
    assert ok.id not in {f.batch_id for f in store.batches.finished_attempts(got[0].finished_at + 1)}
    # what the caller has already is left out (its spec is not read again)
    assert ok.id not in {f.batch_id for f in store.batches.finished_attempts(0.0, skip={(ok.id, 1)})}
    assert ok.id in {f.batch_id for f in store.batches.finished_attempts(0.0, skip={(ok.id, 2)})}


def test_reports_of_several_batches_apply_in_one_call_each_with_its_own_outcome(store: Store) -> None:
    pid, node = _plan_with_node(store)
    study = store.studies.create_study(unique("o"), "s", None)
    a, b, c = store.requests.add_requests(
        study.id, pid, [NewRequest("a", node, 3), NewRequest("b", node, 6), NewRequest("c", node, 9)]
    )
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "x:1", [("g0", "a100"), ("g1", "a100")])
    ok = store.ledger.dispatch(pid, lambda bid, att: "ok", [a.id], nm, "g0")
    bad = store.ledger.dispatch(pid, lambda bid, att: "bad", [b.id, c.id], nm, "g1")
    assert ok is not None and bad is not None
    first, missing, failed, again = (
        attempt_report(ok.id, 1, True, [(node, 3, {"loss": 1.0})], []),
        attempt_report(10**9, 1, True, [], []),  # no such batch: its own error, the rest applies
        attempt_report(bad.id, 1, False, [(node, 6, {"loss": 2.0})], [], error="boom"),
        attempt_report(ok.id, 1, True, [(node, 3, {"loss": 1.0})], []),  # the same report again: no effect
    )
    got = Ingestor(store).apply([*first, *missing, *failed, *again])
    assert got.completed_by == {first[0].msg_id: [a.id], failed[0].msg_id: [b.id]}
    assert [type(got.rejected_why.get(msg.msg_id)) for msg in missing] == [NotFound]
    assert got.requeued == [c.id]  # b got its metrics; c goes back, its first failure counted
    assert got.duplicates == len(again)
    states = {r.id: r.state for r in store.requests.get_requests(study.id)}
    assert states == {a.id: RequestState.DONE, b.id: RequestState.DONE, c.id: RequestState.NOT_SCHED}
    assert (
        store.batches.get_batch(ok.id).state == BatchState.DONE
        and store.batches.get_batch(bad.id).state == BatchState.FAILED
    )


def test_rounds_read_a_node_managers_slots_again_only_after_it_registers_again(store: Store) -> None:
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "x:1", [("g0", "a100"), ("g1", "a100")])
    cache: dict = {}  # type: ignore[type-arg]

    def slots() -> list[str]:
        with store.db.tx("test") as s:
            (rec,) = [n for n in store.nodes.node_managers_cached_in(s, cache) if n.id == nm]
        return [i.id for i in rec.slots]

    assert slots() == ["g0", "g1"] and nm in cache
    assert slots() == ["g0", "g1"]
    store.nodes.register_node_manager(nm, "x:1", [("g0", "h100"), ("g1", "h100"), ("g2", "h100")])
    assert slots() == ["g0", "g1", "g2"]  # a new registration: its new slots
    with store.db.tx("test") as s:
        every = store.nodes.node_managers_in(s)
    assert [(n.id, n.slots) for n in every if n.id == nm] == [(nm, cache[nm][1])]  # the same as an uncached read


def test_a_packs_files_are_deleted_with_the_last_of_its_points(store: Store) -> None:
    _pid, node = _plan_with_node(store)
    nm = unique("nm")
    store.nodes.register_node_manager(nm, "127.0.0.1:1", [("s0", "cpu")])
    pack = f"file:///{unique('pack')}"
    for step in (3, 4, 5):
        store.checkpoints.record_checkpoint(node, step, pack, 100, "peripheral")
    store.checkpoints.record_checkpoint(node, 6, "file:///alone", 100, "central")
    assert store.checkpoints.delete_checkpoints([Point(node, 3), Point(node, 4)]) == {}  # 5 still needs it
    assert store.checkpoints.referenced([pack, "file:///alone"]) == {pack, "file:///alone"}
    told = store.checkpoints.delete_checkpoints([Point(node, 5), Point(node, 6)])
    assert sorted(told[nm]) == sorted([pack, "file:///alone"])
    assert store.checkpoints.referenced([pack]) == set()
