"""Carrying a scheduling round's decision out: the writes, the wake-ups and the files.

``DecisionApplier.apply`` takes a ``RoundDecision`` and, in this order: saves the policies' state (with
what the round preempts and kills, before any of it is done: write-ahead, ``master.policies``); writes
each dispatch (batch + attempt 1 + requests SCHED, in one transaction per batch, its spec rendered from
the plan's fixed part and nodes) and wakes the node managers' assignment streams; sends PREEMPT to the
batches the policies preempt and cancels the requests of the trials they kill; fails the waiting
requests of plans no node manager can run, saying why; evicts the checkpoints the round chose (the rows
at once, the files through the node managers and ``files``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from stagetree.core.batch import BatchSpec, CurveSampling, Point, Source, StageSpec
from stagetree.core.config import FixedPart
from stagetree.core.errors import NotFound
from stagetree.core.ids import BatchId, PlanId, RequestId, StudyId
from stagetree.core.policies.state import Kill
from stagetree.core.round import Dispatch, RoundDecision
from stagetree.core.scheduler import PlannedBatch
from stagetree.core.searchplan import batch_keeps_snapshots
from stagetree.core.slots import Slot
from stagetree.master.checkpoint_files import CheckpointFiles
from stagetree.master.coordination import Coordination
from stagetree.master.plans import PlanCache
from stagetree.master.policies import PolicyStates
from stagetree.master.round_read import RoundRead
from stagetree.master.service import CH_RESULTS, CH_ROUND, ch_node_manager
from stagetree.master.settings import SchedulingSettings
from stagetree.master.store.records import DispatchItem
from stagetree.master.store.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Applied:
    dispatched: list[BatchId]
    ahead: int  # of them, sent to a busy slot about to free
    sent: list[Dispatch] = field(default_factory=list)  # the dispatches recorded (those of ``dispatched``)


class DecisionApplier:
    def __init__(self, store: Store, plans: PlanCache, coordination: Coordination, policies: PolicyStates) -> None:
        self.store = store
        self.plans = plans
        self.coord = coordination
        self.policies = policies
        self._fixed_parts: dict[int, tuple[str, FixedPart]] = {}  # plan -> (key, fixed part), see _fixed_part

    def apply(
        self, dec: RoundDecision, read: RoundRead, settings: SchedulingSettings, files: CheckpointFiles
    ) -> Applied:
        self.policies.keep(dec.state)
        # write-ahead: the policies' state, with what this round preempts and kills, before any of it is done
        self.policies.save(force=bool(dec.preempts or dec.kills))
        applied = self.dispatch(dec.dispatches, read.uris, settings, read.reads.studies)
        if dec.preempts or dec.kills:
            self.carry_out(dec.preempts, dec.kills)
        if dec.unplaceable:
            self.fail_unplaceable(dec.unplaceable, read.reads.pending)
        if dec.evictions:
            self.evict(dec.evictions, read, files)
        return applied

    # -- dispatches -----------------------------------------------------------------------------

    def dispatch(
        self,
        dispatches: Sequence[Dispatch],
        uris: Mapping[PlanId, Mapping[Point, str]],
        settings: SchedulingSettings,
        studies: Mapping[RequestId, StudyId] | None = None,
    ) -> Applied:
        """``studies``: the study of each request the round read (the rest are looked up)."""
        curves = self.curve_samplings([d.batch for d in dispatches], settings, studies)
        items = [
            DispatchItem(
                d.batch.plan,
                self.spec_of(d.batch, uris.get(d.batch.plan, {}), settings, c, d.slots),
                d.batch.requests,
                d.slot.node_manager,
                tuple(s.id for s in d.slots),  # a batch on several slots holds them all
            )
            for d, c in zip(dispatches, curves, strict=True)
        ]
        woken: set[str] = set()
        dispatched: list[BatchId] = []
        sent: list[Dispatch] = []
        ahead = 0
        for d, rec in zip(dispatches, self.store.ledger.dispatch_many(items), strict=True):
            if rec is None:
                continue
            dispatched.append(BatchId(rec.id))
            sent.append(d)
            ahead += d.ahead
            log.info(
                "batch dispatched",
                extra={"batch_id": rec.id, "node_manager_id": d.slot.node_manager, "slot_id": d.slot.id},
            )
            woken.add(d.slot.node_manager)
        self.coord.notify_many(ch_node_manager(nm) for nm in sorted(woken))
        return Applied(dispatched, ahead, sent)

    def curve_samplings(
        self,
        batches: Sequence[PlannedBatch],
        settings: SchedulingSettings,
        known: Mapping[RequestId, StudyId] | None = None,
    ) -> list[CurveSampling]:
        """Each batch's learning-curve sampling: the finest its requests' studies ask for
        (``CurveSampling.finest``; a study that set none gets the master's settings). The requests' studies
        are ``known`` (the round read them) or read at once for all."""
        default = CurveSampling(settings.curve_every_steps, settings.curve_max_per_s)
        known = known or {}
        wanted = [r for b in batches for r in b.requests]
        owners: dict[int, str] = {r: str(known[r]) for r in wanted if r in known}
        missing = [r for r in wanted if r not in owners]
        if missing:
            owners.update((r, sid) for r, (sid, _) in self.store.requests.request_studies(missing).items())
        by_study: dict[str, CurveSampling] = {}
        for sid in owners.values():
            if sid not in by_study:
                by_study[sid] = self._study_sampling(sid, default)
        out = []
        for b in batches:
            studies = {owners[r] for r in b.requests if r in owners}
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
        uris: Mapping[Point, str],
        settings: SchedulingSettings,
        curves: CurveSampling | None = None,
        slots: Sequence[Slot] = (),
    ) -> Callable[[int, int], str]:
        """The renderer of ``batch``'s spec for ``store.dispatch``. Everything it needs (the plan's fixed
        part, its nodes) is read here, before the dispatch transaction opens: rendering inside it must
        take no lock, or a submission holding the plan cache's lock while it waits for the database
        write lock deadlocks with the round (seen on SQLite). ``curves``: its curve sampling (None: the
        master's settings). The spec's snapshot budget is the master's for a batch on one CPU slot in a
        plan that keeps snapshots (``batch_keeps_snapshots``), 0 otherwise: a worker keeps none on a GPU or on
        several ranks, and the round (``inflight_of``) takes a running batch's budget as its promise of a
        checkpoint at every step it trains."""
        plan_id = batch.plan
        key, fixed = self._fixed_part(plan_id)
        plan = self.plans.ensure(plan_id, {s.node for s in batch.stages})
        stages = tuple(StageSpec(s.node, s.start, s.end, plan.nodes[s.node].config) for s in batch.stages)
        source = Source(batch.source, uris.get(batch.source))
        every_steps, every_s = settings.peripheral_every_steps, settings.peripheral_every_s
        if curves is None:
            curves = CurveSampling(settings.curve_every_steps, settings.curve_max_per_s)
        curve_every, curve_rate = curves.every_steps, curves.max_per_s
        slot_ids = [s.id for s in slots]
        kept = batch_keeps_snapshots(plan, slots, settings.snapshot_probation_roots)
        snapshot_budget = settings.snapshot_budget_bytes if kept else 0

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

    # -- preemptions and kills ------------------------------------------------------------------

    def carry_out(self, preempts: Sequence[BatchId], kills: Sequence[Kill]) -> None:
        """Send PREEMPT for ``preempts``; cancel the killed trials' requests (aborting batches no live
        request needs any more) and record why. Each one done is no longer pending."""
        notify = self.coord.notify
        for bid in preempts:
            if self.store.ledger.preempt_batch(bid):
                nm = self.store.batches.get_batch(bid).node_manager_id
                log.info("batch preempted by its study's policy", extra={"batch_id": bid})
                if nm:
                    notify(ch_node_manager(nm))
            self.policies.preempted(bid)
        for k in kills:
            ids = self.store.requests.live_requests_at(k.study, k.node, k.step)
            for rid in ids:
                _, abort = self.store.requests.cancel_request(k.study, rid, k.reason)
                if abort is not None:
                    nm = self.store.ledger.abort_batch(abort)
                    if nm is not None:
                        notify(ch_node_manager(nm))
            self.policies.killed(str(k.job))
        if kills:
            notify(CH_RESULTS)
            notify(CH_ROUND)

    # -- what cannot run, and checkpoints over budget ------------------------------------------------

    def fail_unplaceable(self, why: Mapping[PlanId, str], pending: Mapping[int, Sequence[tuple[int, Point]]]) -> None:
        """Fail the waiting requests of plans no node manager can run, saying why."""
        failed = []
        for plan_id, reason in why.items():
            failed += self.store.requests.fail_waiting([rid for rid, _ in pending.get(plan_id, ())], reason)
            log.error("plan cannot be placed: its waiting requests fail: %s", reason, extra={"plan_id": plan_id})
        if failed:
            self.coord.notify(CH_RESULTS)

    def evict(self, points: Sequence[Point], read: RoundRead, files: CheckpointFiles) -> None:
        """Drop the checkpoints the round chose: the rows at once; every live node manager is told to
        delete the files (the checkpoint store may be shared), and ``files`` deletes those in an object
        store. A pack's file goes with the last of its points."""
        budget = read.input.checkpoints
        ckpts = budget.checkpoints if budget is not None else {}
        uris = sorted({c.uri for p in points if (c := ckpts.get(p)) is not None})
        told = self.store.checkpoints.delete_checkpoints(points)
        for nm in told:
            self.coord.notify(ch_node_manager(nm))
        kept = self.store.checkpoints.referenced(uris)
        files.delete([u for u in uris if u not in kept])  # an object store's copy goes even with no node manager
        log.info("checkpoints evicted over budget", extra={"evicted": len(points)})
