"""``plan_round``: one scheduling round, a pure function of its input (see the package docstring)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from stagetree.core.batch import Point
from stagetree.core.cache import choose_evictions, pinned_points, prefix_cost
from stagetree.core.errors import ResourceExhausted
from stagetree.core.estimator import batch_slots
from stagetree.core.ids import BatchId, JobKey, PlanId, StudyId
from stagetree.core.policies import genie, hermes
from stagetree.core.policies.state import PolicyState
from stagetree.core.policies.study import StudyPolicies
from stagetree.core.round.learn import (
    Observed,
    assign_devices,
    eval_points,
    observe,
    quantum_ends,
    search_wakes,
    time_share_preempt,
)
from stagetree.core.round.model import Dispatch, PlanWork, RoundDecision, RoundInput
from stagetree.core.round.order import (
    DecreasingOrder,
    FairShare,
    OrderStep,
    OrderView,
    QosOrder,
    SearchOrder,
    TimeShareOrder,
    normal_tier,
)
from stagetree.core.round.place import FirstFit, PackingPlace, PlaceStep, SlotPool, TimeSharePlace
from stagetree.core.round.work import Work, cut
from stagetree.core.scheduler import PlannedBatch, count_batches
from stagetree.core.slots import Slot, rank_places

_DEFAULT = StudyPolicies()


@dataclass(frozen=True)
class StudySteps:
    """The steps one study's work goes through, from what it chose (``steps_for``)."""

    cut: str  # the order the study's plans are cut in (``core.scheduler.ORDER_POLICIES``)
    orders: tuple[OrderStep, ...] = ()  # applied in turn: the last one decides first
    place: PlaceStep = field(default_factory=FirstFit)
    report_every: int = 0  # its batches evaluate every this many steps (0: only where requests wait)
    needs_arrival: bool = False

    @property
    def lookahead(self) -> bool:
        """Whether its work may go to a busy slot about to free."""
        return isinstance(self.place, FirstFit) and self.place.lookahead


def steps_for(study: StudyId, p: StudyPolicies, default_order: str) -> StudySteps:
    """A study's steps: the default set (the critical path, first fit with the lookahead) unless its
    policies name others. Names were checked against each step's registry when the study was made."""
    orders: list[OrderStep] = []
    if p.qos is not None:
        orders.append(QosOrder(p.qos, p.width))
    if p.search is not None:
        orders.append(SearchOrder(study))
    if p.time_share is not None:
        orders.append(TimeShareOrder(p.time_share))
    if p.placement is not None and _decreasing(p.placement.policy):
        orders.append(DecreasingOrder())
    place: PlaceStep
    if p.placement is not None:
        place = PackingPlace(p.placement)
    elif p.time_share is not None:
        place = TimeSharePlace()
    else:
        place = FirstFit(lookahead=True)
    every = [x for x in (p.time_share and p.time_share.eval_every, p.search and p.search.report_every) if x]
    return StudySteps(p.order or default_order, tuple(orders), place, min(every, default=0), bool(orders))


def _decreasing(name: str) -> bool:
    from stagetree.core.policies.packing import place_policy

    return place_policy(name).decreasing


class _Queue:
    """The next work of one plan (cut lazily) or of one study (cut whole and reordered)."""

    def __init__(self, items: Iterator[Work]) -> None:
        self._items = items
        self.head: Work | None = next(self._items, None)

    def pop(self) -> Work:
        w = self.head
        assert w is not None
        self.head = next(self._items, None)
        return w


def plan_round(inp: RoundInput) -> RoundDecision:
    """One round: learn from the running trials' reports, cut each plan's forest into batches, order
    them within each study and across studies, place them, and preempt. ``inp`` is not changed."""
    return _Round(inp).run()


class _Round:
    def __init__(self, inp: RoundInput) -> None:
        self.inp = inp
        self.now = inp.now
        self.policies = inp.policies
        # the policies' state is copied only where some study's policies learn (or learnt before)
        self.learning = any(p.stateful for p in inp.policies.values()) or not inp.state.empty()
        self.state: PolicyState = inp.state.clone() if self.learning else inp.state
        self.all_slots: list[Slot] = [*inp.free, *(b.slot for b in inp.busy)]
        per_host = rank_places(self.all_slots)  # a batch's ranks go to distinct GPUs (Slot.rank_place)
        self.most = max(per_host.values(), default=0)
        self.hosts = per_host.keys()
        self.shape = genie.ClusterShape(max(len(per_host), 1), max(self.most, 1))
        free_per_host = rank_places(inp.free)
        self.view = OrderView(self.now, self.state, self.shape, max(free_per_host.values(), default=0))
        self.steps: dict[StudyId, StudySteps] = {
            sid: steps_for(sid, p, inp.settings.order) for sid, p in sorted(inp.policies.items())
        }
        self.default = StudySteps(inp.settings.order)
        self.qos_round = any(p.qos is not None for p in inp.policies.values())
        self.unplaceable: dict[PlanId, str] = {}

    def steps_of(self, study: StudyId | None) -> StudySteps:
        return self.steps.get(study, self.default) if study is not None else self.default

    # -- the round ------------------------------------------------------------------------------

    def run(self) -> RoundDecision:
        inp = self.inp
        plans = [p for p in inp.plans if self._placeable(p)]
        lazy, whole = self._split(plans)
        observed = Observed([], set())
        if self.learning:
            ready = {s: len(ws) for s, ws in whole.items()}
            observed = observe(
                self.state, inp.running, self.policies, inp.reports, ready, len(self.all_slots), self.now
            )
        soon, wake_at = self._soon()
        ordered: list[list[Work]] = []
        for study, ws in sorted(whole.items(), key=lambda kv: (kv[0] is None, kv[0] or "")):
            for step in self.steps_of(study).orders:
                ws = step.order(ws, self.view)
            ordered.append(ws)
        if any(p.time_share is not None for p in self.policies.values()):
            devices = list(dict.fromkeys(s.device for s in self.all_slots))
            assign_devices(self.state, [w for ws in ordered for w in ws], observed.time_shared, self.policies, devices)
        pool = SlotPool(inp.free, soon, self.all_slots, inp.running, self.policies, self.state.device)
        queues = [_Queue(self._work_of(p, self.default.cut)) for p in lazy]
        queues += [_Queue(iter(ws)) for ws in ordered]
        dispatches, waiting = self._place(queues, pool)
        preempts = self._preempt(observed, waiting)
        kept = [
            replace(r, started=self.state.quantum_start.get(r.batch, r.started))
            for r in observed.time_shared
            if r.batch not in preempts
        ]
        wakes = quantum_ends(kept, self.policies, self.state.jobs)
        if self.learning:
            wakes += search_wakes(self.state, inp.running, self.policies, self.now)
        for q in wakes:
            wake_at = q if wake_at is None else min(wake_at, q)
        if self.learning:
            live = {w.key for ws in whole.values() for w in ws} | {
                str(JobKey(r.plan, r.end.node, r.end.step)) for r in inp.running
            }
            self.state.forget_jobs(live)
        queued = sum(count_batches(p.forest) for p in plans) - len(dispatches)
        return RoundDecision(
            tuple(dispatches),
            tuple(BatchId(b) for b in sorted(self.state.pending_preempts)),
            tuple(self.state.pending_kills[j] for j in sorted(self.state.pending_kills)),
            self._evictions(plans),
            dict(self.unplaceable),
            wake_at,
            self.state,
            max(queued, 0),
        )

    def _placeable(self, p: PlanWork) -> bool:
        """Whether some node manager has the slots a batch of the plan takes; if not, say why."""
        if self.most == 0:
            return True
        try:
            batch_slots(p.asked, p.slots, self.most)
        except ResourceExhausted as e:
            self.unplaceable[p.plan] = e.message
            return False
        if p.unable and self.hosts <= p.unable.keys():
            self.unplaceable[p.plan] = no_host_can_run(p.unable)
            return False
        return True

    def _split(self, plans: Sequence[PlanWork]) -> tuple[list[PlanWork], dict[StudyId | None, list[Work]]]:
        """The plans cut lazily (no study of theirs reorders its work) and the work of the studies that
        reorder, cut whole, in each study's cut order."""
        if not self.policies:
            return list(plans), {}
        reordering = {s for s, st in self.steps.items() if st.orders or st.cut != self.default.cut}
        lazy: list[PlanWork] = []
        whole: dict[StudyId | None, list[Work]] = {}
        requests = self.inp.requests
        for p in plans:
            studies = {requests.get(r) for st in p.forest.stages for r in st.requests}
            chosen = sorted(s for s in studies if s in reordering)
            if not chosen:
                lazy.append(p)
                continue
            order = self.steps[chosen[0]].cut
            for w in self._work_of(p, order):
                whole.setdefault(w.study, []).append(w)
        return lazy, whole

    def _work_of(self, p: PlanWork, order: str) -> Iterator[Work]:
        """The plan's ready batches as work, in the cut's order; killed trials are left out."""
        inp = self.inp
        requests, arrivals, killed = inp.requests, inp.arrivals, self.state.killed
        widths_wanted = self.qos_round and p.slots > 1
        avoid = frozenset(p.unable)
        wants_arrival: dict[StudyId | None, bool] = {}
        for b in cut(p, order):
            if not b.ready:
                continue
            end = b.stages[-1]
            job = JobKey(p.plan, end.node, end.end)
            key = str(job)
            if killed and key in killed:
                continue
            study = requests.get(b.requests[-1])
            wanted = wants_arrival.get(study)
            if wanted is None:
                wanted = wants_arrival[study] = self.qos_round or self.steps_of(study).needs_arrival
            arrival = 0.0
            if wanted:
                arrival = min(arrivals.get(r, self.now) for r in b.requests)
            widths: tuple[tuple[int, float], ...] = ()
            if widths_wanted:
                one = b.cost / max(p.step_scale.get(p.slots, 1.0 / p.slots), 1e-12)
                widths = tuple((k, one * p.step_scale.get(k, 1.0 / k)) for k in genie.widths(p.slots))
            warm = inp.warm.get((p.plan, b.source)) if inp.warm and p.slots == 1 else None
            yield Work(
                b, study, job, b.cost, p.slots, arrival, widths, key=key, first=min(b.requests), avoid=avoid, warm=warm
            )

    def _soon(self) -> tuple[list[Slot], float | None]:
        """The busy slots whose one batch should end within the lookahead, soonest first, and when the
        next other one comes that close (None: none will)."""
        ahead = self.inp.settings.lookahead_s
        if ahead <= 0:
            return [], None
        horizon = self.now + ahead
        soon = sorted(
            (b for b in self.inp.busy if b.ends_at is not None and b.ends_at <= horizon),
            key=lambda b: (b.ends_at, b.slot.node_manager, b.slot.id),
        )
        later = [b.ends_at - ahead for b in self.inp.busy if b.ends_at is not None and b.ends_at > horizon]
        return [b.slot for b in soon], min(later, default=None)

    def _place(self, queues: list[_Queue], pool: SlotPool) -> tuple[list[Dispatch], list[Work]]:
        """Take the next work across studies by ``share_key`` and place it; returns the dispatches and
        the work that waits (all of the reordering studies' work that was not placed)."""
        share: FairShare[_Queue] = FairShare(self.inp.owners)
        for r in self.inp.running:
            share.took(r.study, len(r.slots))

        def push(q: _Queue) -> None:
            if q.head is not None:
                if self.qos_round and q.head.tier == 0.0 and self.steps_of(q.head.study).orders == ():
                    q.head = replace(q.head, tier=normal_tier(q.head, self.view))
                share.push(q, q.head.study, q.head.tier, q.head.batch.rank)

        for q in queues:
            push(q)
        dispatches: list[Dispatch] = []
        waiting: list[Work] = []
        while True:
            has_free = pool.first_free() is not None
            if not has_free and pool.first_soon() is None:
                break
            got_q = share.pop()
            if got_q is None:
                break
            q = got_q
            assert q.head is not None
            steps = self.steps_of(q.head.study)
            if not has_free and (q.head.slots > 1 or not steps.lookahead):
                # only busy slots about to free are left, and this work may not go there: it waits (a
                # lazily cut plan is not cut further)
                if steps.orders:
                    while q.head is not None:
                        waiting.append(q.pop())
                continue
            w = q.pop()
            if w.slots > 1:
                w, got = self._place_wide(w, pool)
            else:
                got = steps.place.place(w, pool)
            if got is None:
                waiting.append(w)
                if w.hold and w.slots > 1:
                    pool.hold(w.slots, w.avoid)
            else:
                slots, ahead = got
                pool.take(slots, w)
                dispatches.append(self._dispatch(w, slots, ahead))
                share.took(w.study, len(slots))
            push(q)
        for q in share.queues():  # what the reordering studies still have waits too (the preempt step reads it)
            while q.head is not None and self.steps_of(q.head.study).orders:
                waiting.append(q.pop())
        return dispatches, waiting

    @staticmethod
    def _place_wide(w: Work, pool: SlotPool) -> tuple[Work, tuple[tuple[Slot, ...], bool] | None]:
        """``w`` on its slots of one node manager, else on the first of its other widths free now (the
        work as placed, and where; None: it waits)."""
        for n, cost in ((w.slots, w.cost_s), *w.others):
            wide = pool.wide(n, w.avoid)
            if wide is not None:
                return (w if n == w.slots else replace(w, slots=n, cost_s=cost)), (wide, False)
        return w, None

    def _dispatch(self, w: Work, slots: tuple[Slot, ...], ahead: bool) -> Dispatch:
        b: PlannedBatch = w.batch
        b.slots = len(slots)
        steps = self.steps_of(w.study)
        if steps.report_every:
            stages = [(s.node, s.start, s.end) for s in b.stages]
            b.evals.update(Point(n, s) for n, s in eval_points(stages, steps.report_every))
        p = self.policies.get(w.study) if w.study is not None else None
        if p is not None and p.time_share is not None and w.study is not None:
            self.state.jobs.setdefault(w.key, hermes.TimeShareJob(w.key, w.arrival))
            self.state.own_job(w.key, w.study)
        return Dispatch(b, slots, w.study, ahead)

    def _preempt(self, observed: Observed, waiting: list[Work]) -> set[BatchId]:
        """Hermes' preemptions and the search policies' suspensions, recorded as pending in the state."""
        if not self.learning:
            return set()
        st = self.state
        preempt = time_share_preempt(waiting, observed.time_shared, self.policies, st.jobs, st.device, self.now)
        for r in observed.time_shared:  # a job that keeps its slot when its quantum ended starts a new one
            if r.batch in observed.expired and r.batch not in preempt:
                st.quantum_start[r.batch] = self.now
        study_of = {r.batch: r.study for r in self.inp.running if r.study is not None}
        out = set(preempt) | observed.suspend
        for bid in out:
            if bid in study_of:
                st.own_batch(bid, study_of[bid])
        st.preempting.update(out)
        st.pending_preempts.update(out)
        return out

    def _evictions(self, plans: Sequence[PlanWork]) -> tuple[Point, ...]:
        budget = self.inp.checkpoints
        if budget is None:
            return ()
        sources = {r.source for r in self.inp.running if r.source is not None}
        pinned: set[Point] = set(sources)
        for p in plans:
            pinned |= pinned_points(p.forest)
        on_running = {n for r in self.inp.running for n, _, _ in r.stages}
        pinned.update(p for p in budget.checkpoints if p.node in on_running)  # a running batch may load them
        result = choose_evictions(
            budget.checkpoints,
            budget.budget_bytes,
            pinned=pinned,
            recompute_cost=prefix_cost(budget.nodes, budget.step_s),
            now=self.now,
            nodes=budget.nodes,
        )
        return tuple(result.evict)


def no_host_can_run(unable: Mapping[str, str]) -> str:
    """Why a plan's requests fail when no live node manager can run its trainer: each one's reason."""
    reasons = "; ".join(
        f"{nm}: {why.strip().splitlines()[0] if why.strip() else 'no reason given'}"
        for nm, why in sorted(unable.items())
    )
    return (
        f"no node manager can run this plan's trainer ({reasons}); once the module is there, restart the node "
        "managers (one that registers again is tried again)"
    )
