"""Reading a scheduling round's input: the database's state as the ``RoundInput`` that ``plan_round`` takes.

``InputReader.read`` turns one ``store.rounds.round_reads`` (and, where the round needs them, the
checkpoints on the pending work's paths, the policies' reports and the checkpoint catalog) into plain
data: each plan's stage forest with its stage costs (``master.costs``) and the slots its batches take,
the free slots of live node managers, the busy ones with when their batch should end (the lookahead),
the running attempts parsed once, the studies' policies and their state (``master.policies``), the
reports recorded since the policies last learnt. What it keeps between rounds is for reading only
(parsed specs, when a batch was first seen alone on its slot, plans whose rows do not load); every
decision is the round's.

A batch's end is its start plus its stages' estimated cost; its start is when its worker said it started
(``batch_started``, which carries the node manager's time) or, until that is heard, when a round first
saw it alone on its slot (its dispatch, or the end of the one before it). A slot holding its next batch
already, or held by a batch on several slots, has no end to offer.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stagetree.core.batch import Point
from stagetree.core.config import FixedPart
from stagetree.core.errors import StagetreeError
from stagetree.core.ids import BatchId, PlanId, RequestId, StudyId
from stagetree.core.policies.genie import widths as gpu_widths
from stagetree.core.policies.study import StudyPolicies
from stagetree.core.round import (
    BusySlot,
    CheckpointBudget,
    Dispatch,
    PlanWork,
    Report,
    RoundInput,
    RoundSettings,
    RunningAttempt,
)
from stagetree.core.round.learn import job_of
from stagetree.core.scheduler import StageCost
from stagetree.core.searchplan import Checkpoint, CheckpointKind, Node, SearchPlan
from stagetree.core.slots import Slot
from stagetree.core.stagetree import InflightBatch, InflightStage, Stage, build_stage_tree
from stagetree.master.costs import CostLearner
from stagetree.master.plans import PlanCache
from stagetree.master.policies import PolicyStates
from stagetree.master.settings import SchedulingSettings
from stagetree.master.store.nodes import ALIVE
from stagetree.master.store.records import BatchRecord, NodeManagerRecord, RoundReads
from stagetree.master.store.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundRead:
    """One round's input and what carrying out its decision needs of the read: the checkpoint uri of each
    point per plan, the pending requests per plan (to fail a plan's waiting work), their count."""

    input: RoundInput
    reads: RoundReads
    uris: dict[PlanId, dict[Point, str]] = field(default_factory=dict)
    pending: int = 0
    snapshot_ms: float = 0.0


def inflight_of(spec_json: str) -> InflightBatch:
    """A running batch as the stage tree sees it: the checkpoints its spec asks it to save, and, with a
    snapshot budget, a snapshot of every step of its stages (written as one pack when it ends; a worker
    that keeps none, such as a trainer that saves by itself, leaves work that waited for them to start
    from the checkpoint before once the batch ends)."""
    spec = json.loads(spec_json)
    stages = tuple(InflightStage(s["node"], s["start"], s["end"], s["start"]) for s in spec["stages"])
    saves = frozenset(Point(a, b) for a, b in spec.get("saves", []))
    return InflightBatch(int(spec["batch_id"]), stages, saves, int(spec.get("snapshot_budget_bytes", 0)) > 0)


def source_of(spec_json: str) -> Point | None:
    """The checkpoint a dispatched batch loads (None for a fresh model)."""
    src = json.loads(spec_json).get("source") or {}
    if not src.get("uri"):
        return None
    return Point(int(src["node"]), int(src["step"]))


def path_nodes(plan: SearchPlan, reqs: Sequence[tuple[int, Point]]) -> set[int]:
    """The nodes on the paths from the roots to the requests' nodes: where the checkpoints a round can
    start them from lie. Each node is walked once (paths share their prefixes)."""
    out: set[int] = set()
    for _, p in reqs:
        n: int | None = p.node
        while n is not None and n not in out:
            out.add(n)
            n = plan.nodes[n].parent
    return out


class InputReader:
    def __init__(self, store: Store, plans: PlanCache, costs: CostLearner, policies: PolicyStates) -> None:
        self.store = store
        self.plans = plans
        self.costs = costs
        self.policies = policies
        self._costs_read_at = float("-inf")
        self._bad_specs: set[int] = set()
        self._bad_plans: set[int] = set()
        self._good_plans: set[int] = set()  # plans whose fixed part was checked (a plan's rows never change)
        self._out_of_memory: tuple[int, float | None] | None = None  # RoundReads.out_of_memory at the last look
        self._inflight: dict[tuple[int, int], InflightBatch] = {}  # (batch, attempt) -> its parsed spec
        self._running: dict[tuple[int, int], RunningAttempt] = {}
        # (node manager, slot) -> (plan, point) where the last batch sent to it ends: once the slot is free,
        # its worker may hold that trainer in memory (a hint: a failed batch's worker is gone, and the
        # node manager decides)
        self._warm: dict[tuple[str, str], tuple[PlanId, Point]] = {}
        # (batch, attempt) -> (its stages, when a round first saw it alone on its slot or None)
        self._alone: dict[tuple[int, int], tuple[tuple[InflightStage, ...], float | None]] = {}

    # -- the round's input -----------------------------------------------------------------------

    def read(self, settings: SchedulingSettings, reads: RoundReads | None = None) -> RoundRead:
        """The round's input from ``reads`` (read now when not given). The stage forests are only built
        when the round may do something with them: a slot is free or about to free, a study's policies
        learn, or the checkpoints are over their budget."""
        t0 = time.perf_counter()
        store = self.store
        reads = store.rounds.round_reads() if reads is None else reads
        now = time.time()
        nms = [n for n in reads.node_managers if n.state == ALIVE]
        free = [s for n in nms for s in n.placed_slots() if (n.id, s.id) not in reads.busy]
        policies = self.policies.active(reads.policy_studies)
        self.policies.load(policies)
        learning = any(p.stateful for p in policies.values())
        if reads.out_of_memory != self._out_of_memory:  # an attempt ran out of memory since the last look
            self.costs.refresh_oom(store.batches)
            self._out_of_memory = reads.out_of_memory
        asked = self._asked(policies)
        every = free or [s for n in nms for s in n.placed_slots()]
        cost = self.stage_cost(every, asked, settings.cost_refresh_s) if reads.pending else None
        busy = self._busy(nms, reads, cost if settings.lookahead_s > 0 else None, now)
        soon = settings.lookahead_s > 0 and any(
            b.ends_at is not None and b.ends_at <= now + settings.lookahead_s for b in busy
        )
        budget = self._budget(settings)
        running = self._attempts(reads, nms)
        # the policies learn from the running trials' reports whether or not any work is pending: a POP
        # study whose trials all run (nothing waits) still kills its poor ones
        reports = self._reports(running, policies) if learning else {}
        base = RoundInput(
            now=now,
            plans=(),
            requests={},
            free=free,
            busy=busy,
            running=running,
            policies=policies,
            owners={StudyId(k): v for k, v in reads.owners.items()},
            state=self.policies.state,
            reports=reports,
            settings=RoundSettings(settings.policy, settings.lookahead_s),
            checkpoints=budget,
        )
        if not (free or soon or learning or budget is not None) or cost is None:
            return RoundRead(base, reads, {}, 0, (time.perf_counter() - t0) * 1000)
        work, uris, count = self._plans(reads, cost, asked, _gpu_type(every))
        # the reads' maps as they are, not copied: 10,000 pending requests cost milliseconds a copy
        requests = reads.studies
        arrivals = reads.arrivals if policies else {}
        inp = RoundInput(
            now=now,
            plans=work,
            requests=requests,
            free=free,
            busy=busy,
            running=running,
            policies=policies,
            owners=base.owners,
            arrivals=arrivals,
            state=self.policies.state,
            reports=reports,
            settings=base.settings,
            checkpoints=budget,
            warm=self._warm_free(free),
        )
        return RoundRead(inp, reads, uris, count, (time.perf_counter() - t0) * 1000)

    def _asked(self, policies: Mapping[StudyId, StudyPolicies]) -> dict[PlanId, int]:
        """The slots per batch the studies of each plan ask for (their policies' ``slots``), where above 1."""
        asked: dict[PlanId, int] = {}
        for sid, p in policies.items():
            if p.slots > 1:
                for pid in self.store.plans.study_plan_ids(sid):
                    asked[PlanId(pid)] = max(asked.get(PlanId(pid), 1), p.slots)
        return asked

    def _slots_of(self, plan: PlanId, asked: Mapping[PlanId, int]) -> int:
        """The slots a batch of the plan takes: what its studies ask, or twice what ran out of memory."""
        model = self.costs.model
        n = asked.get(plan, 1)
        if not model.any_ran_out_of_memory():
            return n
        return max(n, model.min_slots(self.store.plans.plan_fixed(plan)[0]))

    def _plans(
        self, reads: RoundReads, cost: StageCost, asked: Mapping[PlanId, int], gpu_type: str
    ) -> tuple[list[PlanWork], dict[PlanId, dict[Point, str]], int]:
        """Each plan's pending work (``PlanWork``), the checkpoint uris on its paths, and how many requests
        wait. A plan whose rows no longer load (written by another version, edited by hand) is left out,
        and said so once: it must not stop the rounds of every other study."""
        pending = reads.pending
        inflight = self._inflight_by_plan(reads)
        plans: dict[int, SearchPlan] = {}
        for plan_id, reqs in pending.items():
            if plan_id in self._bad_plans:
                continue
            try:
                plans[plan_id] = self.plans.ensure(plan_id, {p.node for _, p in reqs})
                if plan_id not in self._good_plans:  # its fixed part must load too: every dispatch renders it
                    FixedPart.from_json(json.loads(self.store.plans.plan_fixed(plan_id)[1]))
                    self._good_plans.add(plan_id)
            except (StagetreeError, ValueError, KeyError, TypeError):
                plans.pop(plan_id, None)
                self._bad_plans.add(plan_id)
                log.exception("plan left out of scheduling: its rows do not load", extra={"plan_id": plan_id})
        paths = {plan_id: path_nodes(plan, pending[plan_id]) for plan_id, plan in plans.items()}
        on_paths = self.store.rounds.path_checkpoints(
            sorted(n for nodes in paths.values() for n in nodes), sorted(plans)
        )
        width_scale = self.costs.width_scale(lambda pid: self.store.plans.plan_fixed(pid)[0], gpu_type)
        work: list[PlanWork] = []
        uris: dict[PlanId, dict[Point, str]] = {}
        count = 0
        for plan_id, plan in plans.items():
            pid = PlanId(plan_id)
            reqs = pending[plan_id]
            count += len(reqs)
            ckpts = uris.setdefault(pid, {})
            steps: dict[int, list[int]] = {}
            for n in paths[plan_id]:
                if n in on_paths:
                    ckpts.update(on_paths[n])
                    steps[n] = sorted(p.step for p in on_paths[n])
            typed = [(RequestId(r), p) for r, p in reqs]
            forest = build_stage_tree(plan.nodes, steps, typed, inflight.get(plan_id, ()), plan=pid)
            want = asked.get(pid, 1)
            slots = self._slots_of(pid, asked)
            scale = {k: width_scale(pid, k) for k in gpu_widths(want)} if want > 1 else {}
            unable = reads.host_problems.get(plan_id, {})
            work.append(PlanWork(pid, forest, [cost(st) for st in forest.stages], slots, want, scale, unable=unable))
        return work, uris, count

    def _inflight_by_plan(self, reads: RoundReads) -> dict[int, list[InflightBatch]]:
        """The running batches of the plans with pending work, each spec parsed once per attempt."""
        pending = reads.pending
        out: dict[int, list[InflightBatch]] = {}
        seen: dict[tuple[int, int], InflightBatch] = {}
        for b in reads.running:
            if b.plan_id not in pending:
                continue  # nothing waits in its plan: it cannot take new work
            key = (b.id, b.attempt)
            ib = self._inflight.get(key)
            if ib is None:
                try:
                    ib = inflight_of(b.spec_json)
                except (ValueError, KeyError, TypeError):
                    self._bad_spec(b.id)
                    continue
            seen[key] = ib
            out.setdefault(b.plan_id, []).append(ib)
        self._inflight = seen
        return out

    def _bad_spec(self, batch_id: int) -> None:
        if batch_id not in self._bad_specs:  # say it once; one bad row must not stop every round
            self._bad_specs.add(batch_id)
            log.error("running batch with an unreadable spec ignored", extra={"batch_id": batch_id})

    def _attempts(self, reads: RoundReads, nms: Sequence[NodeManagerRecord]) -> list[RunningAttempt]:
        """Every running attempt as the round sees it (built once per attempt)."""
        slots = {(n.id, s.id): s for n in nms for s in n.placed_slots()}
        kept: dict[tuple[int, int], RunningAttempt] = {}
        for b in reads.running:
            key = (b.id, b.attempt)
            ra = self._running.get(key)
            if ra is None:
                ra = self._attempt(b, reads, slots)
                if ra is None:
                    continue
            kept[key] = ra
        for key, ra in kept.items():
            if key not in self._running and len(ra.slots) == 1:  # a master that took over learns it here
                self._warm.setdefault((ra.slots[0].node_manager, ra.slots[0].id), (ra.plan, ra.end))
        self._running = kept
        return list(kept.values())

    def sent(self, dispatches: Sequence[Dispatch]) -> None:
        """What the slots will hold once the batches just sent end there (``_warm``)."""
        for d in dispatches:
            if len(d.slots) == 1:
                self._warm[(d.slot.node_manager, d.slot.id)] = (d.batch.plan, d.batch.end)

    def _warm_free(self, free: Sequence[Slot]) -> dict[tuple[PlanId, Point], Slot]:
        """``RoundInput.warm``: the free slots whose worker may hold a trainer, by where it ended."""
        out: dict[tuple[PlanId, Point], Slot] = {}
        for s in free:
            at = self._warm.get((s.node_manager, s.id))
            if at is not None:
                out.setdefault(at, s)
        return out

    def _attempt(
        self, b: BatchRecord, reads: RoundReads, slots: Mapping[tuple[str, str], Slot]
    ) -> RunningAttempt | None:
        try:
            spec = json.loads(b.spec_json)
            stages = tuple((int(s["node"]), int(s["start"]), int(s["end"])) for s in spec["stages"])
            source = source_of(b.spec_json)
        except (ValueError, KeyError, TypeError):
            self._bad_spec(b.id)
            return None
        nm = b.node_manager_id or ""
        held = tuple(slots.get((nm, sid)) or Slot(sid, nm) for sid in b.slot_ids if nm)
        study, dispatched = reads.served.get((b.id, b.attempt), (None, 0.0))
        return RunningAttempt(
            BatchId(b.id),
            b.attempt,
            PlanId(b.plan_id),
            held,
            stages,
            StudyId(study) if study is not None else None,
            dispatched,
            source,
        )

    def _busy(
        self, nms: Sequence[NodeManagerRecord], reads: RoundReads, cost: StageCost | None, now: float
    ) -> list[BusySlot]:
        """The busy slots of live node managers, with when their one batch should end (see the module
        docstring). Without ``cost`` (nothing pending) only who is alone on a slot is kept up to date."""
        per_slot: dict[tuple[str, str], list[BatchRecord]] = {}
        for b in reads.running:
            for slot in b.slot_ids:  # a batch on several slots holds each of them
                if b.node_manager_id:
                    per_slot.setdefault((b.node_manager_id, slot), []).append(b)
        seen: dict[tuple[int, int], tuple[tuple[InflightStage, ...], float | None]] = {}
        ends: dict[tuple[str, str], float] = {}
        for key, recs in per_slot.items():
            alone = len(recs) == 1 and len(recs[0].slot_ids) == 1
            for b in recs:
                k = (b.id, b.attempt)
                stages, since = self._alone.get(k) or ((), None)
                if not stages:
                    try:
                        stages = inflight_of(b.spec_json).stages
                    except (ValueError, KeyError, TypeError):
                        continue  # the forest says so once
                if since is None and alone:
                    since = now
                seen[k] = (stages, since)
                began = reads.started.get(k, since)
                if alone and began is not None and cost is not None:
                    plan = PlanId(b.plan_id)
                    ends[key] = began + sum(cost(Stage(0, plan, st.node, st.start, st.end)) for st in stages)
        self._alone = seen
        return [BusySlot(s, ends.get((n.id, s.id))) for n in nms for s in n.placed_slots() if (n.id, s.id) in per_slot]

    def stage_cost(
        self, slots: Sequence[Slot], asked: Mapping[PlanId, int] | None = None, refresh_s: float = 1.0
    ) -> StageCost:
        """The round's cost estimate (``master.costs``), learning from the batches that finished since
        the last read (at most once per ``refresh_s``); a stage at the slots its plan takes."""
        now = time.monotonic()
        if now - self._costs_read_at >= refresh_s:
            self._costs_read_at = now
            self.costs.refresh(self.store.batches)
        wide = bool(asked) or self.costs.model.any_ran_out_of_memory()
        need = asked or {}
        return self.costs.stage_cost(
            lambda plan_id: self.store.plans.plan_fixed(plan_id)[0],
            lambda plan_id, node: self.plans.ensure(plan_id, (node,)).nodes[node].config,
            _gpu_type(slots),
            (lambda plan: self._slots_of(plan, need)) if wide else None,
        )

    def _reports(
        self, running: Sequence[RunningAttempt], policies: Mapping[StudyId, StudyPolicies]
    ) -> dict[tuple[PlanId, int], list[Report]]:
        """The evaluations and learning-curve points recorded on the paths of the running batches of
        studies whose policies learn, since what the state has learnt from (at a step with both, the
        evaluation's values win), per (plan, node), oldest first."""
        state = self.policies.state
        nodes: dict[int, PlanId] = {}
        since = float("inf")
        for r in running:
            p = policies.get(r.study) if r.study is not None else None
            if p is None or not p.stateful:
                continue
            job = str(job_of(r))
            t = min(state.fed_at.get(job, 0.0), state.quantum_start.get(r.batch, r.dispatched_at))
            since = min(since, t)
            for n, _, _ in r.stages:
                nodes[n] = r.plan
        if not nodes:
            return {}
        ids = sorted(nodes)
        evals = self.store.requests.metrics_since(ids, since)
        seen = {(n, st) for n, st, _, _ in evals}
        rows = evals + [row for row in self.store.curves.points_since(ids, since) if (row[0], row[1]) not in seen]
        out: dict[tuple[PlanId, int], list[Report]] = {}
        for n, step, at, values in sorted(rows, key=lambda r: r[2]):
            out.setdefault((nodes[n], n), []).append(Report(step, at, values))
        return out

    def _budget(self, settings: SchedulingSettings) -> CheckpointBudget | None:
        """The checkpoint catalog when it holds more than the budget (None: no budget, or within it)."""
        budget = settings.checkpoint_budget_bytes
        if budget is None or self.store.checkpoints.checkpoint_bytes() <= budget:
            return None
        ckpts: dict[Point, Checkpoint] = {}
        nodes: dict[int, Node] = {}
        for plan_id, rows in self.store.checkpoints.checkpoint_records().items():
            plan = self.plans.ensure(plan_id, {p.node for p, *_ in rows})
            nodes.update(plan.nodes)
            for p, uri, nbytes, kind, used in rows:
                ckpts[p] = Checkpoint(p, uri, nbytes, CheckpointKind(kind), used)
        return CheckpointBudget(budget, ckpts, nodes, settings.default_step_seconds)


def _gpu_type(slots: Sequence[Slot]) -> str:
    return slots[0].gpu_type if slots else "cpu"
