"""Round inputs for tests and benches that schedule core ``SearchPlan``s by hand."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from stagetree.core.ids import PlanId, RequestId, StudyId
from stagetree.core.policies.state import PolicyState
from stagetree.core.policies.study import StudyPolicies
from stagetree.core.round import BusySlot, PlanWork, Report, RoundInput, RoundSettings, RunningAttempt
from stagetree.core.searchplan import SearchPlan
from stagetree.core.slots import Slot
from stagetree.core.stagetree import InflightBatch, Stage, build_stage_tree

PLAN = PlanId(1)


def steps_of(st: Stage) -> float:
    return float(st.end - st.start)


def plan_work(
    plan: SearchPlan,
    plan_id: PlanId = PLAN,
    *,
    cost: Callable[[Stage], float] = steps_of,
    inflight: Iterable[InflightBatch] = (),
    slots: int = 1,
    asked: int | None = None,
    study: str = "",
) -> tuple[PlanWork, dict[RequestId, StudyId]]:
    """``plan``'s pending requests as the round's work, and the study of each (the request's own, else
    ``study``)."""
    pending = [(RequestId(r.id), r.point) for r in plan.pending()]
    forest = build_stage_tree(plan.nodes, plan.checkpoint_steps(), pending, inflight, plan=plan_id)
    requests = {rid: StudyId(plan.requests[rid].study or study) for rid, _ in pending}
    work = PlanWork(plan_id, forest, [cost(st) for st in forest.stages], slots, slots if asked is None else asked)
    return work, requests


def round_input(
    works: Sequence[tuple[PlanWork, Mapping[RequestId, StudyId]]],
    free: Sequence[Slot],
    *,
    order: str = "critical_path",
    busy: Sequence[BusySlot] = (),
    running: Sequence[RunningAttempt] = (),
    policies: Mapping[str, StudyPolicies] | None = None,
    owners: Mapping[str, str] | None = None,
    arrivals: Mapping[RequestId, float] | None = None,
    state: PolicyState | None = None,
    reports: Mapping[tuple[PlanId, int], Sequence[Report]] | None = None,
    now: float = 0.0,
    lookahead_s: float = 0.0,
) -> RoundInput:
    requests: dict[RequestId, StudyId] = {}
    for _, reqs in works:
        requests.update(reqs)
    return RoundInput(
        now=now,
        plans=[w for w, _ in works],
        requests=requests,
        free=free,
        busy=busy,
        running=running,
        policies={StudyId(k): v for k, v in (policies or {}).items()},
        owners={StudyId(k): v for k, v in (owners or {}).items()},
        arrivals=dict(arrivals or {}),
        state=state if state is not None else PolicyState(),
        reports=dict(reports or {}),
        settings=RoundSettings(order, lookahead_s),
    )


def plan_input(
    plan: SearchPlan,
    free: Sequence[Slot],
    *,
    cost: Callable[[Stage], float] = steps_of,
    order: str = "critical_path",
    inflight: Iterable[InflightBatch] = (),
    study: str = "",
    slots: int = 1,
    now: float = 0.0,
    lookahead_s: float = 0.0,
    busy: Sequence[BusySlot] = (),
    running: Sequence[RunningAttempt] = (),
    policies: Mapping[str, StudyPolicies] | None = None,
) -> RoundInput:
    """The round over ``plan``'s pending requests alone (plan id ``PLAN``)."""
    work = plan_work(plan, cost=cost, inflight=inflight, slots=slots, study=study)
    return round_input(
        [work], free, order=order, busy=busy, running=running, policies=policies, now=now, lookahead_s=lookahead_s
    )
