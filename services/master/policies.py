"""Per-study scheduling policies in the live master: the round's policy step and the state it keeps.

This module owns taking a study's ``"policies"`` key off its fixed object (``split_policies``: the rest
alone names the search plan) and ``PolicyStep``, which gathers a round's plain data from the store,
calls the pure ``stagetree.core.policies.live.plan_round``, keeps what the policies need across rounds
(Hermes' quanta, POP's policies and kills, saved per study so that a new leader restores them) and
carries out the preemptions and kills it decides. The keys, parameters and semantics a study chooses
from are in docs/policies.md.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stagetree.core.batch import Point
from stagetree.core.errors import InvalidArgument, StagetreeError
from stagetree.core.policies import hermes
from stagetree.core.policies.live import (
    Running,
    StudyPolicies,
    Work,
    eval_points,
    losses_of,
    on_reports,
    parse_policies,
    plan_round,
)
from stagetree.core.policies.pop import Verdict
from stagetree.core.policies.state import Kill, PolicyState
from stagetree.core.scheduler import (
    Dispatch,
    RoundResult,
    StageCost,
    count_batches,
    order_policy,
    plan_batches,
    schedule_round,
)
from stagetree.core.slots import Slot
from stagetree.core.stagetree import StageForest
from stagetree.master.store.nodes import ALIVE
from stagetree.master.store.policy_state import PolicyStateStore
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


def _job_of(plan: int | str, node: int, step: int) -> str:
    # the end point of a batch: the same before and after a preemption splits its work
    return f"{plan}:{node}:{step}"


def _stateful(p: StudyPolicies | None) -> bool:
    """Whether the study's policies learn across rounds (time-sharing quanta, search curves and kills)."""
    return p is not None and (p.time_share is not None or p.search is not None)


class PolicyStep:
    """The master side of the policy step: gathers plain data, calls the pure plan, keeps the soft state
    the policies need across rounds (``core.policies.state.PolicyState``: Hermes' per-job quanta, POP's
    per-study policy objects and what was fed to them, the kills and preemptions) and carries out
    preemptions and kills.

    The soft state survives a change of leader: each study's snapshot is saved in ``policy_states``
    (``save``) and a leader loads it before the first round that serves the study (``reset`` on taking
    the lease). Consistency:

    * write-ahead: a round that preempts or kills saves the state, with those decisions as pending, before
      anything of the round is carried out (``save(force=True)`` before the dispatches); ``carry_out``
      clears them once done, and a leader that restores pending ones carries them out again (cancelling a
      study's live requests at a point, and PREEMPT for a running batch, may be repeated harmlessly). A
      killed trial is in the saved ``killed`` set before any of its requests is cancelled, so no master
      decides to kill it a second time;
    * other changes (reports fed to a search policy, Hermes quanta recorded) are saved when changed, at
      most once per round and once per ``save_every_s``. A crash loses at most what was learnt in that
      last ``save_every_s``, which preempted and killed nothing (at most it ordered the dispatches of those
      rounds); the saved state says up to which report (``fed_at``) and from which quantum start it
      learnt, so the next leader reads the same metrics again and learns it anew (decisions that depend
      on the clock, such as POP's time left, are then taken at the new time);
    * a deposed leader still in its round may write once more after the next leader loaded; the next
      leader's own saves then replace that.
    """

    def __init__(self, store: Store, save_every_s: float = 1.0) -> None:
        self.store = store
        self.states = PolicyStateStore(store.db)
        self.save_every_s = save_every_s
        self.parsed: dict[str, StudyPolicies] = {}  # study id -> policies (a study's never change)
        self.running_jobs: set[str] = set()
        self.paths: dict[int, list[tuple[int, int, int]]] = {}  # running batch -> its (node, start, end) stages
        self.reset()

    def reset(self) -> None:
        """Forget the soft state; each study's is loaded from the database before the next round that
        serves it (a master that starts leading calls this)."""
        self.state = PolicyState()
        self.loaded: set[str] = set()
        self.saved: dict[str, str] = {}  # study -> the snapshot (as canonical JSON) last saved or loaded
        self.saved_at = -math.inf

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

    def load(self, policies: Mapping[str, StudyPolicies]) -> None:
        """Restore the saved state of the studies among ``policies`` not loaded since the last ``reset``."""
        new = [sid for sid, p in policies.items() if sid not in self.loaded and _stateful(p)]
        if not new:
            return
        for sid, data in self.states.load(new).items():
            sp = policies[sid].search
            try:
                self.state.restore(sid, data, None if sp is None else sp.make(1))
            except InvalidArgument as e:
                log.warning("saved policy state unreadable; the study's starts afresh: %s", e.message)
                continue
            self.saved[sid] = _canonical(data)
            log.info("policy state restored", extra={"study_id": sid})
        self.loaded.update(new)

    def save(self, force: bool = False) -> list[str]:
        """Save the snapshot of each study whose state changed since it was last saved; unless ``force``,
        not within ``save_every_s`` of the last look. Returns the studies saved."""
        now = time.monotonic()
        if not force and now - self.saved_at < self.save_every_s:
            return []
        self.saved_at = now
        changed: dict[str, tuple[dict[str, Any], str]] = {}
        for sid in sorted(self.state.studies()):
            if not _stateful(self.parsed.get(sid)):
                continue
            snap = self.state.snapshot(sid)
            text = _canonical(snap)
            if self.saved.get(sid) != text:
                changed[sid] = (snap, text)
        if changed:
            self.states.save({sid: snap for sid, (snap, _) in changed.items()})
            self.saved.update({sid: text for sid, (_, text) in changed.items()})
        return sorted(changed)

    def round(
        self,
        forest: StageForest,
        free: Sequence[Slot],
        cost: StageCost,
        order: str,
        policies: Mapping[str, StudyPolicies],
        slots_of: Callable[[str], int] | None = None,
        width_scale: Callable[[str, int], float] | None = None,
    ) -> tuple[RoundResult, list[int], list[Kill]]:
        """The round with the policy step: what ``schedule_round`` returns, the running batches to
        preempt and the trials to kill (with the ones decided earlier and not yet carried out).
        ``slots_of(plan)``: the slots a batch of the plan takes (``cost`` counts it so); for a study with
        a QoS class GENIE may give it fewer, 1, 2, 4, ..., timed by ``width_scale(plan, n)`` (time per step
        on n slots over that on 1)."""
        self.load(policies)
        st = self.state
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
            if job not in st.killed:
                n = slots_of(b.plan) if slots_of is not None else 1
                widths: tuple[tuple[int, float], ...] = ()
                pol = policies.get(leaf)
                if n > 1 and pol is not None and pol.qos is not None and width_scale is not None:
                    one = b.cost / max(width_scale(b.plan, n), 1e-12)
                    widths = tuple((k, one * width_scale(b.plan, k)) for k in _widths(n))
                work.append(Work(i, leaf, job, b.cost, min((t for _, t in reqs), default=now), n, widths))
        busy = self._busy_slots(free)
        running = self._running(policies, now)
        suspend = self._search(policies, work, running, len(free) + len(busy), now)
        running = [r for r in running if r.batch not in suspend]
        plan = plan_round(work, free, busy, running, policies, st.jobs, now, st.search)
        by_id = {s.id: s for s in free}
        by_key = {w.key: w for w in work}
        dispatches = []
        for k, sid in plan.dispatch:
            b, w = ready[k], by_key[k]
            ids = sid.split(",")  # a batch on several slots: "a,b"
            b.slots = len(ids)
            pol = policies.get(w.study, StudyPolicies())
            every = [
                x for x in (pol.time_share and pol.time_share.eval_every, pol.search and pol.search.report_every) if x
            ]
            if every:
                stages = [(s.node, s.start, s.end) for s in b.stages]
                b.evals.update(Point(n, s) for n, s in eval_points(stages, min(every)))
            if pol.time_share is not None:
                st.jobs.setdefault(w.job, hermes.TimeShareJob(w.job, w.arrival))
                st.own_job(w.job, w.study)
            dispatches.append(Dispatch(b, by_id[ids[0]], tuple(by_id[x] for x in ids) if len(ids) > 1 else ()))
        for r in running:  # a job that keeps its slot past its quantum starts a new one
            ts = policies.get(r.study, StudyPolicies()).time_share
            if ts is not None and r.batch not in plan.preempt:
                tsj = st.jobs.get(r.job)
                if tsj is not None and now - r.started >= ts.make().quantum(tsj):
                    st.quantum_start[r.batch] = now
        study_of = {r.batch: r.study for r in running}
        for bid in set(plan.preempt) | suspend:
            st.own_batch(bid, study_of[bid])
        st.preempting.update(plan.preempt, suspend)
        st.pending_preempts.update(plan.preempt, suspend)
        chosen = {id(d.batch) for d in dispatches}
        queue = [b for b in batches if id(b) not in chosen]
        st.forget_jobs({_job_of(b.plan, b.stages[-1].node, b.stages[-1].end) for b in batches} | self.running_jobs)
        result = RoundResult(
            dispatches, queue, base.amendments, base.attachments, count_batches(forest) - len(dispatches)
        )
        return result, sorted(st.pending_preempts), list(st.pending_kills.values())

    def _search(
        self,
        policies: Mapping[str, StudyPolicies],
        work: Sequence[Work],
        running: Sequence[Running],
        slots: int,
        now: float,
    ) -> set[int]:
        """POP (or a baseline) per study: feed each running trial's new reports to its study's policy;
        a TERMINATE kills the trial (a pending kill), a SUSPEND preempts its batch (POP's opportunistic
        round robin). Returns the batches to suspend."""
        st = self.state
        suspend: set[int] = set()
        for study, pol in policies.items():
            if pol.search is not None and study not in st.search:
                st.search[study] = pol.search.make(slots)
                st.search_start[study] = now
        for r in running:
            sp = policies.get(r.study, StudyPolicies()).search
            if sp is None or r.job in st.killed:
                continue
            stages = self.paths.get(r.batch, [])
            rows = self._reports_since(sorted({n for n, _, _ in stages}), st.fed_at.get(r.job, 0.0))
            reports = sorted(
                (s, t, v[sp.metric])
                for n, s, t, v in rows
                if sp.metric in v and any(n == sn and a < s <= b for sn, a, b in stages)
            )
            if not reports:
                continue
            st.own_job(r.job, r.study)
            st.fed_at[r.job] = max(t for _, t, _ in reports)
            st.add_reports(r.job, [t for _, t, _ in reports])
            first = st.epochs.get(r.job, 0) + 1
            st.epochs[r.job] = first + len(reports) - 1
            waiting = sum(1 for w in work if w.study == r.study)
            try:
                verdict = on_reports(
                    st.search[r.study],
                    r.job,
                    first,
                    [v for _, _, v in reports],
                    now - st.search_start[r.study],
                    st.epoch_s(r.job),
                    waiting,
                )
            except StagetreeError as e:  # e.g. too few reports per boundary for the curve model
                log.warning("search policy step failed; trial continues: %s", e.message, extra={"job": r.job})
                continue
            if verdict is Verdict.TERMINATE:
                st.killed.add(r.job)
                best = max(v for _, _, v in reports)
                reason = (
                    f"killed by the study's {sp.policy!r} search policy: poor trial "
                    f"(best {sp.metric} {best:.4g} after {st.epochs[r.job]} reports; kill threshold "
                    f"{sp.kill_threshold:g}, target {sp.target:g})"
                )
                st.pending_kills[r.job] = Kill(r.study, r.job, reason)
                log.info("trial %s killed by its study's search policy", r.job, extra={"study_id": r.study})
            elif verdict is Verdict.SUSPEND:
                suspend.add(r.batch)
        return suspend

    def carry_out(self, preempts: Sequence[int], kills: Sequence[Kill], notify: Callable[[str], None]) -> None:
        """Send PREEMPT for ``preempts``; cancel the killed trials' requests (aborting batches no live
        request needs any more) and record why. Each one done is no longer pending."""
        from stagetree.master.service import CH_RESULTS, CH_ROUND, ch_node_manager  # service imports this module

        for bid in preempts:
            if self.store.ledger.preempt_batch(bid):
                nm = self.store.ledger.get_batch(bid).node_manager_id
                log.info("batch preempted by its study's policy", extra={"batch_id": bid})
                if nm:
                    notify(ch_node_manager(nm))
            self.state.pending_preempts.discard(bid)
        for k in kills:
            ids = self.store.requests.live_requests_at(k.study, k.node, k.step)
            for rid in ids:
                _, abort = self.store.requests.cancel_request(k.study, rid)
                if abort is not None:
                    nm = self.store.ledger.abort_batch(abort)
                    if nm is not None:
                        notify(ch_node_manager(nm))
            self.store.requests.set_request_error(ids, k.reason)
            self.state.pending_kills.pop(k.job, None)
        if kills:
            notify(CH_RESULTS)
            notify(CH_ROUND)

    def _busy_slots(self, free: Sequence[Slot]) -> dict[str, Slot]:
        """The live node managers' slots that are not ``free``, by slot id."""
        free_ids = {(s.node_manager, s.id) for s in free}
        return {
            s.id: s
            for nm in self.store.nodes.node_managers()
            if nm.state == ALIVE
            for s in nm.placed_slots()
            if (nm.id, s.id) not in free_ids
        }

    def _running(self, policies: Mapping[str, StudyPolicies], now: float) -> list[Running]:
        """Running batches as the plan sees them; records the quantum of each time-sharing job whose
        quantum expired (Hermes Eq. 2-4 from the losses reported meanwhile)."""
        st = self.state
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
            if rec.id in st.preempting or not rec.slot_id:
                continue
            study = studies[-1] if studies else ""
            started = st.quantum_start.setdefault(rec.id, dispatched_at)
            if _stateful(policies.get(study)):
                st.own_batch(rec.id, study)
            ts = policies.get(study, StudyPolicies()).time_share
            if ts is not None:
                job = st.jobs.setdefault(job_id, hermes.TimeShareJob(job_id, dispatched_at))
                st.own_job(job_id, study)
                if now - started >= ts.make().quantum(job):
                    self._record(job, ts.metric, ts.milestones, stages, started, now)
            out.append(Running(rec.id, rec.slot_id, study, job_id, started))
        st.forget_batches(alive)
        for bid in list(self.paths):
            if bid not in alive:
                del self.paths[bid]
        return out

    def _reports_since(self, nodes: Sequence[int], since: float) -> list[tuple[int, int, float, dict[str, float]]]:
        """What the policies learn from: evaluation metrics and learning-curve points (the trainers' step
        metrics) recorded on ``nodes`` after ``since``; at a step with both, the evaluation's values win."""
        evals = self.store.requests.metrics_since(nodes, since)
        seen = {(n, st) for n, st, _, _ in evals}
        curve = [row for row in self.store.curves.points_since(nodes, since) if (row[0], row[1]) not in seen]
        return evals + curve

    def _record(
        self,
        job: hermes.TimeShareJob,
        metric: str,
        milestones: Sequence[float],
        stages: Sequence[tuple[int, int, int]],
        since: float,
        now: float,
    ) -> None:
        rows = self._reports_since(sorted({n for n, _, _ in stages}), since)
        on_path = [(t, v) for n, st, t, v in rows if any(n == sn and a < st <= b for sn, a, b in stages)]
        losses = losses_of(on_path, metric)
        if losses:
            q = job.record(losses, now, milestones)
            log.debug("quantum recorded", extra={"job": job.id, "convergence": q.convergence, "losses": len(losses)})


def _widths(most: int) -> list[int]:
    """The widths GENIE chooses from: 1, 2, 4, ... below ``most``, and ``most``."""
    out, k = [], 1
    while k < most:
        out.append(k)
        k *= 2
    return [*out, most]


def _canonical(snapshot: Mapping[str, Any]) -> str:
    return json.dumps(snapshot, sort_keys=True, separators=(",", ":"))
