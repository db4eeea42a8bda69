"""The cut of a stage forest into batches, in the order a tree-order policy serves it.

1. **Order** of the cut: an ``OrderPolicy`` picks which tree to serve next (its root key) and which
   child to follow (``pick``). ``critical_path`` (TreeML §4.3) serves the longest estimated remaining
   path first; ``bfs`` and ``most_children`` (TreeML §6.3's BFS and THR) are the baselines.
2. **Batch**: the chosen path becomes one stage batch run back to back with no reload; the points where
   work hangs off the path become central checkpoints (saved in the background), and the subtrees
   hanging there rejoin the queue, runnable once that checkpoint exists.

The scheduling round (``stagetree.core.round``) cuts each plan's forest this way, lazily, and orders,
places and preempts from there.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from stagetree.core.batch import Point
from stagetree.core.errors import InvalidArgument
from stagetree.core.ids import NO_PLAN, PlanId, RequestId
from stagetree.core.stagetree import Stage, StageForest

StageCost = Callable[[Stage], float]
# Steps strictly inside a stage where its config starts a new piece: likely future branch points.
Boundaries = Callable[[int, int, int], Iterable[int]]  # (node, start, end) -> steps


@dataclass
class PlannedBatch:
    """A path of stages to run back to back."""

    stages: list[Stage]
    source: Point
    ready: bool
    saves: set[Point] = field(default_factory=set)
    evals: set[Point] = field(default_factory=set)
    requests: list[RequestId] = field(default_factory=list)
    cost: float = 0.0
    plan: PlanId = NO_PLAN
    slots: int = 1  # data-parallel ranks, one slot each, on one node manager
    rank: tuple[float, ...] = ()  # the order policy's key of its first stage: smaller was cut first

    @property
    def steps(self) -> int:
        return sum(s.steps for s in self.stages)

    @property
    def end(self) -> Point:
        return self.stages[-1].end_point


# ---------------------------------------------------------------------------------------------
# Order policies


class OrderPolicy(Protocol):
    name: str

    def prepare(self, forest: StageForest, cost: StageCost) -> None: ...

    def root_key(self, stage: Stage) -> tuple[float, ...]:
        """Smaller serves first."""
        ...

    def pick(self, stage: Stage, stages: Sequence[Stage]) -> int:
        """Which child of ``stage`` the path follows."""
        ...


def _postorder(forest: StageForest) -> list[int]:
    order: list[int] = []
    stages = forest.stages
    for r in forest.roots:
        stack = [(r, False)]
        while stack:
            sid, done = stack.pop()
            if done:
                order.append(sid)
                continue
            stack.append((sid, True))
            stack.extend((c, False) for c in stages[sid].children)
    return order


class CriticalPath:
    """Longest estimated remaining path first (TreeML §4.3)."""

    name = "critical_path"

    def __init__(self) -> None:
        self.longest: list[float] = []

    def prepare(self, forest: StageForest, cost: StageCost) -> None:
        stages = forest.stages
        longest = [0.0] * len(stages)
        for sid in _postorder(forest):
            st = stages[sid]
            best = 0.0
            for c in st.children:
                if longest[c] > best:
                    best = longest[c]
            longest[sid] = cost(st) + best
        self.longest = longest

    def root_key(self, stage: Stage) -> tuple[float, ...]:
        return (-self.longest[stage.id], stage.id)

    def pick(self, stage: Stage, stages: Sequence[Stage]) -> int:
        longest = self.longest
        return max(stage.children, key=lambda c: (longest[c], -c))


class BreadthFirst:
    """Baseline: shallowest work first, in arrival order (TreeML §6.3 BFS)."""

    name = "bfs"

    def prepare(self, forest: StageForest, cost: StageCost) -> None:
        pass

    def root_key(self, stage: Stage) -> tuple[float, ...]:
        return (stage.start, stage.id)

    def pick(self, stage: Stage, stages: Sequence[Stage]) -> int:
        return stage.children[0]


class MostChildren:
    """Baseline: the stage with the most descendant stages first (TreeML §6.3 THR)."""

    name = "most_children"

    def __init__(self) -> None:
        self.desc: list[int] = []

    def prepare(self, forest: StageForest, cost: StageCost) -> None:
        stages = forest.stages
        desc = [0] * len(stages)
        for sid in _postorder(forest):
            desc[sid] = sum(1 + desc[c] for c in stages[sid].children)
        self.desc = desc

    def root_key(self, stage: Stage) -> tuple[float, ...]:
        return (-self.desc[stage.id], stage.id)

    def pick(self, stage: Stage, stages: Sequence[Stage]) -> int:
        desc = self.desc
        return max(stage.children, key=lambda c: (desc[c], -c))


ORDER_POLICIES: Mapping[str, Callable[[], OrderPolicy]] = {
    CriticalPath.name: CriticalPath,
    BreadthFirst.name: BreadthFirst,
    MostChildren.name: MostChildren,
}


def order_policy(name: str) -> OrderPolicy:
    factory = ORDER_POLICIES.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown ordering policy {name!r}; known: {sorted(ORDER_POLICIES)}")
    return factory()


# ---------------------------------------------------------------------------------------------
# Order + batch


def plan_batches(
    forest: StageForest, policy: OrderPolicy, cost: StageCost, boundaries: Boundaries | None = None
) -> list[PlannedBatch]:
    """Cut the whole forest into batches, in the order the policy serves them.

    With ``boundaries``, a batch also saves where its config changes piece: a later trial from the
    same search space most likely branches exactly there, and a background save is far cheaper than
    training the prefix again once the worker has moved past it.
    """
    return list(iter_batches(forest, policy, cost, boundaries))


def count_batches(forest: StageForest) -> int:
    """How many batches ``iter_batches`` cuts the forest into: every path ends at a leaf."""
    return sum(1 for st in forest.stages if not st.children)


def iter_batches(
    forest: StageForest, policy: OrderPolicy, cost: StageCost, boundaries: Boundaries | None = None
) -> Iterator[PlannedBatch]:
    """``plan_batches`` lazily: a round that fills its few free slots early stops cutting there (a
    forest of 10,000 pending requests has thousands of paths, of which a round dispatches a handful)."""
    policy.prepare(forest, cost)
    stages = forest.stages
    heap: list[tuple[tuple[float, ...], int, Point, bool]] = []
    for r in forest.roots:
        st = stages[r]
        assert st.source is not None
        heap.append((policy.root_key(st), r, st.source, st.ready))
    heapq.heapify(heap)
    while heap:
        rank, sid, source, ready = heapq.heappop(heap)
        path: list[Stage] = []
        batch = PlannedBatch(path, source, ready, plan=stages[sid].plan, rank=rank)
        while True:
            st = stages[sid]
            path.append(st)
            batch.cost += cost(st)
            if boundaries is not None:
                batch.saves.update(Point(st.node, b) for b in boundaries(st.node, st.start, st.end))
            end = st.end_point
            if st.requests:
                batch.evals.add(end)
                batch.requests.extend(st.requests)
            if not st.children:
                batch.saves.add(end)
                break
            nxt = st.children[0] if len(st.children) == 1 else policy.pick(st, stages)
            if len(st.children) > 1:
                batch.saves.add(end)
                for c in st.children:
                    if c != nxt:
                        heapq.heappush(heap, (policy.root_key(stages[c]), c, end, False))
            sid = nxt
        yield batch


def steps_cost(step_seconds: float = 1.0) -> StageCost:
    """The simplest estimate: every step costs the same."""
    return lambda st: st.steps * step_seconds
