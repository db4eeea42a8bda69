"""Per-study scheduling policies in the live master: the round's policy step and the state it keeps.

This module owns taking a study's ``"policies"`` key off its fixed object (``split_policies``: the rest
alone names the search plan) and ``PolicyStep``, which gathers a round's plain data from the store,
calls the pure ``stagetree.core.policies.live.plan_round``, keeps what the policies need across rounds
(Hermes' quanta, POP's policies and kills: soft state of the leading master, started afresh by a new
leader) and carries out the preemptions and kills it decides. The keys, parameters and semantics a
study chooses from are in docs/policies.md.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stagetree.core.batch import Point
from stagetree.core.errors import InvalidArgument, StagetreeError
from stagetree.core.policies import hermes, pop
from stagetree.core.policies.live import (
    Running,
    SlotView,
    StudyPolicies,
    Work,
    eval_points,
    losses_of,
    on_reports,
    parse_policies,
    plan_round,
)
from stagetree.core.policies.pop import Verdict
from stagetree.core.scheduler import (
    Dispatch,
    RoundResult,
    Slot,
    StageCost,
    count_batches,
    order_policy,
    plan_batches,
    schedule_round,
)
from stagetree.core.stagetree import StageForest
from stagetree.master.store.nodes import ALIVE
from stagetree.master.store.records import SlotInfo
from stagetree.master.store.store import Store

log = logging.getLogger(__name__)

POLICIES_KEY = "policies"


def split_policies(fixed_obj: Any) -> tuple[Any, StudyPolicies | None]:
    """A study's fixed object without its ``"policies"`` key, and the validated policies (None if absent)."""
    if not isinstance(fixed_obj, Mapping) or POLICIES_KEY not in fixed_obj:
        return fixed_obj, None
    rest = {k: v for k, v in fixed_obj.items() if k != POLICIES_KEY}
    return rest, parse_policies(fixed_obj[POLICIES_KEY])


def fixed_without_policies(fixed_json: str) -> Any:
    """The stored study fixed json as the plain fixed object (policies dropped, not validated again)."""
    obj = json.loads(fixed_json)
    if isinstance(obj, dict):
        obj.pop(POLICIES_KEY, None)
    return obj


@dataclass(frozen=True)
class Kill:
    """A trial a study's search policy killed: its live requests at (node, step) are cancelled."""

    study: str
    node: int
    step: int
    reason: str


def _job_of(plan: int | str, node: int, step: int) -> str:
    # the end point of a batch: the same before and after a preemption splits its work
    return f"{plan}:{node}:{step}"


class PolicyStep:
    """The master side of the policy step: gathers plain data, calls the pure plan, keeps the soft state
    the policies need across rounds (Hermes' per-job quanta, POP's per-study policy objects and what was
    fed to them, the preemptions in flight) and carries out preemptions and kills."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.parsed: dict[str, StudyPolicies] = {}  # study id -> policies (a study's never change)
        self.jobs: dict[str, hermes.TimeShareJob] = {}
        self.quantum_start: dict[int, float] = {}  # running batch -> when its current quantum started
        self.preempting: set[int] = set()
        self.running_jobs: set[str] = set()
        self.paths: dict[int, list[tuple[int, int, int]]] = {}  # running batch -> its (node, start, end) stages
        # POP: one search policy per study, and per trial what was fed to it
        self.search: dict[str, pop.SearchPolicy] = {}
        self.search_start: dict[str, float] = {}
        self.fed_at: dict[str, float] = {}
        self.report_times: dict[str, list[float]] = {}
        self.epochs: dict[str, int] = {}
        self.killed: set[str] = set()

    def active(self, rows: Sequence[tuple[str, str]] | None = None) -> dict[str, StudyPolicies]:
        """The policies of every study with live requests that chose some (``store.policy_studies``,
        read now unless the round has just read them)."""
        out: dict[str, StudyPolicies] = {}
        for sid, fixed_json in self.store.rounds.policy_studies() if rows is None else rows:
            pol = self.parsed.get(sid)
            if pol is None:
                try:
                    _, got = split_policies(json.loads(fixed_json))
                except (InvalidArgument, ValueError):
                    log.warning("study policies unreadable; ignored", extra={"study_id": sid})
                    got = None
                pol = self.parsed[sid] = got or StudyPolicies()
            out[sid] = pol
        return out

    def round(
        self,
        forest: StageForest,
        free: Sequence[Slot],
        cost: StageCost,
        order: str,
        policies: Mapping[str, StudyPolicies],
    ) -> tuple[RoundResult, list[int], list[Kill]]:
        """The round with the policy step: what ``schedule_round`` returns, the running batches to
        preempt and the trials to kill."""
        now = time.time()
        named = {p.order for p in policies.values() if p.order is not None}
        if len(named) == 1:
            order = named.pop()
        base = schedule_round(forest, [], cost, order)  # amendments and attachments, no placement
        batches = plan_batches(forest, order_policy(order), cost)
        ready = [b for b in batches if b.ready]
        info = self.store.requests.request_studies([r for b in ready for r in b.requests])
        work = []
        for i, b in enumerate(ready):
            reqs = [info[r] for r in b.requests if r in info]
            leaf = next((info[r][0] for r in reversed(b.requests) if r in info), "")
            end = b.stages[-1]
            job = _job_of(b.plan, end.node, end.end)
            if job not in self.killed:
                work.append(Work(i, leaf, job, b.cost, min((t for _, t in reqs), default=now)))
        free_views, busy_views = self._slot_views(free)
        running = self._running(policies, now)
        kills, suspend = self._search(policies, work, running, len(free_views) + len(busy_views), now)
        running = [r for r in running if r.batch not in suspend]
        plan = plan_round(work, free_views, busy_views, running, policies, self.jobs, now, self.search)
        by_id = {s.id: s for s in free}
        by_key = {w.key: w for w in work}
        dispatches = []
        for k, sid in plan.dispatch:
            b, w = ready[k], by_key[k]
            pol = policies.get(w.study, StudyPolicies())
            every = [
                x for x in (pol.time_share and pol.time_share.eval_every, pol.search and pol.search.report_every) if x
            ]
            if every:
                stages = [(st.node, st.start, st.end) for st in b.stages]
                b.evals.update(Point(n, s) for n, s in eval_points(stages, min(every)))
            if pol.time_share is not None:
                self.jobs.setdefault(w.job, hermes.TimeShareJob(w.job, w.arrival))
            dispatches.append(Dispatch(b, by_id[sid]))
        for r in running:  # a job that keeps its slot past its quantum starts a new one
            ts = policies.get(r.study, StudyPolicies()).time_share
            if ts is not None and r.batch not in plan.preempt:
                tsj = self.jobs.get(r.job)
                if tsj is not None and now - r.started >= ts.make().quantum(tsj):
                    self.quantum_start[r.batch] = now
        preempts = sorted(set(plan.preempt) | suspend)
        self.preempting.update(preempts)
        chosen = {id(d.batch) for d in dispatches}
        queue = [b for b in batches if id(b) not in chosen]
        self._forget({_job_of(b.plan, b.stages[-1].node, b.stages[-1].end) for b in batches} | self.running_jobs)
        result = RoundResult(
            dispatches, queue, base.amendments, base.attachments, count_batches(forest) - len(dispatches)
        )
        return result, preempts, kills

    def _search(
        self,
        policies: Mapping[str, StudyPolicies],
        work: Sequence[Work],
        running: Sequence[Running],
        slots: int,
        now: float,
    ) -> tuple[list[Kill], set[int]]:
        """POP (or a baseline) per study: feed each running trial's new reports to its study's policy;
        a TERMINATE kills the trial, a SUSPEND preempts its batch (POP's opportunistic round robin)."""
        kills: list[Kill] = []
        suspend: set[int] = set()
        for study, pol in policies.items():
            if pol.search is not None and study not in self.search:
                self.search[study] = pol.search.make(slots)
                self.search_start[study] = now
        for r in running:
            sp = policies.get(r.study, StudyPolicies()).search
            if sp is None or r.job in self.killed:
                continue
            stages = self.paths.get(r.batch, [])
            rows = self.store.requests.metrics_since(sorted({n for n, _, _ in stages}), self.fed_at.get(r.job, 0.0))
            reports = sorted(
                (st, t, v[sp.metric])
                for n, st, t, v in rows
                if sp.metric in v and any(n == sn and a < st <= b for sn, a, b in stages)
            )
            if not reports:
                continue
            self.fed_at[r.job] = max(t for _, t, _ in reports)
            times = self.report_times.setdefault(r.job, [])
            times.extend(t for _, t, _ in reports)
            epoch_s = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 and times[-1] > times[0] else 1.0
            first = self.epochs.get(r.job, 0) + 1
            self.epochs[r.job] = first + len(reports) - 1
            waiting = sum(1 for w in work if w.study == r.study)
            try:
                verdict = on_reports(
                    self.search[r.study],
                    r.job,
                    first,
                    [v for _, _, v in reports],
                    now - self.search_start[r.study],
                    epoch_s,
                    waiting,
                )
            except StagetreeError as e:  # e.g. too few reports per boundary for the curve model
                log.warning("search policy step failed; trial continues: %s", e.message, extra={"job": r.job})
                continue
            if verdict is Verdict.TERMINATE:
                self.killed.add(r.job)
                best = max(v for _, _, v in reports)
                reason = (
                    f"killed by the study's {sp.policy!r} search policy: poor trial "
                    f"(best {sp.metric} {best:.4g} after {self.epochs[r.job]} reports; kill threshold "
                    f"{sp.kill_threshold:g}, target {sp.target:g})"
                )
                _, node, step = r.job.rsplit(":", 2)
                kills.append(Kill(r.study, int(node), int(step), reason))
                log.info("trial killed by its study's search policy", extra={"study_id": r.study, "job": r.job})
            elif verdict is Verdict.SUSPEND:
                suspend.add(r.batch)
        return kills, suspend

    def carry_out(self, preempts: Sequence[int], kills: Sequence[Kill], notify: Callable[[str], None]) -> None:
        """Send PREEMPT for ``preempts``; cancel the killed trials' requests (aborting batches no live
        request needs any more) and record why."""
        from stagetree.master.service import CH_RESULTS, CH_ROUND, ch_node_manager  # service imports this module

        for bid in preempts:
            if self.store.ledger.preempt_batch(bid):
                nm = self.store.ledger.get_batch(bid).node_manager_id
                log.info("batch preempted by its study's policy", extra={"batch_id": bid})
                if nm:
                    notify(ch_node_manager(nm))
        for k in kills:
            ids = self.store.requests.live_requests_at(k.study, k.node, k.step)
            for rid in ids:
                _, abort = self.store.requests.cancel_request(k.study, rid)
                if abort is not None:
                    nm = self.store.ledger.abort_batch(abort)
                    if nm is not None:
                        notify(ch_node_manager(nm))
            self.store.requests.set_request_error(ids, k.reason)
        if kills:
            notify(CH_RESULTS)
            notify(CH_ROUND)

    def _slot_views(self, free: Sequence[Slot]) -> tuple[list[SlotView], dict[str, SlotView]]:
        free_ids = {(s.node_manager, s.id) for s in free}
        views: list[SlotView] = []
        busy: dict[str, SlotView] = {}
        for nm in self.store.nodes.node_managers():
            if nm.state != ALIVE:
                continue
            infos = nm.slot_infos or tuple(SlotInfo(sid, gpu) for sid, gpu in nm.slots)
            for i in infos:
                v = SlotView(i.id, nm.id, i.gpu_type, i.gpu_index, i.memory_bytes, i.cpu_cores)
                if (nm.id, i.id) in free_ids:
                    views.append(v)
                else:
                    busy[i.id] = v
        order = {(s.node_manager, s.id): k for k, s in enumerate(free)}
        views.sort(key=lambda v: order[(v.node_manager, v.id)])
        return views, busy

    def _running(self, policies: Mapping[str, StudyPolicies], now: float) -> list[Running]:
        """Running batches as the plan sees them; records the quantum of each time-sharing job whose
        quantum expired (Hermes Eq. 2-4 from the losses reported meanwhile)."""
        out = []
        alive = set()
        self.running_jobs = set()
        for rec, dispatched_at, studies in self.store.ledger.running_batch_info():
            alive.add(rec.id)
            spec = json.loads(rec.spec_json)
            stages = [(int(s["node"]), int(s["start"]), int(s["end"])) for s in spec["stages"]]
            job_id = _job_of(rec.plan_id, stages[-1][0], stages[-1][2])
            self.running_jobs.add(job_id)
            self.paths[rec.id] = stages
            if rec.id in self.preempting or not rec.slot_id:
                continue
            study = studies[-1] if studies else ""
            started = self.quantum_start.setdefault(rec.id, dispatched_at)
            ts = policies.get(study, StudyPolicies()).time_share
            if ts is not None:
                job = self.jobs.setdefault(job_id, hermes.TimeShareJob(job_id, dispatched_at))
                if now - started >= ts.make().quantum(job):
                    self._record(job, ts.metric, ts.milestones, stages, started, now)
            out.append(Running(rec.id, rec.slot_id, study, job_id, started))
        self.preempting &= alive
        for bid in list(self.quantum_start):
            if bid not in alive:
                del self.quantum_start[bid]
        for bid in list(self.paths):
            if bid not in alive:
                del self.paths[bid]
        return out

    def _record(
        self,
        job: hermes.TimeShareJob,
        metric: str,
        milestones: Sequence[float],
        stages: Sequence[tuple[int, int, int]],
        since: float,
        now: float,
    ) -> None:
        rows = self.store.requests.metrics_since(sorted({n for n, _, _ in stages}), since)
        on_path = [(t, v) for n, st, t, v in rows if any(n == sn and a < st <= b for sn, a, b in stages)]
        losses = losses_of(on_path, metric)
        if losses:
            q = job.record(losses, now, milestones)
            log.debug("quantum recorded", extra={"job": job.id, "convergence": q.convergence, "losses": len(losses)})

    def _forget(self, live: set[str]) -> None:
        for j in [j for j in self.jobs if j not in live]:
            del self.jobs[j]
