"""What the time-sharing and search policies learn from the running trials' reports, and the preempt step.

``observe`` runs first in a round: for each running batch of a study whose policies learn, Hermes
records a quantum when it expired (Eq. 2-4 over the losses reported since the quantum started) and the
search policy (POP or a baseline) is fed the reports since it last was, which may kill the trial
(TERMINATE: its requests are cancelled) or suspend it (SUSPEND: its batch is preempted; POP's
opportunistic round robin). Reports are what the trainers recorded on the batch's path: evaluations
and learning-curve points.

Time-sharing jobs are bound to a device as Hermes' global scheduler binds them to a GPU (Alg. 1-2,
``assign_devices``): a job goes to the device with the fewest jobs among those holding fewer than
``g_thres``, or waits in the global queue while every device holds that many, and keeps its device
until it ends. ``time_share_preempt`` is Hermes' node scheduler (Alg. 3) on each device: a running job
whose quantum expired yields to the best job waiting on its device when that one scores higher.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stagetree.core.errors import StagetreeError
from stagetree.core.ids import BatchId, JobKey, PlanId, StudyId
from stagetree.core.policies import hermes, pop
from stagetree.core.policies.state import Kill, PolicyState
from stagetree.core.policies.study import StudyPolicies, TimeShareParams
from stagetree.core.round.model import Report, RunningAttempt
from stagetree.core.round.work import Work

log = logging.getLogger(__name__)

_NO_POLICIES = StudyPolicies()
EPS_S = 1e-9  # a quantum ends at its end time, whatever the rounding of the clock's sums


@dataclass(frozen=True)
class TimeShared:
    """A running batch of a time-sharing study, as the preempt step sees it."""

    batch: BatchId
    study: StudyId
    job: str
    started: float  # when its current quantum started
    device: str = ""


def job_of(r: RunningAttempt) -> JobKey:
    end = r.end
    return JobKey(r.plan, end.node, end.step)


def reports_on(
    reports: Mapping[tuple[PlanId, int], Sequence[Report]],
    plan: PlanId,
    stages: Sequence[tuple[int, int, int]],
    since: float,
) -> list[tuple[int, float, Mapping[str, float]]]:
    """(step, recorded at, values) of the reports on ``stages`` (``(node, start, end)``, a step in
    ``(start, end]``) recorded after ``since``."""
    out: list[tuple[int, float, Mapping[str, float]]] = []
    for node in sorted({n for n, _, _ in stages}):
        got = reports.get((plan, node))
        if not got:
            continue
        i = bisect.bisect_right(got, since, key=lambda r: r.at)
        ranges = [(a, b) for n, a, b in stages if n == node]
        out.extend((r.step, r.at, r.values) for r in got[i:] if any(a < r.step <= b for a, b in ranges))
    return out


def losses_of(points: Sequence[tuple[float, Mapping[str, float]]], metric: str) -> list[float]:
    """The quantum's losses (``metric``) in recording order, from (recorded_at, values) pairs."""
    return [float(v[metric]) for _, v in sorted(points, key=lambda p: p[0]) if metric in v]


def eval_points(stages: Sequence[tuple[int, int, int]], every: int) -> list[tuple[int, int]]:
    """(node, step) every ``every`` steps inside ``(node, start, end)`` stages: where a batch of a
    time-sharing or search study evaluates, so that its trainer reports there."""
    out: list[tuple[int, int]] = []
    for node, start, end in stages:
        first = (start // every + 1) * every
        out.extend((node, s) for s in range(first, end + 1, every))
    return out


_STRENGTH = {pop.Verdict.CONTINUE: 0, pop.Verdict.SUSPEND: 1, pop.Verdict.TERMINATE: 2}


def on_reports(
    policy: pop.SearchPolicy,
    job: str,
    first_epoch: int,
    values: Sequence[float],
    now: float,
    epoch_s: float,
    waiting: int,
) -> pop.Verdict:
    """Feed a trial's new reports to its study's search policy as epochs ``first_epoch``, ``+1``, ...;
    the strongest verdict wins (TERMINATE over SUSPEND over CONTINUE), and nothing is fed after a kill."""
    verdict = pop.Verdict.CONTINUE
    for i, v in enumerate(values):
        got = policy.on_epoch(job, first_epoch + i, v, now, epoch_s, waiting)
        if _STRENGTH[got] > _STRENGTH[verdict]:
            verdict = got
        if got is pop.Verdict.TERMINATE:
            break
    return verdict


@dataclass
class Observed:
    """What ``observe`` found: the running batches of time-sharing studies, those whose quantum ended
    (and was recorded) and the batches to suspend."""

    time_shared: list[TimeShared]
    suspend: set[BatchId]
    expired: set[BatchId] = field(default_factory=set)


def observe(
    state: PolicyState,
    running: Sequence[RunningAttempt],
    policies: Mapping[StudyId, StudyPolicies],
    reports: Mapping[tuple[PlanId, int], Sequence[Report]],
    waiting: Mapping[StudyId | None, int],
    cluster_slots: int,
    now: float,
) -> Observed:
    """Feed the reports of the running batches of studies whose policies learn (see the module
    docstring). ``waiting``: ready work per study (POP suspends only when something waits)."""
    for study, pol in sorted(policies.items()):
        if pol.search is not None and study not in state.search:
            state.search[study] = pol.search.make(cluster_slots)
            state.search_start[study] = now
    shared: list[TimeShared] = []
    suspend: set[BatchId] = set()
    expired: set[BatchId] = set()
    alive: set[int] = set()
    for r in running:
        alive.add(r.batch)
        pol = policies.get(r.study, _NO_POLICIES) if r.study is not None else _NO_POLICIES
        if r.study is None or not pol.stateful or r.batch in state.preempting:
            continue
        job = str(job_of(r))
        started = state.quantum_start.setdefault(r.batch, r.dispatched_at)
        state.own_batch(r.batch, r.study)
        ts = pol.time_share
        if ts is not None:
            tsj = state.jobs.setdefault(job, hermes.TimeShareJob(job, r.dispatched_at))
            state.own_job(job, r.study)
            if now - started >= ts.make().quantum(tsj) - EPS_S:
                _record(tsj, ts, reports, r, started, now)
                expired.add(r.batch)
            shared.append(TimeShared(r.batch, r.study, job, started, r.slots[0].device if r.slots else ""))
        if pol.search is not None and job not in state.killed:
            verdict = _search(state, pol, reports, r, job, waiting.get(r.study, 0), now)
            if verdict is pop.Verdict.SUSPEND:
                suspend.add(r.batch)
                state.suspended_at[job] = now
    state.forget_batches(alive)
    return Observed([t for t in shared if t.batch not in suspend], suspend, expired)


def _record(
    job: hermes.TimeShareJob,
    ts: TimeShareParams,
    reports: Mapping[tuple[PlanId, int], Sequence[Report]],
    r: RunningAttempt,
    since: float,
    now: float,
) -> None:
    on_path = [(t, v) for _, t, v in reports_on(reports, r.plan, r.stages, since)]
    losses = losses_of(on_path, ts.metric)
    if losses:
        q = job.record(losses, now, ts.milestones)
        log.debug("quantum recorded", extra={"job": job.id, "convergence": q.convergence, "losses": len(losses)})


def _search(
    state: PolicyState,
    pol: StudyPolicies,
    reports: Mapping[tuple[PlanId, int], Sequence[Report]],
    r: RunningAttempt,
    job: str,
    waiting: int,
    now: float,
) -> pop.Verdict:
    sp = pol.search
    assert sp is not None and r.study is not None
    got = sorted(
        (s, t, float(v[sp.metric]))
        for s, t, v in reports_on(reports, r.plan, r.stages, state.fed_at.get(job, 0.0))
        if sp.metric in v
    )
    if not got:
        return pop.Verdict.CONTINUE
    state.own_job(job, r.study)
    state.fed_at[job] = max(t for _, t, _ in got)
    state.add_reports(job, [t for _, t, _ in got])
    first = state.epochs.get(job, 0) + 1
    state.epochs[job] = first + len(got) - 1
    try:
        verdict = on_reports(
            state.search[r.study],
            job,
            first,
            [v for _, _, v in got],
            now - state.search_start[r.study],
            state.epoch_s(job),
            waiting,
        )
    except StagetreeError as e:  # e.g. too few reports per boundary for the curve model
        log.warning("search policy step failed; trial continues: %s", e.message, extra={"job": job})
        return pop.Verdict.CONTINUE
    if verdict is pop.Verdict.TERMINATE:
        state.killed.add(job)
        best = max(v for _, _, v in got)
        reason = (
            f"killed by the study's {sp.policy!r} search policy: poor trial "
            f"(best {sp.metric} {best:.4g} after {state.epochs[job]} reports; kill threshold "
            f"{sp.kill_threshold:g}, target {sp.target:g})"
        )
        state.pending_kills[job] = Kill(r.study, job_of(r), reason)
        log.info("trial %s killed by its study's search policy", job, extra={"study_id": r.study})
    return verdict


def _ts(policies: Mapping[StudyId, StudyPolicies], study: StudyId | None) -> TimeShareParams | None:
    p = policies.get(study) if study is not None else None
    return None if p is None else p.time_share


def assign_devices(
    state: PolicyState,
    ordered: Sequence[Work],
    running: Sequence[TimeShared],
    policies: Mapping[StudyId, StudyPolicies],
    devices: Sequence[str],
) -> None:
    """Hermes Alg. 1-2: bind each time-sharing job of ``ordered`` (waiting work, in its study's order)
    that has no device yet to the device with the fewest bound jobs among those below its study's
    ``g_thres``; a job that finds none stays in the global queue. Running jobs are bound where they
    run; a device that left the cluster frees its jobs."""
    for r in running:
        if r.device:
            state.device[r.job] = r.device
    known = set(devices)
    for j in [j for j, d in state.device.items() if d not in known]:
        del state.device[j]
    counts = dict.fromkeys(devices, 0)
    for bound in state.device.values():
        counts[bound] += 1
    least = LeastLoaded(counts)
    for w in ordered:
        ts = _ts(policies, w.study)
        if ts is None or w.key in state.device:
            continue
        chosen = least.take(ts.g_thres)
        if chosen is not None:
            state.device[w.key] = chosen


class LeastLoaded:
    """``hermes.find_available_gpu`` over and over as jobs are bound: the device with the fewest jobs
    (the first in ``counts``' order on ties) when that is below the threshold. A heap of (jobs, order)
    answers each in O(log devices) where the scan was O(devices) per job (2,000 jobs on 1,600 devices
    were most of a round)."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self._heap = [(n, i, d) for i, (d, n) in enumerate(counts.items())]
        heapq.heapify(self._heap)

    def take(self, g_thres: int) -> str | None:
        """The device a job binds to (its count goes up by one), or None: every device holds ``g_thres``."""
        heap, counts = self._heap, self.counts
        while heap and heap[0][0] != counts[heap[0][2]]:
            heapq.heappop(heap)  # its count went up since this entry was made
        if not heap or heap[0][0] >= g_thres:
            return None
        n, i, d = heap[0]
        counts[d] = n + 1
        heapq.heapreplace(heap, (n + 1, i, d))
        return d


def time_share_preempt(
    waiting: Sequence[Work],
    running: Sequence[TimeShared],
    policies: Mapping[StudyId, StudyPolicies],
    jobs: Mapping[str, hermes.TimeShareJob],
    device: Mapping[str, str],
    now: float,
) -> list[BatchId]:
    """Hermes' node scheduler (Alg. 3) on each device: a running job whose quantum expired yields to
    the best job bound to its device and waiting, when that one scores higher."""
    queue: dict[str | None, list[Work]] = {}  # the waiting jobs by the device they are bound to
    for w in waiting:
        if _ts(policies, w.study) is not None:
            queue.setdefault(device.get(w.key), []).append(w)
    out: list[BatchId] = []
    taken: set[str] = set()
    for r in sorted(running, key=lambda r: (r.started, r.batch)):
        ts = _ts(policies, r.study)
        if ts is None:
            continue
        pol = ts.make()
        cur = jobs.get(r.job) or hermes.TimeShareJob(r.job)
        cands = [
            jobs.get(w.key) or hermes.TimeShareJob(w.key, w.arrival)
            for w in queue.get(r.device, ())
            if w.key not in taken and w.key != r.job
        ]
        slot = str(r.batch)
        for sw in hermes.node_round(pol, {slot: hermes.RunningJob(cur, r.started)}, {slot: cands}, now):
            if sw.stop is not None:
                out.append(r.batch)
                taken.add(sw.start)
    return out


def search_wakes(
    state: PolicyState, running: Sequence[RunningAttempt], policies: Mapping[StudyId, StudyPolicies], now: float
) -> list[float]:
    """When each running trial of a search study should next be looked at: half an epoch after its next
    evaluation boundary's report is due (its last report plus the epochs to go at its mean epoch), by
    when that report is normally stored and the next one has not come. None for a trial whose policy
    decides nothing more, that has fewer than two reports (no epoch length yet), or whose time passed."""
    out = []
    for r in running:
        pol = policies.get(r.study) if r.study is not None else None
        if pol is None or pol.search is None or r.study not in state.search or r.batch in state.preempting:
            continue
        job = str(job_of(r))
        first, last, n = state.reports.get(job, (0.0, 0.0, 0))
        if job in state.killed or n < 2 or last <= first:
            continue
        epoch = state.epochs.get(job, 0)
        nxt = state.search[r.study].next_decision(epoch)
        if nxt is None:
            continue
        epoch_s = state.epoch_s(job)
        due = last + (nxt - epoch + 0.5) * epoch_s
        if due > now:
            out.append(due)
    return out


def quantum_ends(
    running: Sequence[TimeShared], policies: Mapping[StudyId, StudyPolicies], jobs: Mapping[str, hermes.TimeShareJob]
) -> list[float]:
    """When the current quantum of each of these batches ends (none for a policy that never preempts)."""
    out = []
    for r in running:
        ts = _ts(policies, r.study)
        if ts is None:
            continue
        q = ts.make().quantum(jobs.get(r.job) or hermes.TimeShareJob(r.job))
        if q != float("inf"):
            out.append(r.started + q)
    return out
