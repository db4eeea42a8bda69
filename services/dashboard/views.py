"""What the Studies, Study and Trial pages show, as JSON-ready dicts built from the master's service layer.

Owns the pages' data, not their drawing. A *trial* is what a tuner names (the request label; an
unlabelled request is a trial of its own), and its requests at increasing steps are its *rungs*: the
study page lists trials with their rungs inside, each with the tuned choices its schedule stands for
(``core.schedule_features``), and estimates how much each choice matters to each evaluation metric
(``core.importance``). The trial page shows one trial in full: its schedule over every step, its rungs,
its learning curve, its failure (``core.failures``: what was raised, the traceback, the worker's log),
the batches that ran it, and which steps it shares with which other trials. Every read goes through
``MasterService`` for visibility: another owner's study does not exist for the caller.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stagetree.core.batch import Point
from stagetree.core.config import Config
from stagetree.core.errors import InvalidArgument, NotFound
from stagetree.core.failures import parse_failure
from stagetree.core.importance import importance
from stagetree.core.lifecycle import RequestState
from stagetree.core.schedule_features import study_features
from stagetree.core.searchplan import SearchPlan
from stagetree.core.seqforms import to_text
from stagetree.core.sequences import Segments, boundaries, value_at
from stagetree.core.text import check_id
from stagetree.dashboard.cache import VersionedCache
from stagetree.master.auth import Principal
from stagetree.master.curves import CurveService
from stagetree.master.service import MasterService
from stagetree.master.store.activity import ActivityReader
from stagetree.master.store.records import RequestRecord, StudyRecord

SCHEDULE_SAMPLES = 240  # points of each hyper-parameter's schedule plot
TRIAL_CURVE_POINTS = 4000
SHARED_LABELS = 50  # trials named per shared piece of a trial's path (the count is always whole)


def metric_mode(name: str) -> str:
    """Whether a smaller (``min``: losses, errors, perplexities) or a larger value is better."""
    low = name.lower()
    return "min" if any(w in low for w in ("loss", "err", "perplex", "mse", "mae", "rmse", "time")) else "max"


def schedule_text(config: Config) -> str:
    """A config's schedules in the one printed form (``core.seqforms``), as the SDK, CLI and REST print
    them: ``bs=32 lr=Warmup(0.01, 5, then=Cosine(0.1, 0.001, 40))``."""
    return " ".join(f"{name}={_sequence_text(segs)}" for name, segs in config.items)


@functools.lru_cache(maxsize=65_536)
def _sequence_text(segments: Segments) -> str:
    # a study's trials repeat each hyper-parameter's few schedules: each is written once
    return to_text(segments)


def trial_key(r: RequestRecord) -> str:
    """The trial a request belongs to: its label, or ``#<request id>`` for an unlabelled one."""
    return r.label or f"#{r.id}"


def trial_state(rungs: Sequence[RequestRecord]) -> RequestState:
    """A trial is running or waiting while a rung is; otherwise it is what its last rung ended as."""
    states = {r.state for r in rungs}
    for live in (RequestState.SCHED, RequestState.NOT_SCHED):
        if live in states:
            return live
    return max(rungs, key=lambda r: (r.step, r.id)).state


def study_state(counts: Mapping[str, int]) -> str:
    """The study in one word: ``empty``, ``running``, ``waiting``, ``failed`` (all its requests failed)
    or ``done``."""
    if not sum(counts.values()):
        return "empty"
    if counts.get(RequestState.SCHED.value):
        return "running"
    if counts.get(RequestState.NOT_SCHED.value):
        return "waiting"
    if counts.get(RequestState.FAILED.value) == sum(counts.values()):
        return "failed"
    return "done"


def _finite(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v)
    return None


def _metrics_json(values: Mapping[str, float] | None) -> dict[str, float | str]:
    """Metrics as the pages take them: a non-finite value (a diverged loss) as its name, not a number."""
    out: dict[str, float | str] = {}
    for k, v in (values or {}).items():
        f = _finite(v)
        out[k] = f if f is not None else ("NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity"))
    return out


@dataclass
class Trial:
    key: str
    rungs: list[RequestRecord]

    @property
    def last(self) -> RequestRecord:
        return max(self.rungs, key=lambda r: (r.step, r.id))

    def best_rung(self) -> RequestRecord | None:
        """Its highest finished rung with metrics (what its metrics are)."""
        done = [r for r in self.rungs if r.state is RequestState.DONE and r.metrics]
        return max(done, key=lambda r: (r.step, r.id)) if done else None


def group_trials(reqs: Sequence[RequestRecord]) -> list[Trial]:
    """The requests as trials, in the order the trials began."""
    by: dict[str, Trial] = {}
    for r in sorted(reqs, key=lambda r: r.id):
        by.setdefault(trial_key(r), Trial(trial_key(r), [])).rungs.append(r)
    for t in by.values():
        t.rungs.sort(key=lambda r: (r.step, r.id))
    return list(by.values())


def best_of(trials: Sequence[Trial], metric: str | None = None) -> dict[str, Any] | None:
    """The best trial by ``metric`` at its highest finished rung (default: the first metric name,
    accuracy-like ones first): ``{"metric", "mode", "value", "trial", "label", "request_id", "step"}``."""
    names = sorted({k for t in trials for r in t.rungs if r.metrics for k in r.metrics})
    if not names:
        return None
    if metric is None:
        maxes = [n for n in names if metric_mode(n) == "max"]
        metric = (maxes or names)[0]
    mode = metric_mode(metric)
    best: tuple[float, Trial, RequestRecord] | None = None
    for t in trials:
        r = t.best_rung()
        v = _finite((r.metrics or {}).get(metric)) if r is not None else None
        if r is None or v is None:
            continue
        k = v if mode == "max" else -v
        if best is None or k > best[0]:
            best = (k, t, r)
    if best is None:
        return None
    _, t, r = best
    assert r.metrics is not None
    return {
        "metric": metric,
        "mode": mode,
        "value": r.metrics[metric],
        "trial": t.key,
        "label": r.label,
        "request_id": r.id,
        "step": r.step,
    }


class DashboardViews:
    def __init__(self, service: MasterService) -> None:
        self.svc = service
        self.store = service.store
        self.activity = ActivityReader(service.store.db)
        self.curves = CurveService(service)
        # per study, built from its requests alone and kept while they are unchanged (``cache``): the
        # study page but its stats, and the studies list's row but its stats and times
        self.pages: VersionedCache[dict[str, Any]] = VersionedCache(size=16)
        self.rows: VersionedCache[dict[str, Any]] = VersionedCache(size=1024)

    # -- studies --------------------------------------------------------------------------------------

    def studies(self, who: Principal) -> list[dict[str, Any]]:
        studies = self.svc.list_studies(who)
        times = self.activity.study_times([s.id for s in studies])
        now = time.time()
        out = []
        for st in studies:
            version = self.activity.request_version(st.id)
            row = self.rows.get(st.id, version, functools.partial(self._study_row, who, st.id))
            stats = self.svc.study_stats(who, st.id)
            state = row["state"]
            t = times.get(st.id)
            first = t.first_request_at if t is not None else None
            end = now if state in ("running", "waiting") else (t.last_done_at if t is not None else None)
            out.append(
                {
                    "id": st.id,
                    "name": st.name,
                    "owner": st.owner,
                    "created_at": st.created_at,
                    "first_request_at": first,
                    "last_done_at": t.last_done_at if t is not None else None,
                    "duration_s": None if first is None or end is None else round(max(0.0, end - first), 1),
                    **row,
                    "merge_rate": round(stats.merge_rate, 3),
                    "steps_executed": stats.steps_executed,
                    "saved_steps": stats.saved_steps,
                    "saved_seconds": round(stats.saved_seconds, 1),
                }
            )
        return out

    def _study_row(self, who: Principal, study_id: str) -> dict[str, Any]:
        """What the studies list shows of a study's requests."""
        reqs = self.svc.get_requests(who, study_id, None)
        counts = Counter(str(r.state) for r in reqs)
        trials = group_trials(reqs)
        return {
            "state": study_state(counts),
            "counts": {s.value: counts.get(s.value, 0) for s in RequestState},
            "trials": len(trials),
            "trial_counts": dict(Counter(str(trial_state(tr.rungs)) for tr in trials)),
            "best": best_of(trials),
        }

    # -- one study ------------------------------------------------------------------------------------

    def _configs(self, reqs: Sequence[RequestRecord]) -> tuple[dict[int, Config], dict[int, SearchPlan]]:
        configs: dict[int, Config] = {}
        plans: dict[int, SearchPlan] = {}
        for pid in sorted({r.plan_id for r in reqs}):
            nodes = {r.node for r in reqs if r.plan_id == pid}
            plan = plans[pid] = self.svc.plans.ensure(pid, nodes)
            configs.update({n: plan.nodes[n].config for n in nodes})
        return configs, plans

    def study(self, who: Principal, study_id: str) -> dict[str, Any]:
        """The study page: its trials and what they tell, built again only when its requests changed
        (``cache``), and its sharing stats (read each time: an attempt's end moves them)."""
        st = self.svc.get_study(who, study_id)
        version = self.activity.request_version(st.id)
        page = self.pages.get(st.id, version, lambda: self._study_page(who, st))
        return {**page, "stats": self.svc.study_stats(who, st.id).to_json()}

    def _study_page(self, who: Principal, st: StudyRecord) -> dict[str, Any]:
        reqs = self.svc.get_requests(who, st.id, None)
        times = self.activity.request_times(st.id)
        configs, _ = self._configs(reqs)
        trials = group_trials(reqs)
        horizon = max((r.step for r in reqs), default=1)
        names, feats = study_features({t.key: configs[t.last.node].items for t in trials}, horizon)
        texts: dict[int, str] = {}
        rows = []
        for t in trials:
            last = t.last
            if last.node not in texts:
                texts[last.node] = schedule_text(configs[last.node])
            best = t.best_rung()
            failed = next((r for r in reversed(t.rungs) if r.state is RequestState.FAILED and r.error), None)
            rows.append(
                {
                    "key": t.key,
                    "label": last.label,
                    "request_id": t.rungs[0].id,
                    "state": str(trial_state(t.rungs)),
                    "node": last.node,
                    "step": last.step,
                    "metrics": _metrics_json(best.metrics if best is not None else None),
                    "metric_step": best.step if best is not None else None,
                    "rungs": [
                        {
                            "request_id": r.id,
                            "step": r.step,
                            "state": str(r.state),
                            "metrics": _metrics_json(r.metrics),
                            "done_at": times.get(r.id, (0.0, None))[1],
                        }
                        for r in t.rungs
                    ],
                    "schedule": texts[last.node],
                    "features": feats[t.key],
                    "error": parse_failure(failed.error).headline if failed is not None and failed.error else "",
                    "started_at": times.get(t.rungs[0].id, (None, None))[0],
                }
            )
        metrics = sorted({k for r in reqs if r.metrics for k in r.metrics})
        counts = Counter(str(r.state) for r in reqs)
        return {
            "study": {"id": st.id, "name": st.name, "owner": st.owner, "created_at": st.created_at},
            "state": study_state(counts),
            "counts": dict(counts),
            "trial_counts": dict(Counter(row["state"] for row in rows)),
            "metrics": metrics,
            "modes": {m: metric_mode(m) for m in metrics},
            "features": names,
            "importance": self._importance(trials, feats, metrics),
            "best": best_of(trials),
            "trials": rows,
        }

    @staticmethod
    def _importance(
        trials: Sequence[Trial], feats: Mapping[str, Mapping[str, Any]], metrics: Sequence[str]
    ) -> dict[str, dict[str, float]]:
        """metric -> feature -> its share of the importance, over the trials with that metric."""
        out: dict[str, dict[str, float]] = {}
        for m in metrics:
            rows, ys = [], []
            for t in trials:
                r = t.best_rung()
                v = _finite((r.metrics or {}).get(m)) if r is not None else None
                if v is not None:
                    rows.append(feats[t.key])
                    ys.append(v)
            if rows:
                out[m] = {f: round(x, 4) for f, x in importance(rows, ys).items()}
        return out

    def eval_metrics(self, who: Principal, study_id: str) -> list[str]:
        """The evaluation metrics the study's answered requests hold."""
        return sorted({k for r in self.svc.get_requests(who, study_id, None) if r.metrics for k in r.metrics})

    def eval_curves(self, who: Principal, study_id: str, metric: str) -> list[dict[str, Any]]:
        """Each trial's rungs with ``metric``: ``[step, value, when answered]`` (a diverged value is left out,
        as on the step curves)."""
        st = self.svc.get_study(who, study_id)
        reqs = self.svc.get_requests(who, study_id, None)
        times = self.activity.request_times(st.id)
        out = []
        for t in group_trials(reqs):
            points = []
            for r in t.rungs:
                v = _finite((r.metrics or {}).get(metric)) if r.state is RequestState.DONE else None
                if v is not None:
                    points.append((r.step, v, times.get(r.id, (0.0, None))[1]))
            if points:
                out.append({"key": t.key, "node": t.last.node, "state": str(trial_state(t.rungs)), "points": points})
        return out

    # -- one trial ------------------------------------------------------------------------------------

    def trial(
        self, who: Principal, study_id: str, label: str | None = None, request_id: int | None = None
    ) -> dict[str, Any]:
        """One trial, named by its label or by one of its requests' ids."""
        if (label is None) == (request_id is None):
            raise InvalidArgument("name the trial by label or by request_id (one of the two)")
        if request_id is not None:
            check_id(request_id, "request_id")
        st = self.svc.get_study(who, study_id)
        reqs = self.activity.request_heads(st.id)  # the others' metrics are not needed: read its own below
        if request_id is not None:
            r0 = next((r for r in reqs if r.id == request_id), None)
            if r0 is None:
                raise NotFound(f"request {request_id} does not exist in study {study_id!r}")
            key = trial_key(r0)
        else:
            key = label or ""
        trials = {t.key: t for t in group_trials(reqs)}
        if key not in trials or (label is not None and not label):
            raise NotFound(f"trial {key!r} does not exist in study {study_id!r}")
        t = Trial(key, self.svc.get_requests(who, study_id, [r.id for r in trials[key].rungs]))
        t.rungs.sort(key=lambda r: (r.step, r.id))
        last = t.last
        configs, plans = self._configs(reqs)
        plan = plans[last.plan_id]
        config = configs[last.node]
        times = self.activity.request_times(st.id)
        trained = max((r.step for r in t.rungs if r.state is RequestState.DONE), default=0)
        horizon = max(r.step for r in t.rungs)
        study_horizon = max(r.step for r in reqs)
        _, feats = study_features({k: configs[x.last.node].items for k, x in trials.items()}, study_horizon)
        failed = next((r for r in reversed(t.rungs) if r.state is RequestState.FAILED and r.error), None)
        curve = self.curves.trial_curve(who, study_id, last.id, max_points=TRIAL_CURVE_POINTS)
        batches = sorted({r.batch_id for r in t.rungs if r.batch_id is not None})
        attempts = [a for a in self.activity.attempts(batches) if a.plan_id == last.plan_id]
        return {
            "study": {"id": st.id, "name": st.name},
            "key": t.key,
            "label": last.label,
            "state": str(trial_state(t.rungs)),
            "plan_id": last.plan_id,
            "node": last.node,
            "step": horizon,
            "trained": trained,
            "features": feats.get(t.key, {}),
            "schedule": {
                "text": schedule_text(config),
                "horizon": study_horizon,
                "hps": [_schedule_plot(name, segs, study_horizon) for name, segs in config.items],
            },
            "rungs": [
                {
                    "request_id": r.id,
                    "step": r.step,
                    "state": str(r.state),
                    "node": r.node,
                    "metrics": _metrics_json(r.metrics),
                    "error": r.error or "",
                    "batch_id": r.batch_id,
                    "created_at": times.get(r.id, (None, None))[0],
                    "done_at": times.get(r.id, (None, None))[1],
                }
                for r in t.rungs
            ],
            "failure": parse_failure(failed.error).to_json() if failed is not None and failed.error else None,
            "curve": {
                "total": curve.total,
                "points": [[p.step, _metrics_json(p.values)] for p in curve.points],
            },
            "attempts": [
                {
                    "batch_id": a.batch_id,
                    "attempt": a.attempt,
                    "node_manager": a.node_manager_id,
                    "slot": a.slot_ids[0],
                    "slots": list(a.slot_ids),
                    "state": a.state,
                    "dispatched_at": a.dispatched_at,
                    "started_at": a.started_at,
                    "finished_at": a.finished_at,
                }
                for a in attempts
            ],
            "path": _shared_path(plan, last, [x for x in reqs if x.plan_id == last.plan_id], t.key),
        }


def _schedule_plot(name: str, segments: Any, horizon: int) -> dict[str, Any]:
    """One hyper-parameter's schedule over ``[0, horizon]``: its text, its segments and, when numeric,
    its value at evenly spread steps and at every boundary (where it jumps)."""
    end = max(1, horizon)
    numeric = segments[0].params[0] in ("float", "int")
    points: list[list[float]] = []
    if numeric:
        steps = {round(i * end / SCHEDULE_SAMPLES) for i in range(SCHEDULE_SAMPLES + 1)}
        for b in boundaries(segments, end):
            steps.update((max(0, b - 1), b))
        points = [[s, float(value_at(segments, s))] for s in sorted(x for x in steps if 0 <= x <= end)]
    return {
        "name": name,
        "text": _sequence_text(segments),
        "numeric": numeric,
        "points": points,
    }


def _shared_path(
    plan: SearchPlan, leaf: RequestRecord, reqs: Sequence[RequestRecord], key: str
) -> list[dict[str, Any]]:
    """The trial's path through the plan, piece by piece, each with the other trials that ran the same
    steps: a trial shares a piece's steps up to where its own path leaves the node."""
    reach: dict[int, dict[str, int]] = defaultdict(dict)  # node -> trial -> the furthest step it trains there
    for r in reqs:
        k = trial_key(r)
        for node, _a, b in plan.path(Point(r.node, r.step)):
            if reach[node].get(k, -1) < b:
                reach[node][k] = b
    out = []
    for node, a, b in plan.path(Point(leaf.node, leaf.step)):
        others = sorted((k for k, top in reach[node].items() if k != key and top > a), key=_label_order)
        upto = {k: min(b, reach[node][k]) for k in others}
        out.append(
            {
                "node": node,
                "start": a,
                "end": b,
                "shared_with": len(others),
                "shared_steps": max(upto.values(), default=a) - a,
                "trials": [{"key": k, "until": upto[k]} for k in others[:SHARED_LABELS]],
            }
        )
    return out


def _label_order(k: str) -> tuple[str, int]:
    """``trial-10`` after ``trial-9``."""
    head = k.rstrip("0123456789")
    tail = k[len(head) :]
    return (head, int(tail) if tail else -1)
