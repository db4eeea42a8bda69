"""Discrete-event simulation of a cluster that runs the live scheduling round, ``round.plan_round``.

The simulator plays the master and the node managers on a virtual clock; only time and the workers
are simulated. Each round it builds the same ``RoundInput`` the master's reader builds (each plan's
stage forest from its pending requests, checkpoints and running batches; free and busy slots with
the expected end of each busy one; the running attempts; the studies' policies and their state; the
reports recorded since; the cost table) and carries the ``RoundDecision`` out as the master's applier
and the node managers do:

* a dispatch starts its batch on its slots, or waits on a busy slot until it frees (the lookahead);
  a worker loads its source checkpoint (``load_s``, nothing when it continues on the slot where the
  last batch ended), trains its steps (``Workload.step_s`` each, slowed by ``Contention`` when batches
  share a device), evaluates where requests wait (``eval_s``) and saves checkpoints in the background
  (available ``save_s`` after it passes the point), peripheral ones every ``peripheral_every_s``; with
  ``snapshots`` it also leaves a checkpoint at every step it trained when it ends (the runtime's
  in-memory snapshots of a small model, written as one pack), as the master's batches do: on one CPU
  slot, in a plan that keeps them (``searchplan.batch_keeps_snapshots``, with ``snapshot_probation_roots``);
* a preemption finishes the step in flight, saves a checkpoint (``save_s``, holding the slot) and ends
  the batch; its requests go back to the pending work, which resumes from that checkpoint;
* a kill cancels the trial's live requests (aborting its batch when nothing else needs it);
* ``Fault`` events crash the batches on some slots, take slots away (a lost node manager: its
  batches' work is requeued from their latest checkpoints) or add slots.

Rounds run ``round_delay_s`` after something a round looks at changed (a slot freed, a checkpoint
appeared, requests arrived, a fault: the master's round follows its wake-up by that much), at the
decision's ``wake_at``, and every ``round_interval_s`` while new reports came from the batches of
studies whose policies learn from them (the master runs a round at least that often; a round with
nothing new decides nothing new). Every trained step reports the workload's metrics, as a learning
curve.

A *driver* plays the tuner: it issues requests (``Ask``) and reacts to results. The report gives
makespan, worker-seconds, executed versus unique steps and a lower bound on the makespan, when each
request was served, and per step when it was first trained.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stagetree.core.batch import Point
from stagetree.core.config import Config
from stagetree.core.errors import InvalidArgument
from stagetree.core.ids import BatchId, JobKey, PlanId, RequestId, StudyId
from stagetree.core.lifecycle import RequestState
from stagetree.core.policies.genie import widths as gpu_widths
from stagetree.core.policies.state import PolicyState
from stagetree.core.policies.study import StudyPolicies
from stagetree.core.round import (
    BusySlot,
    Dispatch,
    PlanWork,
    Report,
    RoundDecision,
    RoundInput,
    RoundSettings,
    RunningAttempt,
    plan_round,
)
from stagetree.core.scheduler import PlannedBatch, StageCost
from stagetree.core.searchplan import Checkpoint, SearchPlan, batch_keeps_snapshots
from stagetree.core.slots import Slot
from stagetree.core.stagetree import InflightBatch, InflightStage, Stage, build_stage_tree

# The round every simulation calls: the function the master's loop calls (``tests.bench.policies``
# checks that they are the same object).
ROUND = plan_round

StepTime = Callable[[Config, int], float]
Curve = Callable[[Config, int], float]


def unit_step_time(config: Config, step: int) -> float:
    return 1.0


# ---------------------------------------------------------------------------------------------
# What the simulated workers do


class Workload(Protocol):
    def step_s(self, config: Config, step: int, slots: int, gpu_type: str) -> float:
        """Seconds a worker alone on its device takes for training step ``step`` on ``slots`` slots of
        ``gpu_type``."""
        ...

    def metrics(self, config: Config, step: int) -> dict[str, float]:
        """What the trainer reports after ``step`` steps (an evaluation, and its learning-curve point)."""
        ...


@dataclass(frozen=True)
class SimpleWorkload:
    """Steps of ``step_time`` seconds (ideal speedup on several slots) and a loss ``curve``."""

    step_time: StepTime = unit_step_time
    curve: Curve | None = None

    def step_s(self, config: Config, step: int, slots: int, gpu_type: str) -> float:
        return self.step_time(config, step) / slots

    def metrics(self, config: Config, step: int) -> dict[str, float]:
        return {"loss": self.curve(config, step) if self.curve is not None else 0.0}


class Contention(Protocol):
    def slowdowns(self, device: Slot, here: Sequence[Config], host_load: float) -> list[float]:
        """How much slower each of the batches running on one device (``device``: one of its slots) runs
        than alone (>= 1), given their configs and ``host_load`` (what ``load`` of every batch on the
        device's node manager sums to, over its capacity)."""
        ...

    def load(self, config: Config) -> float:
        """What one batch adds to its node manager's load (its CPU cores, say)."""
        ...


@dataclass(frozen=True)
class Fault:
    """At ``at``: ``crash`` the batches on ``slots`` (their workers fail, the slots stay), ``lose`` the
    slots (a node manager gone: its batches' work is requeued from their latest checkpoints) or ``add``
    them."""

    at: float
    kind: str
    slots: tuple[Slot, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("crash", "lose", "add"):
            raise InvalidArgument(f"fault kind must be crash, lose or add, got {self.kind!r}")


# ---------------------------------------------------------------------------------------------
# Drivers (tuner-like request streams)


@dataclass(frozen=True)
class Ask:
    """A driver's request: train ``config`` to ``step`` for ``study``; ``tag`` comes back with the result.
    Asks of different ``plan`` keys never share steps (different fixed parts). An ask ``at`` a later time
    is submitted then."""

    tag: Any
    config: Config
    step: int
    study: str = ""
    plan: str = ""
    at: float = 0.0


class Driver(Protocol):
    def start(self) -> list[Ask]: ...

    def on_result(self, tag: Any, step: int, metrics: dict[str, float]) -> list[Ask]: ...


def plan_boundaries(plan: SearchPlan, cache: dict[str, Any]) -> list[int]:
    """Every step where some config of the plan starts a new piece, sorted; the places where trials
    of one search space branch. ``cache`` keeps the work incremental as the plan grows."""
    seen: set[int] = cache.setdefault("steps", set())
    done: int = cache.get("nodes", 0)
    if done < len(plan.nodes):
        for node in list(plan.nodes.values())[done:]:
            for _, segs in node.config.items:
                seen.update(seg.start for seg in segs if seg.start > 0)
        cache["nodes"] = len(plan.nodes)
        cache["sorted"] = sorted(seen)
    out: list[int] = cache.get("sorted", [])
    return out


# ---------------------------------------------------------------------------------------------
# The report


@dataclass
class SimReport:
    policy: str
    workers: int
    makespan: float
    worker_seconds: float
    executed_steps: int
    unique_steps: int
    requested_steps: int
    requests: int
    served: int
    rounds: int
    duplicate_steps: int
    critical_path: float
    work: float
    lower_bound: float
    served_at: dict[Any, float] = field(default_factory=dict)  # driver tag -> when its result came
    cancelled: list[Any] = field(default_factory=list)  # tags whose requests a policy cancelled
    failed: dict[Any, str] = field(default_factory=dict)  # tags whose requests failed, and why
    preemptions: int = 0
    dispatched_ahead: int = 0
    lost_batches: int = 0  # batches a fault ended (their work went back to the pending requests)

    @property
    def merge_rate(self) -> float:
        return self.requested_steps / self.unique_steps if self.unique_steps else 1.0

    @property
    def vs_lower_bound(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound else 1.0


# ---------------------------------------------------------------------------------------------
# The simulation


@dataclass
class _Plan:
    id: PlanId
    key: str
    plan: SearchPlan
    boundaries: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _Run:
    """One batch attempt on its slots: its steps, how far it got, and how fast it goes now."""

    id: BatchId
    plan: _Plan
    batch: PlannedBatch
    slots: tuple[Slot, ...]
    study: StudyId | None
    dispatched: float
    steps: list[tuple[int, int]]  # (node, s): training step s -> s + 1 on node
    nominal: list[float]  # seconds of each step alone on the batch's slots
    marks: list[int]  # indexes of the steps whose end is an eval, a save or the batch's end
    reports: bool  # whether its steps report to the round (its study's policies learn)
    started: float | None = None  # when its worker took it (None: waiting on a busy slot)
    t: float = 0.0  # the time ``frac`` of step ``pos`` was done at
    pos: int = 0
    frac: float = 0.0
    slow: float = 1.0
    gen: int = 0
    stop_after: int | None = None
    last_ckpt_t: float = 0.0
    snapshots: bool = False  # it keeps a snapshot of every step it trains (one pack at its end)
    done: bool = False

    def progress(self) -> dict[tuple[int, int], int]:
        """Per (node, stage start): the step reached on that stage."""
        out: dict[tuple[int, int], int] = {}
        left = self.pos
        for st in self.batch.stages:
            done = min(left, st.end - st.start)
            left -= done
            out[(st.node, st.start)] = st.start + done
        return out


class Simulator:
    def __init__(
        self,
        driver: Driver,
        workers: int | Sequence[Slot],
        policy: str = "critical_path",
        step_time: StepTime = unit_step_time,
        curve: Curve | None = None,
        load_s: float = 0.0,
        save_s: float = 0.0,
        eval_s: float = 0.0,
        decision_cost: StageCost | None = None,
        *,
        workload: Workload | None = None,
        policies: Mapping[str, StudyPolicies] | None = None,
        owners: Mapping[str, str] | None = None,
        lookahead_s: float = 0.0,
        contention: Contention | None = None,
        host_capacity: Mapping[str, float] | None = None,
        faults: Sequence[Fault] = (),
        decision_scale: Callable[[str, int], float] | None = None,
        boundaries: bool = True,
        snapshots: bool = False,
        snapshot_probation_roots: int = 0,
        peripheral_every_s: float = 0.0,
        round_interval_s: float = 5.0,
        round_delay_s: float = 0.01,
        record_steps: bool = False,
        on_step: Callable[[Config, int, float], None] | None = None,
        stop_when: Callable[[], bool] | None = None,
    ) -> None:
        self.driver = driver
        self.slots: list[Slot] = [Slot(f"w{i}") for i in range(workers)] if isinstance(workers, int) else list(workers)
        if not self.slots:
            raise InvalidArgument("a simulation needs at least one slot")
        self.workers = len(self.slots)
        self.gpu_type = self.slots[0].gpu_type  # what the oracle cost and the accounting time steps on
        self.policy = policy
        self.workload: Workload = workload or SimpleWorkload(step_time, curve or synthetic_curve())
        self.load_s, self.save_s, self.eval_s = load_s, save_s, eval_s
        # what the round believes a stage costs on one slot: by default the truth (an oracle); a platform
        # that does not know each step's cost is simulated by passing its estimate (e.g. steps_cost())
        self.decision_cost: StageCost = decision_cost or self._true_cost
        # believed time per step of a plan's batch on n slots over that on 1 (default: ideal, 1 / n)
        self.decision_scale = decision_scale or (lambda plan, n: 1.0 / n)
        self.policies: dict[StudyId, StudyPolicies] = {StudyId(k): v for k, v in (policies or {}).items()}
        self.owners: dict[StudyId, str] = {StudyId(k): v for k, v in (owners or {}).items()}
        self.settings = RoundSettings(policy, lookahead_s)
        self.contention = contention
        self.host_capacity = dict(host_capacity or {})
        self.faults = sorted(faults, key=lambda f: f.at)
        self.save_at_boundaries = boundaries
        self.snapshots = snapshots
        self.snapshot_probation_roots = snapshot_probation_roots
        self.peripheral_every_s = peripheral_every_s
        self.round_interval_s = round_interval_s
        self.round_delay_s = round_delay_s
        self._round_due = False
        self.record_steps = record_steps
        self.on_step = on_step
        self.stop_when = stop_when
        self.learning = any(p.stateful for p in self.policies.values())

        self.now = 0.0
        self.events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._batch_ids = itertools.count(1)
        self._node_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._plan_ids = itertools.count(1)
        self.plans: dict[str, _Plan] = {}
        self.by_id: dict[PlanId, _Plan] = {}
        self.running: dict[BatchId, _Run] = {}
        self.on_slot: dict[Slot, _Run] = {}  # the batch a slot runs
        self.queued: dict[Slot, _Run] = {}  # the batch waiting on a busy slot
        self.last_end: dict[Slot, Point] = {}  # where the slot's last batch ended (its worker holds that model)
        self.tags: dict[RequestId, Any] = {}
        self.arrival: dict[RequestId, float] = {}
        self.study_of: dict[RequestId, StudyId] = {}
        self.state = PolicyState()
        self.reports: dict[tuple[PlanId, int], list[Report]] = {}
        self.new_reports = 0
        self.step_done: dict[tuple[str, int, int], float] = {}  # (plan key, node, step) -> first trained
        self.executed: list[tuple[PlanId, int, int, int]] = []
        self.point_arrivals: list[tuple[_Plan, Point, float]] = []
        self.worker_seconds = 0.0
        self.rounds = 0
        self.served = 0
        self.requested_steps = 0
        self.report = SimReport(policy, self.workers, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        self._costs: dict[tuple[PlanId, int, int, int], float] = {}
        self.last_active = 0.0  # when the last batch ended or the last result came: the makespan
        self._works: dict[PlanId, tuple[tuple[Any, ...], PlanWork]] = {}
        self._wake: float | None = None
        self._tick_at = -math.inf
        self._stopped = False
        self._dirty = False

    # -- helpers -----------------------------------------------------------------------------

    def _push(self, t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, payload))

    def _true_cost(self, stage: Stage) -> float:
        key = (stage.plan, stage.node, stage.start, stage.end)
        got = self._costs.get(key)
        if got is None:
            cfg = self.by_id[stage.plan].plan.nodes[stage.node].config
            step_s = self.workload.step_s
            got = self._costs[key] = sum(step_s(cfg, s, 1, self.gpu_type) for s in range(stage.start, stage.end))
        return got

    def _plan(self, key: str) -> _Plan:
        p = self.plans.get(key)
        if p is None:
            pid = PlanId(next(self._plan_ids))
            sp = SearchPlan(key, node_ids=self._node_ids, request_ids=self._request_ids)
            p = self.plans[key] = self.by_id[pid] = _Plan(pid, key, sp)
        return p

    def _submit(self, asks: Sequence[Ask]) -> bool:
        for ask in asks:
            if ask.at > self.now:
                self._push(ask.at, "submit", ask)
                continue
            p = self._plan(ask.plan)
            res = p.plan.add_request(ask.config, ask.step, study=ask.study)
            self.requested_steps += ask.step
            self.point_arrivals.append((p, res.point, self.now))
            if res.metrics is not None:
                self.served += 1
                self._push(self.now, "result", (ask.tag, ask.step, dict(res.metrics)))
            else:
                assert res.request is not None
                rid = RequestId(res.request.id)
                self.tags[rid] = ask.tag
                self.arrival[rid] = self.now
                self.study_of[rid] = StudyId(ask.study)
        return any(ask.at <= self.now for ask in asks)

    # -- main loop ---------------------------------------------------------------------------

    def run(self, max_events: int = 10_000_000) -> SimReport:
        self._submit(self.driver.start())
        for f in self.faults:
            self._push(f.at, "fault", f)
        self._round()
        n = 0
        while self.events and n < max_events and not self._stopped:
            t, _, kind, payload = self.events[0]
            if kind == "step" and self._stale(payload):  # a pace change rescheduled it: the clock stays
                heapq.heappop(self.events)
                continue
            self.now = max(self.now, t)
            changed = False
            while self.events and self.events[0][0] <= self.now:
                _, _, kind, payload = heapq.heappop(self.events)
                n += 1
                changed |= self._handle(kind, payload)
            changed |= self._dirty
            self._dirty = False
            if self.stop_when is not None and self.stop_when():
                break
            if changed and self.round_delay_s > 0:
                if not self._round_due:
                    self._round_due = True
                    self._push(self.now + self.round_delay_s, "due")
            elif changed:
                self._round()
        return self._report()

    def _stale(self, payload: tuple[BatchId, int]) -> bool:
        run = self.running.get(payload[0])
        return run is None or run.gen != payload[1]

    def _handle(self, kind: str, payload: Any) -> bool:
        if kind == "step":
            bid, gen = payload
            run = self.running.get(bid)
            if run is not None and run.gen == gen:
                self._advance(run, self.now)
                self._schedule(run)
            return False
        if kind == "free":
            return self._free(payload)
        if kind == "ckpt":
            plan, p = payload
            plan.plan.record_checkpoint(Checkpoint(p, f"sim://{plan.id}/{p.node}/{p.step}", 1))
            return True
        if kind == "metrics":
            plan, p = payload
            metrics = self.workload.metrics(plan.plan.nodes[p.node].config, p.step)
            changed = False
            self.last_active = self.now
            for req in plan.plan.record_metrics(p, metrics):
                self.served += 1
                tag = self.tags.pop(RequestId(req.id))
                self.report.served_at[tag] = self.now
                changed |= self._submit(self.driver.on_result(tag, p.step, metrics))
            return changed
        if kind == "result":
            self.last_active = self.now
            tag, step, metrics = payload
            self.report.served_at[tag] = self.now
            return self._submit(self.driver.on_result(tag, step, metrics))
        if kind == "round":
            if self._wake is not None and payload == self._wake:
                self._wake = None
            return True
        if kind == "due":
            self._round_due = False
            self._round()
            return False
        if kind == "submit":
            return self._submit([payload])
        if kind == "tick":
            if self.new_reports > 0:
                return True
            self._next_tick()
            return False
        if kind == "fault":
            return self._fault(payload)
        raise AssertionError(kind)

    # -- the round ---------------------------------------------------------------------------

    def _round(self) -> None:
        for run in list(self.running.values()):
            if run.started is not None and not run.done:
                self._advance(run, self.now)
        self.rounds += 1
        self.new_reports = 0
        dec = ROUND(self._input())
        self.state = dec.state
        self._apply(dec)
        self._next_tick()

    def _next_tick(self) -> None:
        """The master's rounds at least every ``round_interval_s``: they matter while running batches
        report to policies that learn from them."""
        if self.learning and self.round_interval_s > 0 and self.running:
            nxt = (math.floor(self.now / self.round_interval_s) + 1) * self.round_interval_s
            if nxt > self._tick_at:
                self._tick_at = nxt
                self._push(nxt, "tick")

    def _input(self) -> RoundInput:
        inflight_by_plan: dict[PlanId, list[InflightBatch]] = {}
        running: list[RunningAttempt] = []
        for run in self.running.values():  # a batch that stopped holds its slots until its end is reported
            prog = run.progress() if run.started is not None else {}
            stages = tuple(
                InflightStage(st.node, st.start, st.end, prog.get((st.node, st.start), st.start))
                for st in run.batch.stages
            )
            inflight_by_plan.setdefault(run.plan.id, []).append(
                InflightBatch(run.id, stages, frozenset(run.batch.saves), run.snapshots)
            )
            running.append(
                RunningAttempt(
                    run.id,
                    1,
                    run.plan.id,
                    run.slots,
                    tuple((st.node, st.start, st.end) for st in run.batch.stages),
                    run.study,
                    run.dispatched,
                    run.batch.source if run.batch.source.step > 0 else None,
                )
            )
        requests: dict[RequestId, StudyId] = {}
        works: list[PlanWork] = []
        for p in self.plans.values():
            pending = [(RequestId(r.id), r.point) for r in p.plan.pending()]
            if not pending:
                continue
            for rid, _ in pending:
                requests[rid] = self.study_of[rid]
            inflight = inflight_by_plan.get(p.id, ())
            # what the plan's work depends on: the same as the last round's, the same work (a forest is
            # never changed by a round)
            key = (tuple(rid for rid, _ in pending), len(p.plan.checkpoints), len(p.plan.nodes), tuple(inflight))
            kept = self._works.get(p.id)
            if kept is not None and kept[0] == key:
                works.append(kept[1])
                continue
            forest = build_stage_tree(p.plan.nodes, p.plan.checkpoint_steps(), pending, inflight, plan=p.id)
            studies = {self.study_of[rid] for rid, _ in pending}
            asked = max((self.policies[s].slots for s in studies if s in self.policies), default=1)
            scale = self.decision_scale(p.key, asked)
            cost = [self.decision_cost(st) * scale for st in forest.stages]
            step_scale = {k: self.decision_scale(p.key, k) for k in gpu_widths(asked)} if asked > 1 else {}
            bounds = plan_boundaries(p.plan, p.boundaries) if self.save_at_boundaries else ()
            work = PlanWork(p.id, forest, cost, asked, asked, step_scale, bounds)
            self._works[p.id] = (key, work)
            works.append(work)
        busy: list[BusySlot] = []
        free: list[Slot] = []
        for s in self.slots:
            holder = self.on_slot.get(s)
            if holder is None:
                free.append(s)
                continue
            run = holder
            ends = None
            if (
                s not in self.queued
                and len(run.slots) == 1
                and run.started is not None
                and run.stop_after is None
                and not run.done
            ):
                ends = run.started + sum(self.decision_cost(st) for st in run.batch.stages)
            busy.append(BusySlot(s, ends))
        return RoundInput(
            now=self.now,
            plans=works,
            requests=requests,
            free=free,
            busy=busy,
            running=running,
            policies=self.policies,
            owners=self.owners,
            arrivals=self.arrival,
            state=self.state,
            reports=self.reports,
            settings=self.settings,
        )

    def _apply(self, dec: RoundDecision) -> None:
        for k in dec.kills:
            self._kill(k.study, k.job)
            self.state.pending_kills.pop(str(k.job), None)
        for bid in dec.preempts:
            run = self.running.get(bid)
            if run is not None:
                self._preempt(run)
            self.state.pending_preempts.discard(bid)
        for d in dec.dispatches:
            self._dispatch(d)
        for plan_id, reason in dec.unplaceable.items():
            plan = self.by_id[plan_id]
            for r in plan.plan.pending():
                if plan.plan.fail(r.id):
                    self.report.failed[self.tags.pop(RequestId(r.id))] = reason
        for p in dec.evictions:
            for plan in self.plans.values():
                if p.node in plan.plan.nodes:
                    plan.plan.drop_checkpoint(p)
        if dec.wake_at is not None and dec.wake_at > self.now and (self._wake is None or dec.wake_at < self._wake):
            self._wake = dec.wake_at
            self._push(dec.wake_at, "round", dec.wake_at)

    # -- batches -----------------------------------------------------------------------------

    def _dispatch(self, d: Dispatch) -> None:
        b = d.batch
        plan = self.by_id[b.plan]
        bid = BatchId(next(self._batch_ids))
        steps: list[tuple[int, int]] = []
        nominal: list[float] = []
        marks: list[int] = []
        n = len(d.slots)
        gpu_type = d.slots[0].gpu_type
        for st in b.stages:
            cfg = plan.plan.nodes[st.node].config
            for s in range(st.start, st.end):
                steps.append((st.node, s))
                nominal.append(self.workload.step_s(cfg, s, n, gpu_type))
                end = Point(st.node, s + 1)
                if end in b.evals or end in b.saves:
                    marks.append(len(steps) - 1)
        if not steps or marks[-1:] != [len(steps) - 1]:
            marks.append(len(steps) - 1)
        reports = d.study is not None and d.study in self.policies and self.policies[d.study].stateful
        snapshots = self.snapshots and batch_keeps_snapshots(plan.plan, d.slots, self.snapshot_probation_roots)
        run = _Run(bid, plan, b, d.slots, d.study, self.now, steps, nominal, marks, reports, snapshots=snapshots)
        self.running[bid] = run
        plan.plan.mark_scheduled(b.requests, bid)
        if d.ahead:
            self.report.dispatched_ahead += 1
        busy = [slot for slot in d.slots if slot in self.on_slot]
        if busy:
            for slot in busy:
                self.queued[slot] = run
            for slot in d.slots:
                self.on_slot.setdefault(slot, run)
            return
        self._start(run)

    def _start(self, run: _Run) -> None:
        for s in run.slots:
            self.on_slot[s] = run
            self.queued.pop(s, None)
        warm = all(self.last_end.get(s) == run.batch.source for s in run.slots)
        source = run.batch.source
        load = 0.0 if warm or source.step == 0 else self.load_s
        if not run.steps:  # evaluate a saved (or fresh) model: load it, evaluate, done
            run.started = self.now
            t = self.now + load + self.eval_s
            if source in run.batch.evals:
                self._push(t, "metrics", (run.plan, source))
            run.done = True
            run.t = t
            self._push(t, "free", run.id)
            return
        run.started = self.now
        run.t = self.now + load
        run.last_ckpt_t = run.t
        self._recontend(run.slots[0])
        self._schedule(run)

    def _schedule(self, run: _Run) -> None:
        """Push the event of the run's next marked step (or its stop), at the current pace."""
        if run.done or run.pos >= len(run.steps):
            return
        target = run.stop_after if run.stop_after is not None else None
        i = bisect.bisect_left(run.marks, run.pos)
        nxt = run.marks[i] if i < len(run.marks) else len(run.steps) - 1
        if target is not None:
            nxt = min(nxt, target - 1)
        t = run.t + (1.0 - run.frac) * run.nominal[run.pos] * run.slow
        for k in range(run.pos + 1, nxt + 1):
            t += run.nominal[k] * run.slow
        run.gen += 1
        self._push(t, "step", (run.id, run.gen))

    def _advance(self, run: _Run, until: float) -> None:
        """Train the run's steps that end by ``until`` (their metrics, checkpoints and reports), and the
        part of the step in flight."""
        if run.started is None or run.done:
            return
        cfg_of = run.plan.plan.nodes
        while run.pos < len(run.steps) and not run.done:
            if run.t > until:
                return
            c = run.nominal[run.pos] * run.slow
            end_t = run.t + (1.0 - run.frac) * c
            if end_t > until + 1e-9:
                if c > 0:
                    run.frac += (until - run.t) / c
                run.t = until
                return
            node, s = run.steps[run.pos]
            run.pos += 1
            run.t, run.frac = end_t, 0.0
            self._stepped(run, node, s + 1, cfg_of[node].config)
            p = Point(node, s + 1)
            last = run.pos == len(run.steps)
            if p in run.batch.evals:
                run.t += self.eval_s
                self._at(run.t, "metrics", (run.plan, p))
            if p in run.batch.saves or (
                self.peripheral_every_s > 0 and not last and run.t - run.last_ckpt_t >= self.peripheral_every_s
            ):
                self._at(run.t + self.save_s, "ckpt", (run.plan, p))
                run.last_ckpt_t = run.t
            if run.stop_after is not None and run.pos >= run.stop_after and not last:
                self._end(run, run.t + self.save_s, save=p)
                return
            if last:
                self._end(run, run.t)
                return

    def _stepped(self, run: _Run, node: int, step: int, config: Config) -> None:
        t = run.t
        if self.record_steps:
            self.step_done.setdefault((run.plan.key, node, step), t)
        if self.on_step is not None:
            self.on_step(config, step, t)
        if run.reports:
            self.reports.setdefault((run.plan.id, node), []).append(
                Report(step, t, self.workload.metrics(config, step))
            )
            self.new_reports += 1

    def _at(self, t: float, kind: str, payload: Any) -> None:
        """An event at ``t``; a checkpoint already saved by then (found by a late advance, or saved at
        once) is recorded now, and the next round sees it."""
        if t <= self.now and kind == "ckpt":
            plan, p = payload
            plan.plan.record_checkpoint(Checkpoint(p, f"sim://{plan.id}/{p.node}/{p.step}", 1))
            self._dirty = True
            return
        self._push(max(t, self.now), kind, payload)

    def _end(self, run: _Run, free_at: float, save: Point | None = None) -> None:
        """The run stops training; its slots free at ``free_at`` (after a preemption's save). With
        ``run.snapshots`` every step it trained is a checkpoint by then (one pack, written as it ends)."""
        run.done = True
        run.gen += 1
        if save is not None:
            self._at(free_at, "ckpt", (run.plan, save))
        if run.snapshots:
            for node, s in run.steps[: run.pos]:
                self._at(free_at, "ckpt", (run.plan, Point(node, s + 1)))
        if run.pos:
            self._record_executed(run)
        self._push(free_at, "free", run.id)

    def _record_executed(self, run: _Run) -> None:
        by_node: dict[int, list[int]] = {}
        for node, s in run.steps[: run.pos]:
            by_node.setdefault(node, []).append(s)
        for node, ss in by_node.items():
            self.executed.append((run.plan.id, node, min(ss), max(ss) + 1))

    def _free(self, bid: BatchId) -> bool:
        run = self.running.pop(bid, None)
        if run is None:
            return False
        self.last_active = self.now
        started = run.started if run.started is not None else self.now
        self.worker_seconds += (self.now - started) * len(run.slots)
        run.plan.plan.requeue_batch(run.id)  # anything it could not serve goes back
        nxt: list[_Run] = []
        for s in run.slots:
            if self.on_slot.get(s) is run:
                del self.on_slot[s]
            if run.pos == len(run.steps):
                self.last_end[s] = run.batch.end if run.steps else run.batch.source
            else:
                self.last_end.pop(s, None)
            q = self.queued.get(s)
            if q is not None and q not in nxt:
                nxt.append(q)
        for q in nxt:
            if all(self.on_slot.get(s) in (None, q) for s in q.slots):
                self._start(q)
        if run.slots:
            self._recontend(run.slots[0])
        return True

    def _preempt(self, run: _Run) -> None:
        self.report.preemptions += 1
        if run.started is None:  # still waiting on its slot: it never ran
            self._unqueue(run)
            return
        if run.done:
            return
        self._advance(run, self.now)
        if run.done:
            return
        run.stop_after = run.pos + (1 if run.frac > 0 else 0)
        if run.stop_after == run.pos:
            if run.pos == 0:
                self._end(run, self.now)
            else:
                node, s = run.steps[run.pos - 1]
                self._end(run, self.now + self.save_s, save=Point(node, s + 1))
            return
        self._schedule(run)

    def _unqueue(self, run: _Run) -> None:
        run.done = True
        self.running.pop(run.id, None)
        run.plan.plan.requeue_batch(run.id)
        for s in run.slots:
            if self.queued.get(s) is run:
                del self.queued[s]
            if self.on_slot.get(s) is run:
                del self.on_slot[s]

    def _abort(self, run: _Run) -> None:
        if run.started is None:
            self._unqueue(run)
            return
        self._advance(run, self.now)
        if not run.done:
            self._end(run, self.now)

    def _kill(self, study: str, job: JobKey) -> None:
        plan = self.by_id[job.plan]
        p = Point(job.node, job.step)
        for rid in list(plan.plan.by_point.get(p, [])):
            req = plan.plan.requests[rid]
            if req.study != study:
                continue
            res = plan.plan.cancel(rid)
            self.report.cancelled.append(self.tags.pop(RequestId(rid)))
            if res.abort_batch is not None:
                run = self.running.get(BatchId(res.abort_batch))
                if run is not None:
                    self._abort(run)

    def _recontend(self, slot: Slot) -> None:
        """Set the pace of every batch on ``slot``'s node manager from who shares its device and the node
        manager now."""
        if self.contention is None:
            return
        host = slot.node_manager
        by_device: dict[str, tuple[Slot, list[_Run]]] = {}
        for s, r in self.on_slot.items():
            if s.node_manager != host or r.started is None or r.done:
                continue
            _, runs = by_device.setdefault(s.device, (s, []))
            if r not in runs:
                runs.append(r)
        load = sum(self.contention.load(self._config(r)) for _, runs in by_device.values() for r in runs)
        cap = self.host_capacity.get(host, 0.0)
        for device, runs in by_device.values():
            slows = self.contention.slowdowns(device, [self._config(r) for r in runs], load / cap if cap else 0.0)
            for r, slow in zip(runs, slows, strict=True):
                if abs(r.slow - slow) > 1e-12:
                    self._advance(r, self.now)
                    if r.done:
                        continue
                    r.slow = slow
                    self._schedule(r)

    def _config(self, run: _Run) -> Config:
        node = run.steps[min(run.pos, len(run.steps) - 1)][0] if run.steps else run.batch.source.node
        return run.plan.plan.nodes[node].config

    def _fault(self, f: Fault) -> bool:
        if f.kind == "add":
            self.slots.extend(s for s in f.slots if s not in self.slots)
            return True
        hit = {id(r): r for s in f.slots for r in (self.on_slot.get(s), self.queued.get(s)) if r is not None}
        for run in hit.values():
            if run.started is None:
                self._unqueue(run)
                continue
            self._advance(run, self.now)
            if not run.done:
                run.stop_after = run.pos
                self._end(run, self.now)
                self.report.lost_batches += 1
        if f.kind == "lose":
            gone = set(f.slots)
            self.slots = [s for s in self.slots if s not in gone]
        return True

    # -- accounting --------------------------------------------------------------------------

    def _unique(self) -> tuple[int, float, float]:
        """Unique trained steps over all requested points, the critical path and a lower bound.

        Each unique step ("cell") is released no earlier than the first request that needs it
        arrived, nor before the cell before it on its path can have finished. For any schedule with
        these arrivals and W workers, makespan >= tau + (work released at or after tau) / W for every
        tau; the bound is the largest such value (it includes work / W at tau = 0). The critical path
        is the latest finish of a requested point when every cell starts at its release.
        """
        first_need: dict[tuple[PlanId, int, int], float] = {}
        ends: list[tuple[_Plan, Point, float]] = []
        for plan, p, arrived in self.point_arrivals:
            for node, a, b in plan.plan.path(p):
                for s in range(a, b):
                    key = (plan.id, node, s)
                    if arrived < first_need.get(key, math.inf):
                        first_need[key] = arrived
            ends.append((plan, p, arrived))
        finish: dict[tuple[PlanId, int, int], float] = {}
        released: list[tuple[float, float]] = []
        for pid, node, s in sorted(first_need):
            n = self.by_id[pid].plan.nodes[node]
            if s > n.start:
                pred: tuple[PlanId, int, int] | None = (pid, node, s - 1)
            elif n.parent is not None:
                pred = (pid, n.parent, s - 1)
            else:
                pred = None
            ready = first_need[(pid, node, s)]
            if pred is not None:
                ready = max(ready, finish[pred])
            cost = self.workload.step_s(n.config, s, 1, self.gpu_type)
            finish[(pid, node, s)] = ready + cost
            released.append((ready, cost))
        crit = 0.0
        for plan, p, arrived in ends:
            if p.step == 0:
                continue
            n = plan.plan.nodes[p.node]
            last = (plan.id, p.node, p.step - 1) if p.step > n.start else (plan.id, n.parent or p.node, p.step - 1)
            crit = max(crit, finish.get(last, arrived))
        released.sort(reverse=True)
        bound = 0.0
        tail_work = 0.0
        for ready, cost in released:
            tail_work += cost
            bound = max(bound, ready + tail_work / self.workers)
        return len(first_need), crit, max(bound, crit)

    def _duplicates(self) -> int:
        by_node: dict[tuple[PlanId, int], list[tuple[int, int]]] = {}
        for pid, node, a, b in self.executed:
            by_node.setdefault((pid, node), []).append((a, b))
        dup = 0
        for ranges in by_node.values():
            ranges.sort()
            reach = -1
            for a, b in ranges:
                if a < reach:
                    dup += min(b, reach) - a
                reach = max(reach, b)
        return dup

    def _report(self) -> SimReport:
        unique, crit, bound = self._unique()
        executed = sum(b - a for _, _, a, b in self.executed)
        work = 0.0
        for pid, node, a, b in self.executed:
            cfg = self.by_id[pid].plan.nodes[node].config
            work += sum(self.workload.step_s(cfg, s, 1, self.gpu_type) for s in range(a, b))
        if self.stop_when is None or not self.stop_when():
            live = sum(1 for p in self.plans.values() for r in p.plan.requests.values() if r.state in _LIVE)
            if live:
                raise AssertionError(f"{live} requests were never served")
        rep = self.report
        rep.makespan = self.last_active
        rep.worker_seconds = self.worker_seconds
        rep.executed_steps = executed
        rep.unique_steps = unique
        rep.requested_steps = self.requested_steps
        rep.requests = len(self.point_arrivals)
        rep.served = self.served
        rep.rounds = self.rounds
        rep.duplicate_steps = self._duplicates()
        rep.critical_path = crit
        rep.work = work
        rep.lower_bound = bound
        return rep


_LIVE = (RequestState.NOT_SCHED, RequestState.SCHED)


def synthetic_curve(seed: int = 0) -> Curve:
    """A loss curve per config: decays toward a config-specific floor; deterministic in (config, step)."""
    import random

    def curve(config: Config, step: int) -> float:
        rng = random.Random(f"{seed}:{config.digest()}")
        floor = rng.uniform(0.05, 0.6)
        rate = rng.uniform(0.01, 0.08)
        return floor + (1.0 - floor) * math.exp(-rate * step)

    return curve


def simulate(driver: Driver, workers: int | Sequence[Slot], policy: str = "critical_path", **kwargs: Any) -> SimReport:
    return Simulator(driver, workers, policy, **kwargs).run()
