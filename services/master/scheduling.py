"""The scheduling loop: event-driven rounds of the core scheduler over a snapshot of the database.

A round (``SchedulingLoop.run_round``) is: requeue the work of node managers whose heartbeat key
lapsed; snapshot the NOT_SCHED requests, checkpoints and running batches; build each plan's stage tree
and run ``core.scheduler.schedule_round`` on the free slots of live node managers; write each dispatch
(batch + attempt 1 + requests SCHED, in one transaction) and wake the node manager's assignment stream.
The core decides, this module carries the decisions out. Only the holder of the leader lease runs
rounds (``run``); a standby keeps trying to take the lease and takes over when it lapses. The studies'
policies keep soft state across rounds (``master.policies``): a round saves it before carrying out
anything it decided, and a master that takes the lease loads it again.

Requests that the stage tree attaches to an in-flight batch stay NOT_SCHED: amending a running batch
is not implemented yet, so they are served by a later round from the checkpoint that batch leaves.

**Lookahead** (``SchedulingSettings.lookahead_s``): after the free slots, a round also fills busy slots
whose one batch should end within ``lookahead_s`` (``soon_free``), soonest first. The node manager holds
such a batch until its slot frees and starts it at once, so the end's trip to the database, the next
round and the stream no longer leave the slot idle (``tests.bench.scale``'s assignment latency). A slot
holds at most one batch ahead; a batch's end is estimated from the learnt step costs, from its worker's
start (``batch_started``, which carries the node manager's time) or, until that is recorded, from when
a round first saw the batch alone on its slot. The loop wakes when the next busy slot comes within
``lookahead_s`` of its end. Off in rounds where a study chose policies (they reason about the slots
that are free now) or a plan's batches take several slots.

A plan's batches take several slots (``plan_slots``) when a study of it asks for them (its policies'
``slots``) or when the plan ran out of memory before (the cost model doubles them); a plan that needs
more slots than the largest node manager has cannot run, and its waiting requests fail saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from stagetree.core.batch import BatchSpec, CurveSampling, Point, Source, StageSpec
from stagetree.core.cache import choose_evictions, pinned_points, prefix_cost
from stagetree.core.config import FixedPart
from stagetree.core.errors import NotFound, ResourceExhausted, StagetreeError, Unavailable
from stagetree.core.policies.live import StudyPolicies
from stagetree.core.policies.state import Kill
from stagetree.core.scheduler import PlannedBatch, RoundResult, StageCost, schedule_round
from stagetree.core.searchplan import Checkpoint, CheckpointKind, Node, SearchPlan
from stagetree.core.slots import Slot
from stagetree.core.stagetree import InflightBatch, InflightStage, Stage, StageForest, build_stage_tree
from stagetree.master import metrics
from stagetree.master.checkpoint_files import CheckpointFiles, NodeManagersDeleteFiles
from stagetree.master.coordination import Coordination, Subscription
from stagetree.master.costs import CostLearner
from stagetree.master.plans import PlanCache
from stagetree.master.policies import PolicyStep
from stagetree.master.service import CH_RESULTS, CH_ROUND, ch_node_manager
from stagetree.master.settings import SchedulingSettings
from stagetree.master.store.nodes import ALIVE
from stagetree.master.store.records import BatchRecord, DispatchItem, NodeManagerRecord, RoundReads
from stagetree.master.store.store import Store

log = logging.getLogger(__name__)

# how often the loop's rounds look for lapsed heartbeats (200 node managers' liveness keys each round
# were a twentieth of a round on a busy cluster; tests.bench.scale)
LIVENESS_CHECK_S = 1.0
SLOW_ROUND_S = 1.0  # a round this long is logged with where its time went


@dataclass(frozen=True)
class RoundReport:
    pending: int
    dispatched: list[int]  # batch ids
    lost_node_managers: list[str]
    queued: int
    snapshot_ms: float
    decide_ms: float
    wake_at: float | None = None  # when a busy slot comes within lookahead of its end (time.time())


@dataclass(frozen=True)
class Decision:
    """What a round decided, before anything is written."""

    result: RoundResult
    uris: dict[int, dict[Point, str]]  # checkpoint uri per point, per plan
    pending: int
    snapshot_ms: float
    decide_ms: float
    forest: StageForest | None  # None when no slot was free (nothing was built)
    preempts: tuple[int, ...] = ()  # running batches the studies' policies preempt (master.policies)
    kills: tuple[Kill, ...] = ()  # trials the studies' search policies kill
    unplaceable: Mapping[int, str] = field(default_factory=dict)  # plan id -> why no node manager can run it
    ahead: frozenset[tuple[str, str]] = frozenset()  # (node manager, slot) of the busy slots offered (lookahead)
    wake_at: float | None = None  # when the next busy slot comes within lookahead of its end


def source_of(spec_json: str) -> Point | None:
    """The checkpoint a dispatched batch loads (None for a fresh model)."""
    src = json.loads(spec_json).get("source") or {}
    if not src.get("uri"):
        return None
    return Point(int(src["node"]), int(src["step"]))


def inflight_of(spec_json: str) -> InflightBatch:
    spec = json.loads(spec_json)
    stages = tuple(InflightStage(s["node"], s["start"], s["end"], s["start"]) for s in spec["stages"])
    return InflightBatch(int(spec["batch_id"]), stages, frozenset(Point(a, b) for a, b in spec.get("saves", [])))


class SchedulingLoop:
    def __init__(
        self,
        store: Store,
        plans: PlanCache,
        coordination: Coordination,
        settings: SchedulingSettings,
        instance_id: str,
        files: CheckpointFiles | None = None,
    ) -> None:
        self.store = store
        self.plans = plans
        self.coord = coordination
        self.settings = settings
        self.instance_id = instance_id
        self.files = files if files is not None else NodeManagersDeleteFiles()
        self.is_leader = False
        # when this instance started leading (construction, then each lease taken): see requeue_lost
        self.leader_since = time.time()
        self.policy_step = PolicyStep(store, settings.policy_state_save_s)
        self.costs = CostLearner(settings.default_step_seconds)
        self._costs_read_at = float("-inf")
        self._bad_specs: set[int] = set()
        self._inflight: dict[tuple[int, int], InflightBatch] = {}  # (batch, attempt) -> its parsed spec
        self._bad_plans: set[int] = set()
        self._round_thread: ThreadPoolExecutor | None = None  # run's own thread for the rounds
        self._fixed_parts: dict[int, tuple[str, FixedPart]] = {}  # plan -> (key, fixed part), see _fixed_part
        self._good_plans: set[int] = set()  # plans whose fixed part was checked (a plan's rows never change)
        # (batch, attempt) -> (its stages, when a round first saw it alone on its slot or None): see soon_free
        self._alone: dict[tuple[int, int], tuple[tuple[InflightStage, ...], float | None]] = {}

    # -- one round ------------------------------------------------------------------------------

    def requeue_lost(self, nms: Sequence[NodeManagerRecord] | None = None) -> list[str]:
        """Requeue the work of node managers whose heartbeat key lapsed. A master that just started
        leading (restarted, or a standby taking over) gives the node managers it has not heard from yet
        one heartbeat TTL to reconnect: while no master ran, their keys lapsed with nobody to renew them."""
        nms = [n for n in (self.store.nodes.node_managers() if nms is None else nms) if n.state == ALIVE]
        alive = self.coord.alive(n.id for n in nms)
        since = self.leader_since
        grace = time.time() < since + self.settings.heartbeat_ttl_s
        lost = [n.id for n in nms if n.id not in alive and not (grace and n.last_heartbeat <= since)]
        for nm in lost:
            batches = self.store.ledger.mark_lost(nm)
            log.warning("node manager lost; work requeued", extra={"node_manager_id": nm, "batches": batches})
        return lost

    def free_slots(
        self, nms: Sequence[NodeManagerRecord] | None = None, busy: set[tuple[str, str]] | None = None
    ) -> list[Slot]:
        nms = [n for n in (self.store.nodes.node_managers() if nms is None else nms) if n.state == ALIVE]
        busy = self.store.rounds.busy_slots() if busy is None else busy
        return [s for n in nms for s in n.placed_slots() if (n.id, s.id) not in busy]

    def soon_free(
        self,
        nms: Sequence[NodeManagerRecord],
        running: Sequence[BatchRecord],
        cost: StageCost | None,
        now: float,
        started: Mapping[tuple[int, int], float] | None = None,
    ) -> tuple[list[Slot], float | None]:
        """The busy slots of live node managers whose one batch should end by ``now + lookahead_s``,
        soonest first, and when the next other busy slot comes that close to its end (None: none will
        without a new batch). A slot already holding its next batch, or held by a batch on several slots,
        is not offered. A batch's end is its start plus its stages' estimated cost; its start is when its
        worker said it started (``started``: (batch, attempt) -> time) or, until that is heard, when a
        round first saw it alone on its slot (its dispatch, or the end of the one before it). Without
        ``cost`` only the latter is kept up to date, and nothing is offered."""
        per_slot: dict[tuple[str, str], list[BatchRecord]] = {}
        for b in running:
            for slot in (b.slot_id or "").split(","):  # a batch on several slots holds each of them
                if b.node_manager_id and slot:
                    per_slot.setdefault((b.node_manager_id, slot), []).append(b)
        seen: dict[tuple[int, int], tuple[tuple[InflightStage, ...], float | None]] = {}
        ends: dict[tuple[str, str], float] = {}
        for key, recs in per_slot.items():
            alone = len(recs) == 1 and "," not in (recs[0].slot_id or "")
            for b in recs:
                k = (b.id, b.attempt)
                stages, since = self._alone.get(k) or ((), None)
                if not stages:
                    try:
                        stages = inflight_of(b.spec_json).stages
                    except (ValueError, KeyError, TypeError):
                        continue  # snapshot says so once
                if since is None and alone:
                    since = now
                seen[k] = (stages, since)
                began = since if started is None else started.get(k, since)
                if alone and began is not None and cost is not None:
                    plan = str(b.plan_id)
                    ends[key] = began + sum(cost(Stage(0, plan, st.node, st.start, st.end)) for st in stages)
        self._alone = seen
        horizon = now + self.settings.lookahead_s
        wake_at = min((end - self.settings.lookahead_s for end in ends.values() if end > horizon), default=None)
        soon = {key: end for key, end in ends.items() if end <= horizon}
        slots = [s for n in nms if n.state == ALIVE for s in n.placed_slots() if (n.id, s.id) in soon]
        slots.sort(key=lambda s: soon[(s.node_manager, s.id)])
        return slots, wake_at

    def snapshot(self, reads: RoundReads | None = None) -> tuple[StageForest, dict[int, dict[Point, str]], int]:
        """The stage forest of every plan with NOT_SCHED requests (stage ``plan`` = plan id), from the
        round's ``reads`` (read now when not given)."""
        reads = self.store.rounds.round_reads() if reads is None else reads
        pending = reads.pending
        inflight: dict[int, list[InflightBatch]] = {}
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
                    if b.id not in self._bad_specs:  # say it once; one bad row must not stop every round
                        self._bad_specs.add(b.id)
                        log.error("running batch with an unreadable spec ignored", extra={"batch_id": b.id})
                    continue
            seen[key] = ib
            inflight.setdefault(b.plan_id, []).append(ib)
        self._inflight = seen  # parsed once per attempt, kept while it runs
        plans: dict[int, SearchPlan] = {}
        for plan_id, reqs in pending.items():
            if plan_id in self._bad_plans:
                continue
            try:
                plans[plan_id] = self.plans.ensure(plan_id, {p.node for _, p in reqs})
                if plan_id not in self._good_plans:  # its fixed part must load too: every dispatch renders it
                    self._fixed_part(plan_id)
                    self._good_plans.add(plan_id)
            except (StagetreeError, ValueError, KeyError, TypeError):
                # a plan whose rows no longer load (written by another version, edited by hand) must not
                # stop the rounds of every other study: leave it out, and say so once
                plans.pop(plan_id, None)
                self._bad_plans.add(plan_id)
                log.exception("plan left out of scheduling: its rows do not load", extra={"plan_id": plan_id})
        paths = {plan_id: path_nodes(plan, pending[plan_id]) for plan_id, plan in plans.items()}
        on_paths = self.store.rounds.path_checkpoints(
            sorted(n for nodes in paths.values() for n in nodes), sorted(plans)
        )
        forest = StageForest()
        uris: dict[int, dict[Point, str]] = {}
        count = 0
        for plan_id, plan in plans.items():
            reqs = pending[plan_id]
            count += len(reqs)
            ckpts = uris.setdefault(plan_id, {})
            steps: dict[int, list[int]] = {}
            for n in paths[plan_id]:
                if n in on_paths:
                    ckpts.update(on_paths[n])
                    steps[n] = sorted(p.step for p in on_paths[n])
            forest.extend(build_stage_tree(plan.nodes, steps, reqs, inflight.get(plan_id, ()), plan=str(plan_id)))
        return forest, uris, count

    def curve_samplings(self, batches: Sequence[PlannedBatch]) -> list[CurveSampling]:
        """Each batch's learning-curve sampling: the finest its requests' studies ask for
        (``CurveSampling.finest``; a study that set none gets the master's settings). One read for all."""
        default = CurveSampling(self.settings.curve_every_steps, self.settings.curve_max_per_s)
        wanted = [r for b in batches for r in b.requests]
        owners = self.store.requests.request_studies(wanted) if wanted else {}
        by_study: dict[str, CurveSampling] = {}
        for sid, _ in owners.values():
            if sid not in by_study:
                by_study[sid] = self._study_sampling(sid, default)
        out = []
        for b in batches:
            studies = {owners[r][0] for r in b.requests if r in owners}
            out.append(CurveSampling.finest(by_study[sid] for sid in sorted(studies)) if studies else default)
        return out

    def _study_sampling(self, study_id: str, default: CurveSampling) -> CurveSampling:
        try:
            rec = self.store.studies.get_study(study_id)
        except NotFound:  # deleted since: its requests go with it
            return default
        every = default.every_steps if rec.curve_every_steps is None else rec.curve_every_steps
        rate = default.max_per_s if rec.curve_max_per_s is None else rec.curve_max_per_s
        return CurveSampling(every, rate)

    def spec_of(
        self,
        batch: PlannedBatch,
        uris: dict[Point, str],
        curves: CurveSampling | None = None,
        slot_ids: Sequence[str] = (),
    ) -> Callable[[int, int], str]:
        """The renderer of ``batch``'s spec for ``store.dispatch``. Everything it needs (the plan's fixed
        part, its nodes) is read here, before the dispatch transaction opens: rendering inside it must
        take no lock, or a submission holding the plan cache's lock while it waits for the database
        write lock deadlocks with the round (seen on SQLite). ``curves``: its curve sampling (None: the
        master's settings)."""
        plan_id = int(batch.plan)
        key, fixed = self._fixed_part(plan_id)
        plan = self.plans.ensure(plan_id, {s.node for s in batch.stages})
        stages = tuple(StageSpec(s.node, s.start, s.end, plan.nodes[s.node].config) for s in batch.stages)
        source = Source(batch.source, uris.get(batch.source))
        every_steps, every_s = self.settings.peripheral_every_steps, self.settings.peripheral_every_s
        if curves is None:
            curves = CurveSampling(self.settings.curve_every_steps, self.settings.curve_max_per_s)
        curve_every, curve_rate = curves.every_steps, curves.max_per_s
        snapshot_budget = self.settings.snapshot_budget_bytes

        def render(batch_id: int, attempt: int) -> str:
            spec = BatchSpec(
                batch_id=batch_id,
                attempt=attempt,
                plan_key=key,
                fixed=fixed,
                source=source,
                stages=stages,
                saves=frozenset(batch.saves),
                evals=frozenset(batch.evals),
                peripheral_every_steps=every_steps,
                peripheral_every_s=every_s,
                curve_every_steps=curve_every,
                curve_max_per_s=curve_rate,
                slots=batch.slots,
                extra={"slot_ids": list(slot_ids)} if len(slot_ids) > 1 else {},
                snapshot_budget_bytes=snapshot_budget,
            )
            return json.dumps(spec.to_json(), separators=(",", ":"))

        return render

    def _fixed_part(self, plan_id: int) -> tuple[str, FixedPart]:
        """A plan's key and parsed fixed part (a plan's row never changes: parsed once, not per batch)."""
        got = self._fixed_parts.get(plan_id)
        if got is None:
            key, fixed_json = self.store.plans.plan_fixed(plan_id)
            got = self._fixed_parts[plan_id] = (key, FixedPart.from_json(json.loads(fixed_json)))
        return got

    def fail_unplaceable(self, why: Mapping[int, str], pending: Mapping[int, Sequence[tuple[int, Point]]]) -> None:
        """Fail the waiting requests of plans no node manager can run (``plan_slots``), saying why."""
        failed = []
        for plan_id, reason in why.items():
            failed += self.store.requests.fail_waiting([rid for rid, _ in pending.get(plan_id, ())], reason)
            log.error("plan cannot be placed: its waiting requests fail: %s", reason, extra={"plan_id": plan_id})
        if failed:
            self.coord.notify(CH_RESULTS)

    def enforce_checkpoint_budget(self, forest: StageForest | None = None) -> list[Point]:
        """Evict checkpoints by the core's cost-benefit policy until the rest fit the budget; never one
        that pending work (``forest``'s sources) or a running batch starts from. The rows go at once;
        every live node manager is told to delete the files (the checkpoint store may be shared), and
        ``files`` deletes those in an object store."""
        budget = self.settings.checkpoint_budget_bytes
        if budget is None or self.store.checkpoints.checkpoint_bytes() <= budget:
            return []
        records = self.store.checkpoints.checkpoint_records()
        ckpts: dict[Point, Checkpoint] = {}
        nodes: dict[int, Node] = {}
        for plan_id, rows in records.items():
            plan = self.plans.ensure(plan_id, {p.node for p, *_ in rows})
            nodes.update(plan.nodes)
            for p, uri, nbytes, kind, used in rows:
                ckpts[p] = Checkpoint(p, uri, nbytes, CheckpointKind(kind), used)
        batches = self.store.ledger.running_batches()
        running = [inflight_of(b.spec_json) for b in batches]
        sources = {src for b in batches if (src := source_of(b.spec_json)) is not None}
        pinned = pinned_points(forest, sources) if forest is not None else set(sources)
        for ib in running:  # a running batch may still load anything on its path
            pinned.update(p for p in ckpts if any(st.node == p.node for st in ib.stages))
        result = choose_evictions(
            ckpts,
            budget,
            pinned=pinned,
            recompute_cost=prefix_cost(nodes, self.settings.default_step_seconds),
            now=time.time(),
            nodes=nodes,
        )
        if not result.evict:
            return []
        uris = sorted({c.uri for p in result.evict if (c := ckpts.get(p)) is not None})
        told = self.store.checkpoints.delete_checkpoints(result.evict)
        for nm in told:
            self.coord.notify(ch_node_manager(nm))
        kept = self.store.checkpoints.referenced(uris)  # a pack goes with the last of its points
        # an object store's copy goes even with no node manager alive
        self.files.delete([u for u in uris if u not in kept])
        log.info(
            "checkpoints evicted over budget",
            extra={"evicted": len(result.evict), "bytes_after": result.bytes_after, "shortfall": result.shortfall},
        )
        return result.evict

    def decide(self, reads: RoundReads | None = None) -> Decision:
        """Snapshot the database (``reads``, when the caller has just read it) and run the core round on
        the free slots. Writes nothing.

        The cyclic garbage collector is paused for the round (``_gc_paused``): a round allocates tens of
        thousands of short-lived, acyclic objects, and the collections they trigger walk the whole plan
        cache. Reference counting still frees them."""
        with _gc_paused():
            t0 = time.perf_counter()
            reads = self.store.rounds.round_reads() if reads is None else reads
            slots = self.free_slots(reads.node_managers, reads.busy)
            chosen = self.policy_step.active(reads.policy_studies)  # studies that chose policies (usually none)
            policies = {sid: p for sid, p in chosen.items() if p.schedules}  # not only slots per batch
            soon: list[Slot] = []
            wake_at = None
            if self.settings.lookahead_s > 0 and not chosen:  # followed with no work pending too: see soon_free
                # with nothing pending, nothing goes ahead and no round is due early: only who is alone is kept
                ahead_cost = (
                    self.stage_cost(slots or [s for n in reads.node_managers for s in n.placed_slots()])
                    if reads.pending
                    else None
                )
                soon, wake_at = self.soon_free(
                    reads.node_managers, reads.running, ahead_cost, time.time(), reads.started
                )
            if not slots and not soon and not any(p.time_share or p.search for p in policies.values()):
                return Decision(
                    RoundResult([], [], [], {}, 0), {}, 0, (time.perf_counter() - t0) * 1000, 0.0, None, wake_at=wake_at
                )
            forest, uris, count = self.snapshot(reads)
            t1 = time.perf_counter()
            unplaceable: dict[int, str] = {}
            self.costs.refresh_oom(self.store.ledger)
            slots_of = self.plan_slots(chosen, reads.node_managers, forest, unplaceable)
            if slots_of is not None:  # a batch on several slots must not wait on a busy one
                soon, wake_at = [], None
            slots = slots + soon  # first fit: the free ones first, then those about to free
            cost = self.stage_cost(slots, slots_of)
            preempts: list[int] = []
            kills: list[Kill] = []
            if policies:
                result, preempts, kills = self.policy_step.round(
                    forest, slots, cost, self.settings.policy, policies, slots_of, self.width_scale(slots)
                )
            else:
                result = schedule_round(forest, slots, cost, self.settings.policy, slots_of=slots_of)
            t2 = time.perf_counter()
        return Decision(
            result,
            uris,
            count,
            (t1 - t0) * 1000,
            (t2 - t1) * 1000,
            forest,
            tuple(preempts),
            tuple(kills),
            unplaceable,
            frozenset((sl.node_manager, sl.id) for sl in soon),
            wake_at,
        )

    def plan_slots(
        self,
        policies: Mapping[str, StudyPolicies],
        nms: Sequence[NodeManagerRecord],
        forest: StageForest,
        unplaceable: dict[int, str],
    ) -> Callable[[str], int] | None:
        """The slots a batch of each plan of ``forest`` takes (``CostModel.slots_for``: what its studies
        ask for, or twice what ran out of memory), or None when every one takes 1 (the common case). A
        plan that needs more than the largest node manager has goes into ``unplaceable`` with why (and
        takes more slots than any node manager has: it is never placed)."""
        asked: dict[str, int] = {}
        for sid, p in policies.items():
            if p.slots > 1:
                for pid in self.store.plans.study_plan_ids(sid):
                    asked[str(pid)] = max(asked.get(str(pid), 1), p.slots)
        model = self.costs.model
        if not asked and not model.any_ran_out_of_memory():
            return None  # every batch on one slot: no more reads
        plans = {st.plan for st in forest.stages}
        keys = {plan: self.store.plans.plan_fixed(int(plan))[0] for plan in plans if plan.isdigit()}
        most = max((len(n.placed_slots()) for n in nms if n.state == ALIVE), default=0)
        out: dict[str, int] = {}
        for plan in plans:
            n = asked.get(plan, 1)
            key = keys.get(plan)
            if key is None or most == 0:
                out[plan] = n
                continue
            try:
                out[plan] = model.slots_for(key, n, most)
            except ResourceExhausted as e:
                unplaceable[int(plan)] = e.message
                out[plan] = most + 1
        return lambda plan: out.get(plan, 1)

    def stage_cost(self, slots: Sequence[Slot], slots_of: Callable[[str], int] | None = None) -> StageCost:
        """The round's cost estimate (``master.costs``), learning from the batches that finished since
        the last read (at most once per ``cost_refresh_s``); a stage at the slots its plan takes."""
        now = time.monotonic()
        if now - self._costs_read_at >= self.settings.cost_refresh_s:
            self._costs_read_at = now
            self.costs.refresh(self.store.ledger)
        gpu_type = slots[0].gpu_type if slots else "cpu"
        return self.costs.stage_cost(
            lambda plan_id: self.store.plans.plan_fixed(plan_id)[0],
            lambda plan_id, node: self.plans.ensure(plan_id, (node,)).nodes[node].config,
            gpu_type,
            slots_of,
        )

    def width_scale(self, slots: Sequence[Slot]) -> Callable[[str, int], float]:
        """Time per step of a plan's batch on n slots over that on 1 (GENIE's choice of widths)."""
        gpu_type = slots[0].gpu_type if slots else "cpu"
        return self.costs.width_scale(lambda plan_id: self.store.plans.plan_fixed(plan_id)[0], gpu_type)

    def run_round(self, check_lost: bool = True) -> RoundReport:
        """One round. ``check_lost``: look for node managers whose heartbeat lapsed first (the loop does
        it at most every ``LIVENESS_CHECK_S``: a lapse is seen a heartbeat TTL late anyway)."""
        t0 = time.monotonic()
        reads = self.store.rounds.round_reads()  # one read serves the liveness check, the free slots, the forest
        lost = self.requeue_lost(reads.node_managers) if check_lost else []
        if lost:
            reads = self.store.rounds.round_reads()
        t_read = time.monotonic()
        dec = self.decide(reads)
        t_write = time.monotonic()
        # write-ahead: the policies' state, with what this round preempts and kills, before any of it is done
        self.policy_step.save(force=bool(dec.preempts or dec.kills))
        result, uris = dec.result, dec.uris
        dispatched: list[int] = []
        curves = self.curve_samplings([d.batch for d in result.dispatches])
        items = [
            DispatchItem(
                int(d.batch.plan),
                self.spec_of(d.batch, uris.get(int(d.batch.plan), {}), c, [s.id for s in d.slots]),
                d.batch.requests,
                d.slot.node_manager,
                ",".join(s.id for s in d.all_slots),  # a batch on several slots holds them all
            )
            for d, c in zip(result.dispatches, curves, strict=True)
        ]
        woken: set[str] = set()
        ahead = 0
        for d, rec in zip(result.dispatches, self.store.ledger.dispatch_many(items), strict=True):
            if rec is None:
                continue
            dispatched.append(rec.id)
            ahead += (d.slot.node_manager, d.slot.id) in dec.ahead
            log.info(
                "batch dispatched",
                extra={"batch_id": rec.id, "node_manager_id": d.slot.node_manager, "slot_id": d.slot.id},
            )
            woken.add(d.slot.node_manager)
        self.coord.notify_many(ch_node_manager(nm) for nm in sorted(woken))
        if dec.preempts or dec.kills:
            self.policy_step.carry_out(dec.preempts, dec.kills, self.coord.notify)
        if dec.unplaceable:
            self.fail_unplaceable(dec.unplaceable, reads.pending)
        if self.settings.checkpoint_budget_bytes is not None:
            self.enforce_checkpoint_budget(dec.forest)
        took = time.monotonic() - t0
        metrics.observe_round(took, dispatched, ahead)
        if took >= SLOW_ROUND_S:
            log.warning(
                "slow scheduling round",
                extra={
                    "round_ms": round(took * 1000),
                    "read_ms": round((t_read - t0) * 1000),
                    "snapshot_ms": round(dec.snapshot_ms),
                    "decide_ms": round(dec.decide_ms),
                    "dispatch_ms": round((time.monotonic() - t_write) * 1000),
                    "pending": dec.pending,
                    "dispatched": len(dispatched),
                },
            )
        return RoundReport(dec.pending, dispatched, lost, result.queued, dec.snapshot_ms, dec.decide_ms, dec.wake_at)

    # -- the loop -------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Rounds on every wake-up (and at least every ``round_interval_s``) while holding the lease."""
        wakeups = await self.coord.subscribe(CH_ROUND)  # keeps a wake-up that comes during a round
        self._round_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rounds")
        try:
            await self._rounds(stop, wakeups)
        finally:
            self._round_thread.shutdown(wait=False)
            await wakeups.close()
            with contextlib.suppress(Unavailable):  # it lapses by itself
                await asyncio.to_thread(self.coord.release_lease, self.instance_id)

    async def _rounds(self, stop: asyncio.Event, wakeups: Subscription) -> None:
        s = self.settings
        checked_lost_at = float("-inf")
        while not stop.is_set():
            try:
                leader = await asyncio.to_thread(self.coord.acquire_lease, self.instance_id, s.lease_ttl_s)
            except Unavailable as e:  # Redis away: lead nothing until the lease can be checked again
                log.warning("leader lease cannot be checked; retrying: %s", e.message)
                leader = False
            if leader != self.is_leader:
                log.info("leadership changed", extra={"instance_id": self.instance_id, "leader": leader})
                self.is_leader = leader
                if leader:
                    self.leader_since = time.time()
                    self.policy_step.reset()  # another master may have led meanwhile: load what it saved
            if not leader:
                await _sleep_or_stop(stop, s.lease_ttl_s / 3)
                continue
            try:
                now = time.monotonic()
                check_lost = now - checked_lost_at >= LIVENESS_CHECK_S
                if check_lost:
                    checked_lost_at = now
                # on a thread of its own: a round never waits for a thread behind the API's calls
                report = await asyncio.get_running_loop().run_in_executor(
                    self._round_thread, self.run_round, check_lost
                )
                if report.dispatched or report.lost_node_managers:
                    log.info("round", extra={"dispatched": len(report.dispatched), "pending": report.pending})
            except Exception:
                log.exception("scheduling round failed; retrying on the next wake-up")
                report = None
            wait = min(s.round_interval_s, s.lease_ttl_s / 3)
            if report is not None and report.wake_at is not None:  # a busy slot comes within lookahead then
                wait = min(wait, max(0.05, report.wake_at - time.time()))
            await wakeups.wait(wait)


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


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic collection while the block runs, then as before. The switch is process-wide, so it is
    held for one round only (a few hundred milliseconds at most): other threads' cycles wait that long.
    Kept because ``python -m tests.bench.master`` shows it: ``round_ms_10k`` 242 with it, 319 without
    (medians of 3 interleaved runs; the target is <= 250)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
