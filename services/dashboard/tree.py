"""What the Stage tree page shows: a study's plan as nodes laid out by step, each with what happened to it.

A node's state is its own, not its trials': ``running`` while a batch on a slot trains it, ``done``
when the steps any trial asked of it were trained (evidence: a metric or checkpoint on it, a finished
request through it, a child trained from it, a running batch past them), and otherwise what became of
the trials that wanted more of it than was trained: ``waiting`` while one still does, ``failed``,
``cancelled`` (``idle``: nothing asks for it any more and nothing was trained).
So a shared root that carried thirty trials is done even when a trial below it failed; the failure is
that trial's, on its own node. The list is light (a 10,000-node plan answers in a fraction of a
second); a node's schedule, checkpoints, evaluations and trials come with ``node``, when it is opened.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stagetree.core.errors import NotFound
from stagetree.core.failures import parse_failure
from stagetree.core.lifecycle import RequestState
from stagetree.core.searchplan import SearchPlan
from stagetree.dashboard.cache import VersionedCache
from stagetree.dashboard.cluster import occupancy
from stagetree.dashboard.views import Trial, _metrics_json, group_trials, schedule_text, trial_state
from stagetree.master.auth import Principal
from stagetree.master.service import MasterService
from stagetree.master.store.activity import ActivityReader, RunningBatch
from stagetree.master.store.records import RequestRecord

NODE_TRIALS = 500  # trials listed in a node's panel (the count is always whole)


@dataclass(frozen=True)
class NodeFacts:
    end: int  # how far the node reaches: its requests, evaluations, checkpoints, children's starts
    trained: int  # the furthest step known trained on it
    state: str
    progress: float | None  # of a running or partly trained node: the share of its span trained


def node_facts(
    plan: SearchPlan,
    reqs: Sequence[RequestRecord],
    metric_steps: Mapping[int, Sequence[int]],
    checkpoint_steps: Mapping[int, Sequence[int]],
    running: Sequence[RunningBatch],
) -> dict[int, NodeFacts]:
    """Each node's reach, what was trained of it and its own state (see the module doc); ``running``:
    the plan's batches that occupy a slot (not those sent ahead, which wait for theirs to free). A
    request speaks for a node only where it wants more of it than was trained: one that branches
    below the trained steps says nothing of the node."""
    nodes = plan.nodes
    end = {n.id: n.start for n in nodes.values()}
    trained = {n.id: n.start for n in nodes.values()}
    for marks in (metric_steps, checkpoint_steps):
        for nid, steps in marks.items():
            if nid in nodes and steps:
                top = max(steps)
                if top > end[nid]:
                    end[nid] = trained[nid] = top
                elif top > trained[nid]:
                    trained[nid] = top
    paths: list[tuple[RequestState, list[tuple[int, int]]]] = []
    for r in reqs:
        if r.node not in nodes:
            continue
        path = _reach(nodes, r.node, r.step)
        paths.append((r.state, path))
        answered = r.state is RequestState.DONE
        for node, b in path:
            if b > end[node]:
                end[node] = b
            if answered and b > trained[node]:
                trained[node] = b
    active: dict[int, float] = {}
    for batch in running:
        for node, a, z in batch.stages:
            if node not in nodes:
                continue
            if a > nodes[node].start:
                trained[node] = max(trained[node], a)  # its start checkpoint exists
            done = max(a, min(z, batch.step))
            trained[node] = max(trained[node], done)
            active[node] = max(active.get(node, 0.0), 1.0 if z <= a else (done - a) / (z - a))
    for nid in sorted(nodes, reverse=True):  # children before parents: ids grow down the tree
        n = nodes[nid]
        if n.parent is not None and n.parent in nodes:
            end[n.parent] = max(end[n.parent], n.start)
            if trained[nid] > n.start or nid in active:
                trained[n.parent] = max(trained[n.parent], n.start)
    wants: dict[int, set[RequestState]] = defaultdict(set)  # what became of those that wanted more of it
    for rstate, path in paths:
        for node, b in path:
            if b > trained[node]:
                wants[node].add(rstate)
    out: dict[int, NodeFacts] = {}
    for nid, n in nodes.items():
        span = end[nid] - n.start
        share = 1.0 if span <= 0 else min(1.0, (trained[nid] - n.start) / span)
        partly = round(share, 3) if 0 < share < 1 else None
        fate = wants[nid]
        state: str
        progress: float | None
        if nid in active:
            state, progress = "running", round(active[nid], 3)
        elif fate & {RequestState.SCHED, RequestState.NOT_SCHED}:
            state, progress = "waiting", partly
        elif RequestState.FAILED in fate:
            state, progress = "failed", partly
        elif RequestState.CANCELLED in fate:
            state, progress = "cancelled", partly
        elif trained[nid] > n.start or RequestState.DONE in fate:
            state, progress = "done", None
        else:  # nothing asked of it any more and nothing trained (its requests were forgotten)
            state, progress = "idle", None
        out[nid] = NodeFacts(end[nid], trained[nid], state, progress)
    return out


def _reach(nodes: Mapping[int, Any], node: int, step: int) -> list[tuple[int, int]]:
    """``(node, the step the path reaches on it)`` along the path to ``(node, step)``, from its end up
    (``SearchPlan.path`` without the start of each piece)."""
    out = []
    at: int | None = node
    while at is not None:
        n = nodes[at]
        if step > n.start:
            out.append((at, step))
        step, at = n.start, n.parent
    return out


class TreeViews:
    def __init__(self, service: MasterService) -> None:
        self.svc = service
        self.store = service.store
        self.activity = ActivityReader(service.store.db)
        self.trees: VersionedCache[bytes] = VersionedCache(size=16)  # (study, plan key) -> ``tree`` as JSON

    def _running(self, plan_id: int) -> list[RunningBatch]:
        """The plan's batches that occupy a slot."""
        occupants = [occ for occ, _ahead in occupancy(self.activity.running_batches()).values()]
        return list({b.batch_id: b for b in occupants if b.plan_id == plan_id}.values())

    def _read(
        self, who: Principal, study_id: str, plan_key: str, running: list[RunningBatch] | None = None
    ) -> tuple[str, int, SearchPlan, list[RequestRecord], dict[int, NodeFacts], Any]:
        key, pid = self.svc.study_plan(who, study_id, plan_key)  # the caller's study, or NotFound
        plan = self.svc.plans.refresh(pid)
        reqs = [r for r in self.activity.request_heads(study_id) if r.plan_id == pid]
        ckpts, mets, changed = self.store.plans.plan_marks(pid)
        facts = node_facts(plan, reqs, mets, ckpts, self._running(pid) if running is None else running)
        return key, pid, plan, reqs, facts, (ckpts, mets, changed)

    def tree_json(self, who: Principal, study_id: str, plan_key: str = "") -> bytes:
        """``tree`` as JSON, built again only when the study's requests, the plan's nodes, checkpoints,
        evaluations or path changes changed, and never kept while a batch of the plan runs (its
        progress is on the tree): see ``cache``. 10,000 nodes take most of a second to read and build."""
        key, pid = self.svc.study_plan(who, study_id, plan_key)  # the caller's study, or NotFound
        version = (
            len(self.svc.plans.refresh(pid).nodes),
            self.activity.request_version(study_id),
            self.activity.plan_marks_version(pid),
        )
        running = self._running(pid)
        return self.trees.get(
            (study_id, key),
            version,
            lambda: json.dumps(self.tree(who, study_id, key, running), separators=(",", ":")).encode(),
            cacheable=not running,
        )

    def tree(
        self, who: Principal, study_id: str, plan_key: str = "", running: list[RunningBatch] | None = None
    ) -> dict[str, Any]:
        key, _pid, plan, reqs, facts, (ckpts, mets, changed) = self._read(who, study_id, plan_key, running)
        through: dict[int, set[str]] = defaultdict(set)
        trials = []
        for t in group_trials(reqs):
            last = t.last
            for r in t.rungs:
                at: int | None = r.node
                while at is not None and t.key not in through[at]:
                    through[at].add(t.key)
                    at = plan.nodes[at].parent
            trials.append({"key": t.key, "node": last.node, "step": last.step, "state": str(trial_state(t.rungs))})
        nodes = []
        for nid in sorted(plan.nodes):
            n, f = plan.nodes[nid], facts[nid]
            nodes.append(
                {
                    "id": nid,
                    "parent": n.parent,
                    "start": n.start,
                    "end": f.end,
                    "trained": f.trained,
                    "state": f.state,
                    "progress": f.progress,
                    "checkpoints": sorted(ckpts.get(nid, [])),
                    "evals": len(mets.get(nid, [])),
                    "trials": len(through[nid]),
                    "rescaled": nid in changed,
                }
            )
        return {"key": key, "nodes": nodes, "trials": trials}

    def node(self, who: Principal, study_id: str, node_id: int, plan_key: str = "") -> dict[str, Any]:
        """One node in full: its schedule on its span, checkpoints, evaluations, curve points, path
        changes, and the study's trials that pass through it (how far each trains on it, its state, its
        metrics and, for a failed one, what was raised)."""
        key, _pid, plan, heads, facts, (ckpts, mets, _changed) = self._read(who, study_id, plan_key)
        n = plan.nodes.get(node_id)
        if n is None:
            raise NotFound(f"node {node_id} is not in the study's plan {key!r}")
        f = facts[node_id]
        through: list[tuple[Trial, int]] = []  # the trials through it, how far each trains on it
        for t in group_trials(heads):
            until = None
            for r in t.rungs:
                for node, b in _reach(plan.nodes, r.node, r.step):
                    if node == node_id and (until is None or b > until):
                        until = b
            if until is not None:
                through.append((t, until))
        shown = through[:NODE_TRIALS]  # their metrics and errors: read for those listed only
        full = {r.id: r for r in self.svc.get_requests(who, study_id, [r.id for t, _ in shown for r in t.rungs])}
        rows = []
        for head, until in shown:
            t = Trial(head.key, [full.get(r.id, r) for r in head.rungs])
            best = t.best_rung()
            failed = next((r for r in reversed(t.rungs) if r.state is RequestState.FAILED and r.error), None)
            rows.append(
                {
                    "key": t.key,
                    "label": t.last.label,
                    "state": str(trial_state(t.rungs)),
                    "step": t.last.step,
                    "until": until,
                    "ends_here": t.last.node == node_id,
                    "metrics": _metrics_json(best.metrics if best is not None else None),
                    "error": parse_failure(failed.error).headline if failed is not None and failed.error else "",
                }
            )
        evals = {}
        for s in sorted(mets.get(node_id, [])):
            evals[str(s)] = _metrics_json(self.store.requests.metrics_at(node_id, s))
        changes = self.store.paths.of_nodes([node_id]).get(node_id, [])
        return {
            "id": node_id,
            "parent": n.parent,
            "start": n.start,
            "end": f.end,
            "trained": f.trained,
            "state": f.state,
            "progress": f.progress,
            "schedule": schedule_text(n.config),
            "checkpoints": sorted(ckpts.get(node_id, [])),
            "evals": evals,
            "curve_points": self.store.curves.counts([node_id]).get(node_id, 0),
            "path_changes": [c.to_json() for c in changes],
            "children": sorted(c for cs in n.children.values() for c in cs),
            "trial_count": len(through),
            "trials": rows,
        }
