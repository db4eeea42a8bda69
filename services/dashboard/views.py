"""What each dashboard page shows, as JSON-ready dicts built from the master's service layer.

Owns the pages' data, not their drawing: the studies list (state counts, best metric, merge rate,
compute saved), a study (its trials with readable schedules, its metrics, the best trial), its stage
tree (the plan's nodes with state, span, checkpoints, curve points, trials and path changes: resumes on
another number of ranks), and the cluster (node managers, slots, what runs on each, recent policy
decisions). Every read goes through
``MasterService`` for visibility (another owner's study does not exist for the caller); the cluster
page shows the caller's own running work in detail and other owners' only as "busy".
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from stagetree.client.cli import describe_config
from stagetree.core.config import Config
from stagetree.core.lifecycle import RequestState
from stagetree.master.auth import Principal
from stagetree.master.service import MasterService
from stagetree.master.store.activity import ActivityReader
from stagetree.master.store.policy_state import PolicyStateStore
from stagetree.master.store.records import RequestRecord

MAX_DECISIONS = 50


def metric_mode(name: str) -> str:
    """Whether a smaller (``min``: losses, errors, perplexities) or a larger value is better."""
    low = name.lower()
    return "min" if any(w in low for w in ("loss", "err", "perplex", "mse", "mae", "rmse", "time")) else "max"


def best_of(requests: Sequence[RequestRecord], metric: str | None = None) -> dict[str, Any] | None:
    """The best finished request by ``metric`` (default: the first metric name, accuracy-like ones
    first), ``{"metric", "mode", "value", "request_id", "label", "step"}``; None when none has it."""
    names = sorted({k for r in requests if r.metrics for k in r.metrics})
    if not names:
        return None
    if metric is None:
        maxes = [n for n in names if metric_mode(n) == "max"]
        metric = (maxes or names)[0]
    mode = metric_mode(metric)
    best: RequestRecord | None = None
    key = -math.inf
    for r in requests:
        v = (r.metrics or {}).get(metric)
        if r.state is not RequestState.DONE or v is None or math.isnan(v):
            continue
        k = v if mode == "max" else -v
        if best is None or k > key:
            best, key = r, k
    if best is None or best.metrics is None:
        return None
    return {
        "metric": metric,
        "mode": mode,
        "value": best.metrics[metric],
        "request_id": best.id,
        "label": best.label,
        "step": best.step,
    }


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v)
    return None


class DashboardViews:
    def __init__(self, service: MasterService) -> None:
        self.svc = service
        self.store = service.store
        self.activity = ActivityReader(service.store.db)
        self.policy_states = PolicyStateStore(service.store.db)

    # -- studies --------------------------------------------------------------------------------------

    def studies(self, who: Principal) -> list[dict[str, Any]]:
        out = []
        for st in self.svc.list_studies(who):
            reqs = self.svc.get_requests(who, st.id, None)
            stats = self.svc.study_stats(who, st.id)
            counts = Counter(str(r.state) for r in reqs)
            out.append(
                {
                    "id": st.id,
                    "name": st.name,
                    "owner": st.owner,
                    "created_at": st.created_at,
                    "counts": {s.value: counts.get(s.value, 0) for s in RequestState},
                    "trials": len({r.label or f"r{r.id}" for r in reqs}),
                    "best": best_of(reqs),
                    "merge_rate": round(stats.merge_rate, 3),
                    "steps_executed": stats.steps_executed,
                    "saved_steps": stats.saved_steps,
                    "saved_seconds": round(stats.saved_seconds, 1),
                }
            )
        return out

    # -- one study ------------------------------------------------------------------------------------

    def study(self, who: Principal, study_id: str) -> dict[str, Any]:
        st = self.svc.get_study(who, study_id)
        reqs = self.svc.get_requests(who, study_id, None)
        stats = self.svc.study_stats(who, study_id)
        configs: dict[int, Config] = {}
        for pid in sorted({r.plan_id for r in reqs}):
            plan = self.svc.plans.ensure(pid, {r.node for r in reqs if r.plan_id == pid})
            configs.update({n: plan.nodes[n].config for n in {r.node for r in reqs if r.plan_id == pid}})
        texts: dict[tuple[int, int], str] = {}
        trials = []
        hp_names: set[str] = set()
        for r in reqs:
            cfg = configs[r.node]
            key = (r.node, r.step)
            if key not in texts:
                texts[key] = describe_config(cfg.to_json(), 0, max(1, r.step))
            hp = {k: _num(v) for k, v in cfg.values_at(max(0, r.step - 1)).items()}
            hp_names.update(hp)
            trials.append(
                {
                    "request_id": r.id,
                    "label": r.label,
                    "state": str(r.state),
                    "node": r.node,
                    "step": r.step,
                    "metrics": r.metrics or {},
                    "error": r.error or "",
                    "schedule": texts[key],
                    "hp": hp,
                }
            )
        metrics = sorted({k for r in reqs if r.metrics for k in r.metrics})
        return {
            "study": {"id": st.id, "name": st.name, "owner": st.owner, "created_at": st.created_at},
            "stats": stats.to_json(),
            "counts": dict(Counter(str(r.state) for r in reqs)),
            "metrics": metrics,
            "hp_names": sorted(hp_names),
            "best": best_of(reqs),
            "trials": trials,
        }

    # -- the stage tree -------------------------------------------------------------------------------

    def tree(self, who: Principal, study_id: str, plan_key: str = "") -> dict[str, Any]:
        view = self.svc.get_plan(who, study_id, plan_key)
        reqs = self.svc.get_requests(who, study_id, None)
        node_ids = [n.id for n in view.nodes]
        curve_counts = self.store.curves.counts(node_ids)
        parent = {n.id: n.parent for n in view.nodes}
        children: dict[int, list[int]] = defaultdict(list)
        for n in view.nodes:
            if n.parent is not None:
                children[n.parent].append(n.id)
        # how far each node reaches: its own requests, evaluations, checkpoints and its children's starts
        start = {n.id: n.start for n in view.nodes}
        end = {n.id: max([n.start, *n.metrics, *n.checkpoints]) for n in view.nodes}
        for n in view.nodes:
            for c in children[n.id]:
                end[n.id] = max(end[n.id], start[c])
        by_node: dict[int, list[RequestRecord]] = defaultdict(list)
        for r in reqs:
            by_node[r.node].append(r)
            end[r.node] = max(end.get(r.node, 0), r.step)
        # a node's trials: the requests whose path passes through it
        through: dict[int, list[int]] = defaultdict(list)
        states: dict[int, Counter[str]] = defaultdict(Counter)
        for r in reqs:
            at: int | None = r.node
            while at is not None:
                through[at].append(r.id)
                states[at][str(r.state)] += 1
                at = parent.get(at)
        # nodes a running batch trains, and how far it has got on each (from its curve points)
        progress: dict[int, float] = {}
        plans = {r.plan_id for r in reqs}
        for b in self.activity.running_batches():
            if b.plan_id not in plans:
                continue
            for node, a, z in b.stages:
                done = 1.0 if b.step >= z else max(0.0, (b.step - a) / (z - a)) if z > a else 0.0
                progress[node] = max(progress.get(node, 0.0), done)
        running = set(progress)
        nodes = []
        for n in view.nodes:
            nodes.append(
                {
                    "id": n.id,
                    "parent": n.parent,
                    "start": n.start,
                    "end": end[n.id],
                    "steps": end[n.id] - n.start,
                    "state": _node_state(states[n.id], n.id in running),
                    "progress": round(progress[n.id], 3) if n.id in running else None,
                    "requests": n.requests,
                    "checkpoints": n.checkpoints,
                    "metric_steps": n.metrics,
                    "curve_points": curve_counts.get(n.id, 0),
                    "path_changes": [c.to_json() for c in n.path_changes],
                    "trials": sorted(through[n.id]),
                    "schedule": describe_config(json.loads(n.config_json), n.start, end[n.id] or None),
                }
            )
        return {"key": view.key, "nodes": nodes}

    # -- the cluster ----------------------------------------------------------------------------------

    def cluster(self, who: Principal, telemetry: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
        running = self.activity.running_batches()
        mine = {b.batch_id for b in running if who.admin or b.scope == who.scope}
        by_slot = {(b.node_manager_id, b.slot_id): b for b in running}
        nms = []
        for nm in self.store.nodes.node_managers():
            slots = []
            for s in nm.slots:
                b = by_slot.get((nm.id, s.id))
                work: dict[str, Any] | None = None
                if b is not None:
                    work = {"busy": True}
                    if b.batch_id in mine:
                        first, last = b.stages[0] if b.stages else (0, 0, 0), b.stages[-1] if b.stages else (0, 0, 0)
                        work.update(
                            batch_id=b.batch_id,
                            attempt=b.attempt,
                            nodes=[x[0] for x in b.stages],
                            start=first[1],
                            end=last[2],
                            step=max(b.step, first[1]),
                        )
                slots.append(
                    {
                        "id": s.id,
                        "gpu_type": s.gpu_type,
                        "gpu_index": s.gpu_index,
                        "share": s.share,
                        "cpu_cores": s.cpu_cores,
                        "work": work,
                    }
                )
            nms.append(
                {
                    "id": nm.id,
                    "address": nm.address,
                    "state": str(nm.state),
                    "last_heartbeat": nm.last_heartbeat,
                    "slots": slots,
                    "gpus": [dict(t) for t in telemetry if t.get("node_manager") == nm.id],
                }
            )
        return {"node_managers": nms, "decisions": self.decisions(who)}

    def decisions(self, who: Principal) -> list[dict[str, Any]]:
        """Recent policy decisions on the caller's studies: trials a policy cancelled (POP kills, with
        their reasons), batches being preempted (Hermes), and the requests whose work failed."""
        out: list[dict[str, Any]] = []
        studies = self.svc.list_studies(who)
        states = self.policy_states.load([s.id for s in studies])
        for st in studies:
            snap = states.get(st.id, {})
            for b in (snap.get("hermes") or {}).get("preempting", []):
                out.append({"study": st.name, "kind": "preempt", "what": f"batch {b}", "reason": "time quantum"})
            for k in (snap.get("pending") or {}).get("kills", []):
                out.append({"study": st.name, "kind": "kill", "what": k.get("job"), "reason": k.get("reason", "")})
            for r in self.svc.get_requests(who, st.id, None):
                if r.state in (RequestState.CANCELLED, RequestState.FAILED) and r.error:
                    kind = "kill" if r.state is RequestState.CANCELLED else "failed"
                    out.append(
                        {
                            "study": st.name,
                            "kind": kind,
                            "what": r.label or f"request {r.id}",
                            "reason": r.error.splitlines()[0][:200],
                        }
                    )
        return out[-MAX_DECISIONS:]


def _node_state(states: Mapping[str, int], running: bool) -> str:
    if running:
        return "running"
    if states.get("SCHED"):
        return "running"
    if states.get("NOT_SCHED"):
        return "pending"
    if states.get("FAILED"):
        return "failed"
    if states.get("DONE"):
        return "done"
    if states.get("CANCELLED"):
        return "cancelled"
    return "pending"
