"""The studies' policy state in the database (``policy_states``), on Postgres and SQLite: saved and loaded
as it was, upserted; a master that starts leading restores what the last one saved, and carries out the
kills that one decided but may not have finished, once."""

from __future__ import annotations

import json
import math

from sqlalchemy import select
from sqlalchemy.orm import Session

from stagetree.core.ids import JobKey
from stagetree.core.lifecycle import RequestState
from stagetree.core.policies import hermes
from stagetree.core.policies.plain import enc
from stagetree.core.policies.state import Kill
from stagetree.core.round.learn import on_reports
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.plans import PlanCache
from stagetree.master.policies import PolicyStates
from stagetree.master.round_apply import DecisionApplier
from stagetree.master.store import models as m
from stagetree.master.store.policy_state import PolicyStateStore
from stagetree.master.store.records import NewNode, NewRequest
from stagetree.master.store.store import Store
from tests.integration.master.helpers import unique

POLICIES = {
    "time_share": "hermes",
    "time_share_params": {"quantum_s": 2},
    "search": "pop",
    "search_params": {"kill_threshold": 0.3, "eval_every": 20, "target": 0.9},
}


def _study(store: Store, policies: object = None) -> str:
    fixed = json.dumps({"trainer": "m:T", "policies": policies}) if policies else None
    return store.studies.create_study(unique("o"), "s", fixed).id


def test_policy_states_are_saved_in_one_upsert_and_loaded_as_they_were(store: Store) -> None:
    states = PolicyStateStore(store.db)
    a, b = _study(store), _study(store)
    first = {"version": 1, "x": [1.5, enc(math.inf), enc(math.nan)], "nested": {"k": None, "t": "s"}}
    states.save({a: first, b: {"version": 1}})
    assert states.load([a, b, "no-such-study"]) == {a: first, b: {"version": 1}}
    with Session(store.db.engine) as s:
        (t1,) = s.scalars(select(m.PolicyState.updated_at).where(m.PolicyState.study_id == a))
    states.save({a: {"version": 1, "x": []}})  # replaces a's, leaves b's
    assert states.load([a, b]) == {a: {"version": 1, "x": []}, b: {"version": 1}}
    with Session(store.db.engine) as s:
        (t2,) = s.scalars(select(m.PolicyState.updated_at).where(m.PolicyState.study_id == a))
    assert t2 >= t1
    states.save({})
    assert states.load([]) == {}


def test_a_new_leader_restores_the_saved_state_and_finishes_the_kills_left_pending(store: Store) -> None:
    sid = _study(store, POLICIES)
    pid = store.plans.ensure_plan(unique("key")[:32], "{}")
    store.plans.insert_nodes(pid, [NewNode(None, 0, "d0", '{"lr":[]}')])
    (node,) = store.plans.load_nodes(pid)
    reqs = store.requests.add_requests(sid, pid, [NewRequest("a", node.id, 40), NewRequest("b", node.id, 60)])
    killed_job, live_job = f"{pid}:{node.id}:40", f"{pid}:{node.id}:60"

    old = PolicyStates(store, save_every_s=0.0)  # the leader that crashes
    policies = old.active([(sid, store.studies.get_study(sid).fixed_json or "")])
    old.load(policies)
    st = old.state
    st.jobs[live_job] = hermes.TimeShareJob(live_job, 1.0)
    st.jobs[live_job].record([2.0, 1.5], 10.0, (0.3,))
    st.own_job(live_job, sid)
    st.quantum_start[5] = 10.0
    st.own_batch(5, sid)
    search = policies[sid].search
    assert search is not None
    st.search[sid], st.search_start[sid] = search.make(2), 3.0
    on_reports(st.search[sid], killed_job, 1, [0.1] * 20, 10.0, 1.0, 1)
    st.fed_at[killed_job], st.epochs[killed_job] = 12.0, 20
    st.add_reports(killed_job, [2.0, 12.0])
    st.own_job(killed_job, sid)
    st.killed.add(killed_job)
    st.pending_kills[killed_job] = Kill(sid, JobKey.parse(killed_job), "poor trial (test)")
    assert old.save(force=True) == [sid]
    assert old.save(force=True) == []  # unchanged: nothing written
    saved = old.state.snapshot(sid)

    new = PolicyStates(store)  # the next leader: loads before its first round that serves the study
    new.load(new.active([(sid, store.studies.get_study(sid).fixed_json or "")]))
    assert new.state.snapshot(sid) == saved
    assert new.state.jobs[live_job].quanta == old.state.jobs[live_job].quanta  # not from zero
    assert new.save(force=True) == []  # what it loaded is what is saved

    applier = DecisionApplier(store, PlanCache(store), InProcessCoordination(), new)
    again = Kill(sid, JobKey.parse(killed_job), "again")
    for _ in range(2):  # the pending kill is carried out; doing it again changes nothing
        applier.carry_out([], list(new.state.pending_kills.values()) or [again])
        got = {r.id: r for r in store.requests.get_requests(sid)}
        assert got[reqs[0].id].state == RequestState.CANCELLED and got[reqs[0].id].error == "poor trial (test)"
        assert got[reqs[1].id].state == RequestState.NOT_SCHED
    assert new.state.pending_kills == {} and new.state.killed == {killed_job}
    assert new.save(force=True) == [sid]
    after = PolicyStateStore(store.db).load([sid])[sid]
    assert after["pending"]["kills"] == [] and after["killed"] == [killed_job]
