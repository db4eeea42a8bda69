"""Stage trees (TreeML Algorithm 1): the transient scheduling view of a search plan.

Every unscheduled request point walks up the plan to the nearest point a model can be had from: an
existing checkpoint, a point an in-flight batch will save (a *promise*), or a fresh model at a root.
Walks are memoized, so shared prefixes are visited once. The points met on each node are then sorted
and chained; each link ``(n, a) -> (n, b)`` is a stage "load the model at a, train node n's config to
b". A stage whose source is a promise is not runnable until that checkpoint exists.

In-flight batches promise the checkpoints they will save (``saves``: their branch points and their
end): work past such a point starts from it once it is saved, so no step is trained twice while its
model is on its way. A batch that keeps a *snapshot* of every step it trains (a small model:
``InflightBatch.snapshots``, written as one pack when it ends) promises every point of its stages, those
it has passed too: work that branches there waits for that snapshot instead of training the prefix
again. Any other point a running batch passes without saving it is not promised (a running batch is
never asked to save more than it was sent with): work there starts from the nearest checkpoint before
it now rather than waiting for a model that will not be kept.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from stagetree.core.batch import Point
from stagetree.core.ids import NO_PLAN, PlanId, RequestId


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

    def __init__(self, sid: int, plan: PlanId, node: int, start: int, end: int) -> None:
        self.id = sid
        self.plan = plan
        self.node = node
        self.start = start
        self.end = end
        self.parent: int | None = None
        self.children: list[int] = []
        self.source: Point | None = None
        self.ready = False
        self.requests: list[RequestId] = []

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


_ORIGIN = -1  # source kind markers
_READY = 1
_PROMISED = 0


def build_stage_tree(
    nodes: Mapping[int, NodeInfo] | Mapping[int, object],
    checkpoints: Mapping[int, Sequence[int]],
    pending: Iterable[tuple[RequestId, Point]],
    inflight: Iterable[InflightBatch] = (),
    plan: PlanId = NO_PLAN,
) -> StageForest:
    """Algorithm 1, memoized. ``nodes`` maps node id to anything with ``parent`` and ``start``;
    ``checkpoints`` maps node id to its sorted checkpoint steps; ``pending`` is (request id, canonical
    point) of the NOT_SCHED requests."""
    cover: dict[int, list[tuple[int, int, int, bool]]] = {}  # node -> [(lo, end, progress, snapshots)]
    planned: set[Point] = set()
    snapped: dict[int, list[tuple[int, int]]] = {}  # node -> (start, end] a snapshotting batch covers
    for b in inflight:
        planned.update(b.saves)
        for ist in b.stages:
            cover.setdefault(ist.node, []).append((max(ist.start, ist.progress), ist.end, ist.progress, b.snapshots))
            if b.snapshots:
                snapped.setdefault(ist.node, []).append((ist.start, ist.end))
    planned_at: dict[int, list[int]] = {}  # node -> the steps running batches will save, sorted
    for q in sorted(planned):
        planned_at.setdefault(q.node, []).append(q.step)

    sources: dict[Point, int] = {}  # point -> _READY / _PROMISED / _ORIGIN
    needed: set[Point] = set()
    eval_only: set[Point] = set()

    def has_ckpt(p: Point) -> bool:
        steps = checkpoints.get(p.node)
        if not steps:
            return False
        i = bisect.bisect_left(steps, p.step)
        return i < len(steps) and steps[i] == p.step

    def walk(p: Point) -> None:
        while True:
            if p in needed or p in sources:
                return
            if has_ckpt(p):
                sources[p] = _READY
                return
            if p in planned or any(a < p.step <= b for a, b in snapped.get(p.node, ())):
                sources[p] = _PROMISED  # a running batch saves it (or has just saved it): wait for that checkpoint
                return
            needed.add(p)
            info = nodes[p.node]
            start: int = info.start  # type: ignore[attr-defined]
            best = -1
            promised = False
            steps = checkpoints.get(p.node)
            if steps:
                i = bisect.bisect_left(steps, p.step) - 1
                if i >= 0 and steps[i] > start:
                    best = steps[i]
            for _lo, end, progress, snaps in cover.get(p.node, ()):
                # a point the batch has passed is still to come when it keeps every step (its pack)
                passed_ok = Point(p.node, end) in planned or snaps
                if best < end < p.step and end > start and (progress < end or passed_ok):
                    best, promised = end, True
            saved = planned_at.get(p.node)
            if saved:  # a save a running batch will make before p
                i = bisect.bisect_left(saved, p.step) - 1
                if i >= 0 and saved[i] > max(best, start):
                    best, promised = saved[i], True
            if best >= 0:
                q = Point(p.node, best)
                if q not in sources:
                    sources[q] = _PROMISED if promised else _READY
                return
            parent: int | None = info.parent  # type: ignore[attr-defined]
            if parent is None:
                sources.setdefault(Point(p.node, 0), _ORIGIN)
                return
            p = Point(parent, start)

    req_at: dict[Point, list[RequestId]] = {}
    for rid, p in pending:
        req_at.setdefault(p, []).append(rid)
    forest = StageForest()
    for p in req_at:
        if has_ckpt(p) or p.step == 0:  # evaluate a saved model, or a fresh one at a root
            eval_only.add(p)
            continue
        walk(p)

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
