"""The pure scheduling round (``core.round.plan_round``): its steps by hand, studies with different
policies in one round, the fair share across studies, and properties: every request served at most once
a round, no stage run twice, no slot over-committed, decisions deterministic and the input untouched."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.batch import Point
from stagetree.core.config import Config
from stagetree.core.ids import BatchId, PlanId, StudyId
from stagetree.core.policies.genie import ClusterShape, choose_width
from stagetree.core.policies.hermes import TimeShareJob
from stagetree.core.policies.pop import Verdict
from stagetree.core.policies.state import PolicyState
from stagetree.core.policies.study import parse_policies
from stagetree.core.round import BusySlot, Report, RoundDecision, RoundInput, RunningAttempt, plan_round
from stagetree.core.round.learn import eval_points, losses_of, on_reports
from stagetree.core.searchplan import Checkpoint, SearchPlan
from stagetree.core.sequences import Constant, MultiStep
from stagetree.core.slots import Slot
from tests.sim.inputs import PLAN, plan_work, round_input

CPU0 = Slot("cpu0", "nm", cpu_cores=1)
CPU1 = Slot("cpu1", "nm", cpu_cores=1)
NODE_IDS, REQUEST_IDS = itertools.count(1), itertools.count(1)  # unique across the plans of a test


def trials(study: str, *steps: int, first: int = 0) -> SearchPlan:
    """A plan of independent trials of ``study``, each to its number of steps."""
    plan = SearchPlan(study, node_ids=NODE_IDS, request_ids=REQUEST_IDS)
    for i, n in enumerate(steps):
        plan.add_request(Config.of({"trial": first + i}), n, study=study)
    return plan


def dispatched(dec: RoundDecision) -> list[tuple[str, int, list[str]]]:
    """(study, end step, slots) of each dispatch, in order."""
    return [(str(d.study), d.batch.end.step, [s.id for s in d.slots]) for d in dec.dispatches]


# -- the default steps ----------------------------------------------------------------------------


def test_the_longest_path_goes_first_and_the_lookahead_offers_a_slot_about_to_free() -> None:
    work = plan_work(trials("s", 10, 30, 20))
    busy = [BusySlot(CPU1, ends_at=12.0), BusySlot(Slot("cpu2", "nm"), ends_at=40.0)]
    dec = plan_round(round_input([work], [CPU0], busy=busy, now=10.0, lookahead_s=3.0))
    assert dispatched(dec) == [("s", 30, ["cpu0"]), ("s", 20, ["cpu1"])]
    assert [d.ahead for d in dec.dispatches] == [False, True]
    assert dec.wake_at == pytest.approx(37.0) and dec.queued == 1  # cpu2 comes within 3 s of its end then
    off = plan_round(round_input([work], [CPU0], busy=busy, now=10.0))
    assert dispatched(off) == [("s", 30, ["cpu0"])] and off.wake_at is None


def test_a_second_study_gets_the_next_slots_while_the_first_holds_them() -> None:
    """Fair share: study a has hundreds of trials waiting and holds every slot; b arrives. Each slot that
    frees goes to b until both hold as many."""
    a, b = plan_work(trials("a", *[50] * 400), PlanId(1)), plan_work(trials("b", *[10] * 5, first=1000), PlanId(2))
    slots = [Slot(f"g{i}", "nm") for i in range(4)]
    held = [RunningAttempt(BatchId(i), 1, PlanId(1), (s,), ((1, 0, 50),), StudyId("a")) for i, s in enumerate(slots)]
    freed = plan_round(round_input([a, b], slots[:1], running=held[1:]))
    assert [s for s, _, _ in dispatched(freed)] == ["b"]
    two = plan_round(round_input([a, b], slots[:2], running=held[2:]))
    assert [s for s, _, _ in dispatched(two)] == ["b", "b"]
    # owners first: a third study of b's owner waits behind a's owner while b's owner holds more
    c = plan_work(trials("c", 10, first=2000), PlanId(3))
    b_runs = [RunningAttempt(BatchId(9 + i), 1, PlanId(2), (slots[i],), ((9, 0, 10),), StudyId("b")) for i in (0, 2)]
    running = [held[3], *b_runs]
    owners = {"a": "ann", "b": "bob", "c": "bob"}
    dec = plan_round(round_input([a, b, c], slots[1:2], running=running, owners=owners))
    assert [s for s, _, _ in dispatched(dec)] == ["a"]


def test_a_plan_that_a_running_batch_serves_waits_for_its_checkpoint() -> None:
    plan = SearchPlan()
    plan.add_request(Config.of({"lr": MultiStep(0.1, [20], 0.5)}), 40, study="s")
    plan.add_request(Config.of({"lr": Constant(0.1)}), 40, study="s")  # branches at 20
    dec = plan_round(round_input([plan_work(plan)], [CPU0, CPU1]))
    assert len(dec.dispatches) == 1 and dec.queued == 1  # the branch waits for the save at 20
    assert any(p.step == 20 for p in dec.dispatches[0].batch.saves)


# -- the papers' steps, and several policies in one round -------------------------------------------


def test_genie_serves_urgent_work_before_older_normal_work_of_other_studies() -> None:
    normal, urgent, plain = trials("normal", 40), trials("urgent", 10, first=1), trials("plain", 20, first=2)
    works = [plan_work(normal, PlanId(1)), plan_work(urgent, PlanId(2)), plan_work(plain, PlanId(3))]
    arrivals = {r: float(i) for i, r in enumerate(k for _, reqs in works for k in reqs)}
    pols = {"urgent": parse_policies({"qos": "urgent"}), "normal": parse_policies({"qos": "normal"})}
    dec = plan_round(round_input(works, [CPU0], policies=pols, arrivals=arrivals, now=6.0))
    assert dispatched(dec)[0][0] == "urgent"
    none = plan_round(round_input(works, [CPU0], arrivals=arrivals, now=6.0))
    assert dispatched(none)[0][0] == "normal"  # no class: the longest path


def test_genie_takes_the_most_cost_effective_width_that_meets_the_deadline() -> None:
    shape = ClusterShape(1, 4)
    overhead = [(1, 100.0), (2, 55.0), (4, 32.0)]  # t = 10 + 90 / n: widening pays less and less
    assert choose_width("normal", 0.0, overhead, 0.0, shape)[0] == 1  # the ECT (2 x 100 s) met by every width
    n, latency, allowance = choose_width("prior", 0.0, overhead, 50.0, shape)  # only 4 slots finish by 100 s
    assert (n, latency) == (4, 32.0) and allowance == pytest.approx(100 - (50 + 32))
    assert choose_width("normal", 0.0, [(1, 100.0), (2, 50.0), (4, 25.0)], 0.0, shape)[0] == 4  # ideal scaling
    assert choose_width("urgent", 0.0, overhead, 1.0, shape)[0] == 1  # nothing meets it: the highest CER


def test_the_round_gives_a_qos_batch_the_width_genie_picks_on_one_node_manager() -> None:
    free = [Slot("a0", "a"), Slot("b0", "b"), Slot("b1", "b"), Slot("b2", "b"), Slot("b3", "b")]
    pols = {"s": parse_policies({"qos": "prior", "slots": 4})}
    plan = trials("s", 10)
    work, reqs = plan_work(plan, slots=4, cost=lambda st: 32.0)  # 32 s on 4 slots
    scale = {1: 1.0, 2: 55.0 / 100.0, 3: 40.0 / 100.0, 4: 32.0 / 100.0}  # t = 10 + 90 / n
    work = type(work)(work.plan, work.forest, work.cost_s, 4, 4, scale)
    (rid,) = reqs
    late = plan_round(round_input([(work, reqs)], free, policies=pols, arrivals={rid: 0.0}, now=65.0))
    assert dispatched(late) == [("s", 10, ["b0", "b1", "b2", "b3"])]  # only 4 slots finish by the ECT (100 s)
    sooner = plan_round(round_input([(work, reqs)], free, policies=pols, arrivals={rid: 0.0}, now=50.0))
    assert dispatched(sooner) == [("s", 10, ["b0", "b1", "b2"])]  # 3 slots finish in time and cost less
    early = plan_round(round_input([(work, reqs)], free, policies=pols, arrivals={rid: 0.0}, now=0.0))
    assert dispatched(early) == [("s", 10, ["a0"])]  # time enough: one slot is the most cost-effective


@pytest.mark.parametrize(("width", "placed"), [("genie", ["a0", "a1"]), ("cerpre", None)])
def test_a_qos_batch_whose_width_is_not_free_starts_on_another_that_meets_its_deadline(
    width: str, placed: list[str] | None
) -> None:
    """Ideal scaling: GENIE picks 4 slots (the highest CER, all widths meet the ECT), but no node manager
    has 4 free; 2 of node manager a also finish in time, so it starts there now. A baseline's rule fixes
    its width: it waits."""
    free = [Slot("a0", "a", gpu_index=0), Slot("a1", "a", gpu_index=1), Slot("b0", "b", gpu_index=0)]
    busy = [BusySlot(Slot(f"{h}{i}", h, gpu_index=i)) for h, first in (("a", 2), ("b", 1)) for i in range(first, 4)]
    pols = {"s": parse_policies({"qos": "normal", "slots": 4, "width": width})}
    work, reqs = plan_work(trials("s", 10), slots=4, cost=lambda st: 25.0)  # 100 s on one slot
    (rid,) = reqs
    dec = plan_round(round_input([(work, reqs)], free, busy=busy, policies=pols, arrivals={rid: 0.0}, now=0.0))
    assert dispatched(dec) == ([("s", 10, placed)] if placed else [])
    if placed:
        assert dec.dispatches[0].batch.slots == 2


@pytest.mark.parametrize(("width", "placed"), [("genie", [("n", ["b0"])]), ("cerpre", [("n", ["a0"]), ("p", ["b0"])])])
def test_qos_work_in_time_whose_width_is_not_free_holds_a_node_managers_free_slot(
    width: str, placed: list[tuple[str, list[str]]]
) -> None:
    """A Prior batch (t = 10 + 90 / n, ECT 100) at t = 10 meets its ECT on 2 to 4 slots, and GENIE takes
        2 (the highest CER of those); each node manager has one slot free. It waits, holding a0 (a and b
        tie on free slots: the first), so the Normal study served after it (allowance 90 against 35) gets b0
        only, and its second trial waits. A baseline holds nothing (``cerpre``: a Normal trial on one slot,
    the batch on the other, its most cost-effective width)."""
    free = [Slot("a0", "a", gpu_index=0), Slot("b0", "b", gpu_index=0)]
    busy = [BusySlot(Slot(f"{h}{i}", h, gpu_index=i)) for h in "ab" for i in range(1, 4)]
    scale = {1: 1.0, 2: 55.0 / 100.0, 3: 40.0 / 100.0, 4: 32.0 / 100.0}
    prior, preqs = plan_work(trials("p", 10), PlanId(1), slots=4, cost=lambda st: 32.0)
    prior = type(prior)(prior.plan, prior.forest, prior.cost_s, 4, 4, scale)
    normal, nreqs = plan_work(trials("n", 10, 10, first=1), PlanId(2), cost=lambda st: 100.0)
    pols = {
        "p": parse_policies({"qos": "prior", "slots": 4, "width": width}),
        "n": parse_policies({"qos": "normal", "width": width}),
    }
    arrivals = {r: 0.0 for r in (*preqs, *nreqs)}
    inp = round_input([(prior, preqs), (normal, nreqs)], free, busy=busy, policies=pols, arrivals=arrivals, now=10.0)
    dec = plan_round(inp)
    assert [(study, slots) for study, _, slots in dispatched(dec)] == placed


@pytest.mark.parametrize(("policy", "compute", "placed"), [("wfd", 40, 2), ("wfd", 60, 1), ("one_per_gpu", 40, 1)])
def test_packing_places_on_a_device_by_declared_compute(policy: str, compute: float, placed: int) -> None:
    pols = {"s": parse_policies({"placement": policy, "placement_params": {"compute": compute}})}
    work = plan_work(trials("s", 5, 9), cost=lambda st: float(st.steps))
    dec = plan_round(round_input([work], [CPU0, CPU1], policies=pols))
    assert len(dec.dispatches) == placed
    if policy == "wfd":
        assert dec.dispatches[0].batch.end.step == 9  # decreasing: the longer work first


def test_packing_counts_running_work_and_plain_work_takes_the_first_free_slot() -> None:
    pols = {"s": parse_policies({"placement": "wf", "placement_params": {"compute": 60}})}
    running = [RunningAttempt(BatchId(7), 1, PlanId(9), (CPU0,), ((99, 0, 5),), StudyId("s"))]
    packed = plan_work(trials("s", 1), PlanId(1))
    plain = plan_work(trials("plain", 1, first=1), PlanId(2))
    busy = [BusySlot(CPU0)]
    assert plan_round(round_input([packed], [CPU1], busy=busy, running=running, policies=pols)).dispatches == ()
    dec = plan_round(round_input([plain], [CPU1], busy=busy, running=running, policies=pols))
    assert dispatched(dec) == [("plain", 1, ["cpu1"])]


def test_a_plan_avoids_node_managers_that_cannot_run_its_trainer_and_fails_when_none_can() -> None:
    here, there = Slot("cpu0", "nm-a", cpu_cores=1), Slot("cpu0", "nm-b", cpu_cores=1)
    work, reqs = plan_work(trials("s", 5, 9))
    work = replace(work, unable={"nm-a": "ModuleNotFoundError: no module named 'mine'\nworker log: x"})
    dec = plan_round(round_input([(work, reqs)], [here, there]))
    assert [(d.slot.node_manager, d.batch.end.step) for d in dec.dispatches] == [("nm-b", 9)]
    assert dec.queued == 1 and not dec.unplaceable  # the other trial waits for nm-b: nm-a takes none
    soon = plan_round(round_input([(work, reqs)], [here], busy=[BusySlot(there, ends_at=1.0)], lookahead_s=5.0))
    assert [(d.slot.node_manager, d.ahead) for d in soon.dispatches] == [("nm-b", True)]
    packing = {"s": parse_policies({"placement": "ff", "placement_params": {"compute": 50}})}
    packed = plan_round(round_input([(work, reqs)], [here, there], policies=packing))
    assert {d.slot.node_manager for d in packed.dispatches} == {"nm-b"}
    wide = replace(work, slots=2, asked=2)
    two = [here, Slot("cpu1", "nm-a", cpu_cores=1), there, Slot("cpu1", "nm-b", cpu_cores=1)]
    assert {s.node_manager for d in plan_round(round_input([(wide, reqs)], two)).dispatches for s in d.slots} == {
        "nm-b"
    }

    nowhere = replace(work, unable={**work.unable, "nm-b": "ModuleNotFoundError: no module named 'mine'"})
    dec = plan_round(round_input([(nowhere, reqs)], [here, there]))
    assert dec.dispatches == () and dec.queued == 0
    assert dec.unplaceable == {
        work.plan: "no node manager can run this plan's trainer (nm-a: ModuleNotFoundError: no module named "
        "'mine'; nm-b: ModuleNotFoundError: no module named 'mine'); once the module is there, restart the "
        "node managers (one that registers again is tried again)"
    }


def test_gpu_slots_of_one_gpu_form_one_device() -> None:
    a, b = Slot("gpu0.0", "nm", "A100", 0, 40), Slot("gpu0.1", "nm", "A100", 0, 40)
    c = Slot("gpu1.0", "nm", "A100", 1, 40)
    pols = {"s": parse_policies({"placement": "ff", "placement_params": {"compute": 50, "memory_bytes": 30}})}
    dec = plan_round(round_input([plan_work(trials("s", 1, 1, 1))], [a, b, c], policies=pols))
    assert sorted(s for _, _, (s,) in dispatched(dec)) == ["gpu0.0", "gpu0.1", "gpu1.0"]  # 80 per GPU: two of 30


def test_hermes_binds_jobs_to_devices_and_preempts_an_expired_quantum_for_a_never_run_job() -> None:
    gpu0a, gpu0b, gpu1a = Slot("g0a", "nm", "A100", 0), Slot("g0b", "nm", "A100", 0), Slot("g1a", "nm", "A100", 1)
    pols = {"ts": parse_policies({"time_share": "hermes", "time_share_params": {"quantum_s": 2, "g_thres": 1}})}
    running = [RunningAttempt(BatchId(3), 1, PlanId(9), (gpu0a,), ((99, 0, 50),), StudyId("ts"), 0.0)]
    state = PolicyState()
    job = TimeShareJob("9:99:50", 0.0)
    job.record([2.0, 1.0], 1.0)
    state.jobs["9:99:50"] = job
    waiting = plan_work(trials("ts", 5, 5), PlanId(1))
    busy = [BusySlot(gpu0a)]
    # g_thres 1: gpu0 holds the running job; one waiting job is bound to gpu1 and runs, the other waits
    dec = plan_round(round_input([waiting], [gpu0b, gpu1a], busy=busy, running=running, policies=pols, state=state))
    assert [s for _, _, (s,) in dispatched(dec)] == ["g1a"] and dec.preempts == ()
    assert dec.wake_at == pytest.approx(2.0)  # the running quantum's end
    # its quantum over and G_thres 2: the job bound to gpu0 that never ran takes its turn
    roomy = {"ts": parse_policies({"time_share": "hermes", "time_share_params": {"quantum_s": 2, "g_thres": 2}})}
    dec = plan_round(round_input([waiting], [], busy=busy, running=running, policies=roomy, state=state, now=2.5))
    assert dec.preempts == (3,) and dec.state.pending_preempts == {3}
    early = plan_round(round_input([waiting], [], busy=busy, running=running, policies=roomy, state=state, now=1.0))
    assert early.preempts == ()  # its quantum is not over


def test_pop_kills_a_poor_trial_from_its_reports_and_serves_promising_trials_first() -> None:
    sp = parse_policies(
        {"search": "pop", "search_params": {"kill_threshold": 0.5, "eval_every": 3, "target": 0.9, "report_every": 1}}
    )
    assert sp.search is not None
    policy = sp.search.make(2)
    assert on_reports(policy, "poor", 1, [0.1, 0.12, 0.11, 0.13], 10.0, 1.0, 1) is Verdict.TERMINATE
    # through the round: a running trial's reports at epochs 1..3, all below the kill threshold
    running = [RunningAttempt(BatchId(4), 1, PlanId(2), (CPU0,), ((7, 0, 10),), StudyId("s"), 0.0)]
    reports = {(PlanId(2), 7): [Report(e, float(e), {"accuracy": 0.1}) for e in (1, 2, 3)]}
    waiting = plan_work(trials("s", 10), PlanId(1))
    dec = plan_round(
        round_input([waiting], [], busy=[BusySlot(CPU0)], running=running, policies={"s": sp}, reports=reports, now=4)
    )
    assert [str(k.job) for k in dec.kills] == ["2:7:10"] and "kill threshold 0.5" in dec.kills[0].reason
    assert dec.state.killed == {"2:7:10"} and dec.state.fed_at["2:7:10"] == 3.0


def test_pop_kills_a_running_trial_when_no_work_waits_and_wakes_at_its_next_boundary() -> None:
    sp = parse_policies(
        {"search": "pop", "search_params": {"kill_threshold": 0.5, "eval_every": 4, "target": 0.9, "report_every": 1}}
    )
    running = [RunningAttempt(BatchId(4), 1, PlanId(2), (CPU0,), ((7, 0, 20),), StudyId("s"), 0.0)]
    reports = {(PlanId(2), 7): [Report(e, float(e), {"accuracy": 0.1 * e}) for e in (1, 2, 3)]}
    dec = plan_round(round_input([], [], busy=[BusySlot(CPU0)], running=running, policies={"s": sp}, reports=reports))
    assert dec.kills == () and dec.state.epochs["2:7:20"] == 3
    # one epoch a second so far: the boundary's report (epoch 4) is due at 4.0, looked at half an epoch on
    assert dec.wake_at == 4.5
    late = plan_round(
        round_input([], [], busy=[BusySlot(CPU0)], running=running, policies={"s": sp}, reports=reports, now=5.0)
    )
    assert late.wake_at is None  # its time passed: the periodic round looks
    # the boundary's report below the kill threshold: killed though nothing waits
    reports[(PlanId(2), 7)].append(Report(4, 4.0, {"accuracy": 0.4}))
    dec = plan_round(
        round_input(
            [],
            [],
            busy=[BusySlot(CPU0)],
            running=running,
            policies={"s": sp},
            reports=reports,
            state=dec.state,
            now=4.5,
        )
    )
    assert [str(k.job) for k in dec.kills] == ["2:7:20"] and dec.wake_at is None


def test_search_policies_say_their_next_decision() -> None:
    from stagetree.core.policies import pop

    cfg = pop.PopConfig(target=0.9, t_max_s=60, kill_threshold=0.5, eval_every=4, max_epochs=12)
    assert pop.Pop(cfg, 2).next_decision(0) == 4 and pop.Pop(cfg, 2).next_decision(4) == 8
    assert pop.Pop(cfg, 2).next_decision(8) is None  # no verdict at max_epochs
    assert pop.Bandit(eval_every=10).next_decision(13) == 20 and pop.Default().next_decision(3) is None
    assert pop.EarlyTerm(30, eval_every=10).next_decision(19) == 20
    assert pop.EarlyTerm(30, eval_every=10).next_decision(20) is None


def test_studies_with_different_policies_share_one_round_and_the_lookahead_serves_those_that_allow_it() -> None:
    pols = {"ts": parse_policies({"time_share": "rr", "time_share_params": {"quantum_s": 1}})}
    ts = plan_work(trials("ts", 30, 30), PlanId(1))
    plain = plan_work(trials("plain", 20, 20, first=10), PlanId(2))
    soon = [BusySlot(Slot("s1", "nm"), ends_at=1.0), BusySlot(Slot("s2", "nm"), ends_at=1.5)]
    dec = plan_round(round_input([ts, plain], [CPU0], busy=soon, policies=pols, lookahead_s=3.0))
    by_study = {study: slots for study, _, slots in dispatched(dec)}
    assert set(by_study) == {"ts", "plain"} and by_study["ts"] == ["cpu0"]  # a free slot for the time-shared work
    assert [d.ahead for d in dec.dispatches if d.study == "plain"] == [True, True]  # the rest goes ahead
    assert all(d.batch.evals for d in dec.dispatches)
    ts_batch = next(d.batch for d in dec.dispatches if d.study == "ts")
    assert {p.step for p in ts_batch.evals} == {5, 10, 15, 20, 25, 30}  # it reports every eval_every steps


def test_eval_points_and_losses() -> None:
    assert eval_points([(1, 0, 10), (2, 10, 23)], 5) == [(1, 5), (1, 10), (2, 15), (2, 20)]
    assert losses_of([(2.0, {"loss": 1.0}), (1.0, {"loss": 3.0}), (3.0, {"acc": 1.0})], "loss") == [3.0, 1.0]


# -- properties -----------------------------------------------------------------------------------

VALUES = (0.1, 0.05, 0.02)


@st.composite
def rounds(draw: st.DrawFn) -> RoundInput:
    """A round over random plans (shared prefixes, checkpoints, running batches), studies with random
    policies, free and busy slots on a few node managers."""
    plans = []
    studies = [f"s{i}" for i in range(draw(st.integers(1, 3)))]
    node_ids, request_ids = itertools.count(1), itertools.count(1)
    for k in range(draw(st.integers(1, 3))):
        plan = SearchPlan(f"p{k}", node_ids=node_ids, request_ids=request_ids)
        for _ in range(draw(st.integers(1, 8))):
            cut = draw(st.integers(1, 15))
            lr = MultiStep(draw(st.sampled_from(VALUES)), [cut], draw(st.sampled_from((0.5, 0.1))))
            res = plan.add_request(
                Config.of({"lr": lr}), draw(st.integers(1, 20)), study=draw(st.sampled_from(studies))
            )
            if res.request is not None and draw(st.booleans()) and res.point.step > 2:
                _checkpoint(plan, res.point.node, res.point.step // 2)
        plans.append(plan_work(plan, PlanId(k + 1), slots=draw(st.sampled_from((1, 1, 2)))))
    hosts = draw(st.integers(1, 3))
    slots = [Slot(f"h{h}s{i}", f"h{h}", "gpu", i % 2) for h in range(hosts) for i in range(draw(st.integers(1, 3)))]
    free = [s for s in slots if draw(st.booleans())]
    busy = [BusySlot(s, draw(st.one_of(st.none(), st.floats(0.0, 10.0)))) for s in slots if s not in free]
    choices = [
        {},
        {"time_share": "hermes", "time_share_params": {"quantum_s": 1}},
        {"placement": "wfd", "placement_params": {"compute": 50}},
        {"qos": "prior"},
        {"qos": "normal", "slots": 2},  # a width of 1 or 2, the other when its own is not free
        {"order": "bfs"},
    ]
    policies = {s: parse_policies(draw(st.sampled_from(choices))) for s in studies}
    inp = round_input(plans, free, busy=busy, policies=policies, now=1.0, lookahead_s=draw(st.sampled_from((0.0, 3.0))))
    # free slots whose worker ended where some batch of a plan starts
    sources = [(w.plan, st.source) for w, _ in plans for st in w.forest.stages if st.source is not None]
    warm = {src: draw(st.sampled_from(free)) for src in sources if free and draw(st.booleans())}
    return replace(inp, warm=warm)


def _checkpoint(plan: SearchPlan, node: int, step: int) -> None:
    if step > plan.nodes[node].start:
        plan.record_checkpoint(Checkpoint(Point(node, step), f"mem://{node}/{step}", 1))


@settings(max_examples=120, deadline=None)
@given(rounds())
def test_a_round_serves_each_request_once_runs_no_stage_twice_and_overcommits_no_slot(inp: RoundInput) -> None:
    before = copy.deepcopy(inp)
    dec = plan_round(inp)
    served = [r for d in dec.dispatches for r in d.batch.requests]
    assert len(served) == len(set(served))  # every request in one dispatch at most
    assert set(served) <= set(inp.requests)
    stages = [(d.batch.plan, id(st)) for d in dec.dispatches for st in d.batch.stages]
    assert len(stages) == len(set(stages))  # no stage in two batches
    taken = [s for d in dec.dispatches for s in d.slots]
    assert len(taken) == len(set(taken))  # no slot given twice
    free, soon = set(inp.free), {b.slot for b in inp.busy if b.ends_at is not None}
    for d in dec.dispatches:
        assert len(d.slots) == d.batch.slots and len({s.node_manager for s in d.slots}) == 1
        assert len({s.rank_place for s in d.slots}) == len(d.slots)  # no two ranks on one GPU
        assert all(s in free for s in d.slots) or (d.ahead and len(d.slots) == 1 and d.slot in soon)
        assert d.batch.ready
    again = plan_round(inp)  # deterministic, and the input is untouched
    assert dispatched(again) == dispatched(dec) and again.preempts == dec.preempts
    assert again.wake_at == dec.wake_at and again.unplaceable == dec.unplaceable
    assert [(p.plan, [(s.node, s.start, s.end) for s in p.forest.stages]) for p in inp.plans] == [
        (p.plan, [(s.node, s.start, s.end) for s in p.forest.stages]) for p in before.plans
    ]
    assert inp.state.snapshot("s0") == before.state.snapshot("s0")


@st.composite
def share_runs(draw: st.DrawFn) -> tuple[list[list[tuple[str | None, float, tuple[float, ...]]]], dict[str, str], list]:
    """Queues of (study, tier, rank) heads, the studies' owners, slots already held, and for each pop the
    slots the popped head takes (0: it waits)."""
    studies = [None, *(f"s{i}" for i in range(draw(st.integers(1, 5))))]
    head = st.tuples(
        st.sampled_from(studies), st.sampled_from((0.0, 0.0, 1.0, 2.5)), st.tuples(st.integers(0, 4), st.integers(0, 3))
    )
    queues = draw(st.lists(st.lists(head, min_size=1, max_size=6), min_size=1, max_size=8))
    owners = {s: draw(st.sampled_from(("a", "b", "c"))) for s in studies if s is not None}
    running = draw(st.lists(st.tuples(st.sampled_from(studies), st.integers(1, 3)), max_size=4))
    takes = draw(st.lists(st.integers(0, 2), min_size=60, max_size=60))
    return queues, owners, [running, takes]


@settings(max_examples=200, deadline=None)
@given(share_runs())
def test_fair_share_takes_queues_in_share_key_order_as_one_flat_heap_would(run: tuple) -> None:
    from stagetree.core.round.order import FairShare

    queues, owners, (running, takes) = run
    share: FairShare[int] = FairShare(owners)
    held: dict[str | None, int] = {}
    owner_held: dict[str, int] = {}

    def took(study: str | None, n: int) -> None:
        share.took(study, n)
        held[study] = held.get(study, 0) + n
        if study is not None:
            owner_held[owners[study]] = owner_held.get(owners[study], 0) + n

    for study, n in running:
        took(study, n)
    seq = itertools.count()
    pushed: dict[int, int] = {}  # queue -> when its current head was pushed
    pos = [0] * len(queues)

    def push(i: int) -> None:
        if pos[i] < len(queues[i]):
            study, tier, rank = queues[i][pos[i]]
            share.push(i, study, tier, rank)
            pushed[i] = next(seq)

    def flat_key(i: int) -> tuple:
        study, tier, rank = queues[i][pos[i]]
        owner = owners.get(study, "") if study is not None else ""
        return (tier, owner_held.get(owner, 0), held.get(study, 0), rank, pushed[i])

    for i in range(len(queues)):
        push(i)
    for n in takes:
        expected = min(pushed, key=flat_key) if pushed else None
        got = share.pop()
        assert got == expected
        if got is None:
            break
        del pushed[got]
        study = queues[got][pos[got]][0]
        pos[got] += 1
        if n:
            took(study, n)
        push(got)
    assert sorted(share.queues()) == sorted(pushed)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=8),
    st.lists(st.integers(1, 5), max_size=30),
)
def test_least_loaded_binds_as_hermes_find_available_gpu_does(loads: list[int], thresholds: list[int]) -> None:
    from stagetree.core.policies.hermes import find_available_gpu
    from stagetree.core.round.learn import LeastLoaded

    counts = {f"gpu{i}": n for i, n in enumerate(loads)}
    naive = dict(counts)
    least = LeastLoaded(counts)
    for g_thres in thresholds:
        want = find_available_gpu(naive, g_thres)
        if want is not None:
            naive[want] += 1
        assert least.take(g_thres) == want
    assert counts == naive


def test_a_batch_goes_to_the_free_slot_whose_worker_ended_where_it_starts() -> None:
    """``RoundInput.warm``: a trial's next batch runs on the slot that trained it last (its worker holds the
    trainer there: no checkpoint read), unless that slot is taken or its node manager cannot run it."""
    plan = trials("s", 10)
    (node,) = plan.nodes
    plan.record_metrics(Point(node, 10), {"loss": 1.0})
    _checkpoint(plan, node, 10)
    plan.add_request(Config.of({"trial": 0}), 20, study="s")
    work = plan_work(plan)
    warm = {(PLAN, Point(node, 10)): CPU1}
    assert dispatched(plan_round(round_input([work], [CPU0, CPU1]))) == [("s", 20, ["cpu0"])]
    dec = plan_round(replace(round_input([work], [CPU0, CPU1]), warm=warm))
    assert dispatched(dec) == [("s", 20, ["cpu1"])] and dec.dispatches[0].batch.source == Point(node, 10)
    assert dispatched(plan_round(replace(round_input([work], [CPU0]), warm=warm))) == [("s", 20, ["cpu0"])]
    (pw, reqs) = work  # a warm slot on a node manager that cannot run the plan is not used
    other = Slot("cpu0", "nm2", cpu_cores=1)
    away = (replace(pw, unable={"nm2": "no trainer"}), reqs)
    dec = plan_round(replace(round_input([away], [other, CPU1]), warm={(PLAN, Point(node, 10)): other}))
    assert dispatched(dec) == [("s", 20, ["cpu1"])]
