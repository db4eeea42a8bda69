"""Stage trees (TreeML Algorithm 1): the transient scheduling view of a search plan.

Every unscheduled request point walks up the plan to the nearest point a model can be had from: an
existing checkpoint, a point an in-flight batch will save (a *promise*), or a fresh model at a root.
Walks are memoized, so shared prefixes are visited once. The points met on each node are then sorted
and chained; each link ``(n, a) -> (n, b)`` is a stage "load the model at a, train node n's config to
b". A stage whose source is a promise is not runnable until that checkpoint exists.

In-flight batches matter twice: a request whose point lies ahead of a running batch is *attached* to
it (the master asks the batch to also evaluate/save there: an amendment), and a request past a
running batch's end starts from the checkpoint that batch will leave. Either way no step is trained
twice while its model is on its way. A batch that keeps a *snapshot* of every step it trains (a small
model: ``InflightBatch.snapshots``, written when it ends) also covers the points it has already passed:
a request that branches there waits for that snapshot instead of training the prefix again.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from stagetree.core.batch import Point


@dataclass(frozen=True)
class InflightStage:
    """A stage of a running batch: node ``node`` trained over (start, end]; ``progress`` is the step the
    worker has reached on it (``start`` if not begun, ``end`` once past)."""

    node: int
    start: int
    end: int
    progress: int


@dataclass(frozen=True)
class InflightBatch:
    """A running batch; ``snapshots``: it leaves a checkpoint at every step of its stages when it ends."""

    id: int
    stages: tuple[InflightStage, ...]
    saves: frozenset[Point] = frozenset()
    snapshots: bool = False


@dataclass(frozen=True)
class NodeInfo:
    parent: int | None
    start: int


class Stage:
    """Train node ``node``'s config from ``start`` to ``end``. Root stages load ``source``."""

    __slots__ = ("children", "end", "id", "node", "parent", "plan", "ready", "requests", "source", "start")

    def __init__(self, sid: int, plan: str, node: int, start: int, end: int) -> None:
        self.id = sid
        self.plan = plan
        self.node = node
        self.start = start
        self.end = end
        self.parent: int | None = None
        self.children: list[int] = []
        self.source: Point | None = None
        self.ready = False
        self.requests: list[int] = []

    @property
    def steps(self) -> int:
        return self.end - self.start

    @property
    def end_point(self) -> Point:
        return Point(self.node, self.end)

    def __repr__(self) -> str:
        src = f" src={self.source}" if self.source else ""
        return f"Stage({self.id}: n{self.node} {self.start}->{self.end}{src})"


@dataclass
class StageForest:
    stages: list[Stage] = field(default_factory=list)
    roots: list[int] = field(default_factory=list)
    attachments: dict[int, int] = field(default_factory=dict)  # request id -> in-flight batch
    amendments: dict[Point, int] = field(default_factory=dict)  # point to add to an in-flight batch

    def extend(self, other: StageForest) -> None:
        offset = len(self.stages)
        for s in other.stages:
            s.id += offset
            if s.parent is not None:
                s.parent += offset
            s.children = [c + offset for c in s.children]
            self.stages.append(s)
        self.roots.extend(r + offset for r in other.roots)
        self.attachments.update(other.attachments)
        self.amendments.update(other.amendments)


_ORIGIN = -1  # source kind markers
_READY = 1
_PROMISED = 0


def build_stage_tree(
    nodes: Mapping[int, NodeInfo] | Mapping[int, object],
    checkpoints: Mapping[int, Sequence[int]],
    pending: Iterable[tuple[int, Point]],
    inflight: Iterable[InflightBatch] = (),
    plan: str = "",
) -> StageForest:
    """Algorithm 1, memoized. ``nodes`` maps node id to anything with ``parent`` and ``start``;
    ``checkpoints`` maps node id to its sorted checkpoint steps; ``pending`` is (request id, canonical
    point) of the NOT_SCHED requests."""
    cover: dict[int, list[tuple[int, int, int, int]]] = {}  # node -> [(lo, end, batch, progress)]
    planned: set[Point] = set()
    snapshotting: set[int] = set()
    for b in inflight:
        planned.update(b.saves)
        if b.snapshots:
            snapshotting.add(b.id)
        for ist in b.stages:
            lo = ist.start if b.snapshots else max(ist.start, ist.progress)
            cover.setdefault(ist.node, []).append((lo, ist.end, b.id, ist.progress))

    sources: dict[Point, int] = {}  # point -> _READY / _PROMISED / _ORIGIN
    needed: set[Point] = set()
    eval_only: set[Point] = set()
    amend: dict[Point, int] = {}
    promised_by: dict[Point, int] = {}

    def has_ckpt(p: Point) -> bool:
        steps = checkpoints.get(p.node)
        if not steps:
            return False
        i = bisect.bisect_left(steps, p.step)
        return i < len(steps) and steps[i] == p.step

    def covering(p: Point) -> int | None:
        for lo, end, batch, _ in cover.get(p.node, ()):
            if lo < p.step <= end:
                return batch
        return None

    def promise(p: Point, batch: int) -> None:
        sources[p] = _PROMISED
        promised_by[p] = batch
        if p not in planned and batch not in snapshotting:
            amend[p] = batch

    def walk(p: Point) -> None:
        while True:
            if p in needed or p in sources:
                return
            if has_ckpt(p):
                sources[p] = _READY
                return
            batch = covering(p)
            if batch is not None:
                promise(p, batch)
                return
            needed.add(p)
            info = nodes[p.node]
            start: int = info.start  # type: ignore[attr-defined]
            best = -1
            best_batch: int | None = None
            steps = checkpoints.get(p.node)
            if steps:
                i = bisect.bisect_left(steps, p.step) - 1
                if i >= 0 and steps[i] > start:
                    best = steps[i]
            for _lo, end, batch_id, progress in cover.get(p.node, ()):
                # a point the batch has passed is still to come when it keeps every step (its pack)
                passed_ok = Point(p.node, end) in planned or batch_id in snapshotting
                if best < end < p.step and end > start and (progress < end or passed_ok):
                    best, best_batch = end, batch_id
            if best >= 0:
                q = Point(p.node, best)
                if q not in sources:
                    if best_batch is None:
                        sources[q] = _READY
                    else:
                        promise(q, best_batch)
                return
            parent: int | None = info.parent  # type: ignore[attr-defined]
            if parent is None:
                sources.setdefault(Point(p.node, 0), _ORIGIN)
                return
            p = Point(parent, start)

    req_at: dict[Point, list[int]] = {}
    for rid, p in pending:
        req_at.setdefault(p, []).append(rid)
    forest = StageForest()
    for p in req_at:
        if has_ckpt(p) or p.step == 0:  # evaluate a saved model, or a fresh one at a root
            eval_only.add(p)
            continue
        walk(p)

    for p, rids in req_at.items():
        if p in sources and sources[p] == _PROMISED:
            for rid in rids:
                forest.attachments[rid] = promised_by[p]
    forest.amendments = amend

    by_node: dict[int, list[int]] = {}
    for p in needed:
        by_node.setdefault(p.node, []).append(p.step)
    for p in sources:
        if p.node in by_node:
            by_node[p.node].append(p.step)
    for steps in by_node.values():
        steps.sort()

    stages = forest.stages
    stage_at: dict[Point, int] = {}
    for p in needed:
        sid = len(stages)
        stages.append(Stage(sid, plan, p.node, 0, p.step))
        stage_at[p] = sid
    for p in eval_only:
        sid = len(stages)
        st = Stage(sid, plan, p.node, p.step, p.step)
        st.source, st.ready = p, True
        stages.append(st)
        stage_at[p] = sid
        forest.roots.append(sid)
    for p, sid in stage_at.items():
        st = stages[sid]
        if p in eval_only:
            continue
        steps = by_node[p.node]
        i = bisect.bisect_left(steps, p.step)
        if i > 0:
            pp = Point(p.node, steps[i - 1])
        else:
            info = nodes[p.node]
            parent = info.parent  # type: ignore[attr-defined]
            pp = Point(p.node, 0) if parent is None else Point(parent, info.start)  # type: ignore[attr-defined]
        st.start = pp.step
        kind = sources.get(pp)
        if kind is not None:
            st.source = pp
            st.ready = kind != _PROMISED
            forest.roots.append(sid)
        else:
            parent_sid = stage_at[pp]
            st.parent = parent_sid
            stages[parent_sid].children.append(sid)
    for p, rids in req_at.items():
        sid2 = stage_at.get(p)
        if sid2 is not None:
            stages[sid2].requests.extend(rids)
    forest.roots.sort()
    for st in stages:
        st.children.sort()
    return forest
