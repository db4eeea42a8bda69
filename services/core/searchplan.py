"""The search plan (TreeML §4.2): a persistent, append-only tree of configurations.

A node is a trial config valid from its ``start`` step: it agrees with its parent on [0, start) and
differs from it at ``start`` (so children start strictly after their parent). A path from a root is a
trial; the model after ``k`` steps of node ``n``'s config is the *point* ``(n, k)``. A point at a node's
own start step is the parent's model, so points are kept canonical: ``(n, k)`` with ``k > n.start``, or
a root's ``(r, 0)`` (a fresh model).

Nodes hold requests ("give me the metrics at point p"), checkpoints and metrics, all keyed by point.
Nodes and edges are never split or deleted, which lets a service cache the node structure safely.

This module is pure: the master's store keeps the same records in a database and uses these
functions to decide what to write.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from stagetree.core.batch import Point
from stagetree.core.config import Config, divergence
from stagetree.core.errors import InvalidArgument, NotFound
from stagetree.core.lifecycle import RequestState
from stagetree.core.sequences import Value
from stagetree.core.slots import Slot, keeps_snapshots_on

MAX_STEP = 10_000_000
# the first roots of a plan whose starting values are kept to tell whether its trials start apart
# (``SearchPlan.roots_apart``): enough to judge by, bounded for plans of many roots
ROOTS_JUDGED = 64


class CheckpointKind(StrEnum):
    CENTRAL = "central"
    PERIPHERAL = "peripheral"


@dataclass(slots=True)
class Node:
    id: int
    parent: int | None
    start: int
    config: Config
    children: dict[int, list[int]] = field(default_factory=dict)  # branch step -> child ids


@dataclass
class Request:
    id: int
    point: Point
    state: RequestState = RequestState.NOT_SCHED
    study: str = ""
    batch: int | None = None


@dataclass(frozen=True)
class Checkpoint:
    point: Point
    uri: str
    bytes: int
    kind: CheckpointKind = CheckpointKind.CENTRAL
    last_used: float = 0.0


@dataclass(frozen=True)
class AddResult:
    """Outcome of adding a request: ``metrics`` at once when they exist, else the recorded request."""

    point: Point
    request: Request | None
    metrics: Mapping[str, float] | None
    new_nodes: tuple[Node, ...] = ()


@dataclass(frozen=True)
class CancelResult:
    """``deleted``: it was NOT_SCHED and is gone. ``abort_batch``: the batch to abort (SCHED and no other
    live request needs that batch's work), else None."""

    deleted: bool
    abort_batch: int | None


def check_step(step: Any, what: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidArgument(f"{what}: must be an integer number of steps, got {step!r}")
    if step < 0 or step > MAX_STEP:
        raise InvalidArgument(f"{what}: must be in [0, {MAX_STEP}], got {step}")
    return step


class SearchPlan:
    """One search plan (one fixed part). Ids come from counters unless the caller supplies them; plans
    that must not reuse each other's node or request ids (several plans of one simulation) share the
    counters ``node_ids`` and ``request_ids``."""

    def __init__(
        self, key: str = "", node_ids: Iterator[int] | None = None, request_ids: Iterator[int] | None = None
    ) -> None:
        self.key = key
        self.nodes: dict[int, Node] = {}
        self.roots: list[int] = []
        self.requests: dict[int, Request] = {}
        self.by_point: dict[Point, list[int]] = {}  # live (NOT_SCHED or SCHED) request ids
        self.checkpoints: dict[Point, Checkpoint] = {}
        self.metrics: dict[Point, dict[str, float]] = {}
        self._node_ids: Iterator[int] = itertools.count(1) if node_ids is None else node_ids
        self._request_ids: Iterator[int] = itertools.count(1) if request_ids is None else request_ids
        # (parent or None for a root, branch step, hash of the values in force there) -> the node: a walk
        # takes the child at a branch point in one lookup instead of comparing every sibling (a node, or
        # the plan's roots, may have thousands)
        self._branches: dict[tuple[int | None, int, int], int] = {}
        # how many more nodes share a key of _branches (a hash collision of their values): only then does
        # forgetting the indexed one look among its siblings for the next
        self._shadowed: dict[tuple[int | None, int, int], int] = {}
        # per hyper-parameter, how many of the first ROOTS_JUDGED roots start with each value (typed: 1 and
        # True are different values); the roots counted
        self._root_values: dict[str, Counter[tuple[str, Value]]] = {}
        self._judged: set[int] = set()

    # -- structure ------------------------------------------------------------------------------

    def add_node(self, parent: int | None, start: int, config: Config, node_id: int | None = None) -> Node:
        nid = next(self._node_ids) if node_id is None else node_id
        if nid in self.nodes:
            raise InvalidArgument(f"node {nid} exists")
        node = Node(nid, parent, start, config)
        self.nodes[nid] = node
        if parent is None:
            self.roots.append(nid)
            if len(self._judged) < ROOTS_JUDGED:
                self._judged.add(nid)
                self._count_root(config, 1)
        else:
            self.nodes[parent].children.setdefault(start, []).append(nid)
        key = (parent, start, _values_hash(config, start))
        if self._branches.setdefault(key, nid) != nid:  # a sibling under the same hash (a collision)
            self._shadowed[key] = self._shadowed.get(key, 0) + 1
        return node

    def _count_root(self, config: Config, by: int) -> None:
        for name, value in config.values_at(0).items():
            counts = self._root_values.setdefault(name, Counter())
            typed = (type(value).__name__, value)
            counts[typed] += by
            if counts[typed] <= 0:
                del counts[typed]

    @property
    def branched(self) -> bool:
        """Whether some trial of the plan shares a prefix with another and then differs (a node has a
        parent): its trials do not all start apart."""
        return len(self.nodes) > len(self.roots)

    @property
    def roots_apart(self) -> bool:
        """Whether some hyper-parameter starts each of the plan's roots (its first ``ROOTS_JUDGED``) with a
        value no other root starts with, as a continuous one does: then a new trial starts apart from
        every trial so far too."""
        n = len(self._judged)
        return n > 1 and any(len(counts) == n for counts in self._root_values.values())

    def forget_node(self, nid: int) -> None:
        """Remove a leaf added by mistake (a walk's node that another writer's node replaces)."""
        node = self.nodes.pop(nid)
        if nid in self._judged:
            self._judged.discard(nid)
            self._count_root(node.config, -1)
        kids = self.roots if node.parent is None else self.nodes[node.parent].children[node.start]
        if kids[-1] == nid:  # the usual case: the walk's newest node
            kids.pop()
        else:
            kids.remove(nid)
        if not kids and node.parent is not None:
            del self.nodes[node.parent].children[node.start]
        key = (node.parent, node.start, _values_hash(node.config, node.start))
        shadowed = self._shadowed.get(key, 0)
        if self._branches.get(key) != nid:
            if shadowed:  # it was one of the shadowed siblings
                self._shadowed[key] = shadowed - 1
            return
        del self._branches[key]
        if not shadowed:  # no sibling shares its hash: nothing takes its place (no scan of the siblings)
            return
        for other in kids:  # a sibling under the same hash (a collision) takes its place
            if _values_hash(self.nodes[other].config, node.start) == key[2]:
                self._branches[key] = other
                self._shadowed[key] = shadowed - 1
                break

    def _follow(self, node: Node | None, config: Config, d: int, step: int) -> tuple[Node, int] | None:
        """The child of ``node`` branching at ``d`` that ``config`` follows (with ``node`` None, the root
        ``config`` starts in), and the first step in ``[d, step)`` where ``config`` may leave it (``step``
        if it does not); None when no such child agrees with ``config`` at ``d``. Assumes ``config``
        agrees with ``node`` on ``[0, d)``, and so with each of these children, which all branch at ``d``:
        one comparison from ``d`` on says both whether ``config`` follows a child and how far."""
        kids = self.roots if node is None else node.children.get(d)
        if not kids:
            return None
        limit = max(step, d + 1)  # at step 0, a root must still agree at step 0
        candidates: Iterable[int] = kids  # one child: comparing with it costs less than hashing the values at d
        if len(kids) > 1:
            cid = self._branches.get((None if node is None else node.id, d, _values_hash(config, d)))
            if cid is None:
                return None  # no sibling has these values at d, so none agrees with config there
            # the indexed child, then (a hash collision) every other sibling
            candidates = itertools.chain((cid,), (k for k in kids if k != cid))
        for cid in candidates:
            child = self.nodes[cid]
            e = divergence(child.config, config, d, limit)
            if e > d:
                return child, min(e, step)
        return None

    def locate(self, config: Config, step: int, *, create: bool = True) -> tuple[Point | None, list[Node]]:
        """The canonical point whose model is ``config`` trained for ``step`` steps, walking from the
        roots along matching configurations; new nodes are created only at divergence steps."""
        check_step(step)
        created: list[Node] = []
        found = self._follow(None, config, 0, step)
        if found is None:
            if not create:
                return None, created
            root = self.add_node(None, 0, config)
            created.append(root)
            return Point(root.id, step), created
        node, d = found
        while d < step:
            found = self._follow(node, config, d, step)
            if found is None:
                if not create:
                    return None, created
                nxt = self.add_node(node.id, d, config)
                created.append(nxt)
                return Point(nxt.id, step), created
            node, d = found
        return self.canonical(Point(node.id, step)), created

    def canonical(self, p: Point) -> Point:
        node = self.nodes.get(p.node)
        if node is None:
            raise NotFound(f"search-plan node {p.node} does not exist")
        if p.step < node.start:
            raise InvalidArgument(f"step {p.step} is before node {node.id}'s start {node.start}")
        if p.step == node.start and node.parent is not None:
            return Point(node.parent, p.step)
        return p

    def path(self, p: Point) -> list[tuple[int, int, int]]:
        """``[(node, from_step, to_step), ...]`` from a fresh model to point ``p``."""
        out: list[tuple[int, int, int]] = []
        node = self.nodes[p.node]
        end = p.step
        while True:
            out.append((node.id, node.start, end))
            if node.parent is None:
                break
            end = node.start
            node = self.nodes[node.parent]
        out.reverse()
        return [seg for seg in out if seg[2] > seg[1]] or [(p.node, 0, 0)]

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, config: Config, step: int, *, study: str = "", request_id: int | None = None) -> AddResult:
        point, created = self.locate(config, step)
        assert point is not None
        m = self.metrics.get(point)
        if m is not None:
            return AddResult(point, None, m, tuple(created))
        rid = next(self._request_ids) if request_id is None else request_id
        req = Request(rid, point, RequestState.NOT_SCHED, study)
        self.requests[rid] = req
        self.by_point.setdefault(point, []).append(rid)
        return AddResult(point, req, None, tuple(created))

    def pending(self) -> list[Request]:
        return [r for r in self.requests.values() if r.state is RequestState.NOT_SCHED]

    def live(self) -> Iterable[Request]:
        return (r for r in self.requests.values() if r.state in (RequestState.NOT_SCHED, RequestState.SCHED))

    def cancel(self, request_id: int) -> CancelResult:
        req = self.requests.get(request_id)
        if req is None:
            raise NotFound(f"request {request_id} does not exist")
        if req.state is RequestState.NOT_SCHED:
            self._unlink(req)
            req.state = RequestState.CANCELLED
            return CancelResult(True, None)
        if req.state is RequestState.SCHED:
            self._unlink(req)
            req.state = RequestState.CANCELLED
            batch = req.batch
            still_needed = any(r.batch == batch for r in self.live())
            return CancelResult(False, None if still_needed else batch)
        return CancelResult(False, None)

    def fail(self, request_id: int) -> bool:
        """A NOT_SCHED request that can never run (no node manager can take its work) fails; whether it did."""
        req = self.requests[request_id]
        if req.state is not RequestState.NOT_SCHED:
            return False
        self._unlink(req)
        req.state = RequestState.FAILED
        return True

    def _unlink(self, req: Request) -> None:
        ids = self.by_point.get(req.point)
        if ids and req.id in ids:
            ids.remove(req.id)
            if not ids:
                del self.by_point[req.point]

    def mark_scheduled(self, request_ids: Iterable[int], batch: int) -> None:
        for rid in request_ids:
            req = self.requests[rid]
            if req.state is RequestState.NOT_SCHED:
                req.state = RequestState.SCHED
                req.batch = batch

    def requeue_batch(self, batch: int) -> list[int]:
        """A batch ended without serving some requests (failure, preemption, lost node): back to NOT_SCHED."""
        out = []
        for r in self.requests.values():
            if r.state is RequestState.SCHED and r.batch == batch:
                r.state = RequestState.NOT_SCHED
                r.batch = None
                out.append(r.id)
        return out

    # -- results ------------------------------------------------------------------------------

    def record_metrics(self, p: Point, metrics: Mapping[str, float]) -> list[Request]:
        """Store metrics at a point; the live requests waiting there are DONE and returned."""
        p = self.canonical(p)
        self.metrics[p] = dict(metrics)
        done = []
        for rid in self.by_point.pop(p, []):
            req = self.requests[rid]
            req.state = RequestState.DONE
            done.append(req)
        return done

    def record_checkpoint(self, ckpt: Checkpoint) -> Checkpoint:
        p = self.canonical(ckpt.point)
        stored = Checkpoint(p, ckpt.uri, ckpt.bytes, ckpt.kind, ckpt.last_used)
        self.checkpoints[p] = stored
        return stored

    def drop_checkpoint(self, p: Point) -> None:
        self.checkpoints.pop(self.canonical(p), None)

    def checkpoint_steps(self) -> dict[int, list[int]]:
        """Available checkpoint steps per node, sorted."""
        out: dict[int, list[int]] = {}
        for p in self.checkpoints:
            out.setdefault(p.node, []).append(p.step)
        for steps in out.values():
            steps.sort()
        return out


def keeps_snapshots(plan: SearchPlan, probation_roots: int) -> bool:
    """Whether a batch of ``plan`` keeps in-memory snapshots at every step it trains (``BatchSpec.
    snapshot_budget_bytes``), for trials that arrive later and branch inside its range.

    Snapshots pay only when such trials come. A late trial branches inside a trained range only if it
    agrees with a trial already there on a prefix. A plan of at least ``probation_roots`` trials that
    all started apart (every node a root: no two agreed even on their first step) and that one
    hyper-parameter tells apart at the start (each trial drew a value of its own: a continuous one) will
    start every new trial apart too; there the snapshots, their pack and a checkpoint record per step
    cost more than the steps they could save, and none are kept. Anywhere else (fewer roots, a branch,
    or starting values that repeat, as a grid's do) they are. 0: always."""
    if probation_roots == 0 or len(plan.roots) < probation_roots or plan.branched:
        return True
    return not plan.roots_apart


def batch_keeps_snapshots(plan: SearchPlan, slots: Sequence[Slot], probation_roots: int) -> bool:
    """Whether a batch of ``plan`` placed on ``slots`` keeps a snapshot of every step it trains: the one
    rule of the master's specs (``round_apply``) and of the simulator's runs."""
    return keeps_snapshots_on(slots) and keeps_snapshots(plan, probation_roots)


def _values_hash(config: Config, step: int) -> int:
    """A hash of the values ``config`` gives at ``step``. Two configs that agree at ``step`` (``divergence``
    is conservative: it never says so when a value differs) have equal values there, so equal hashes."""
    return hash(tuple(config.values_at(step).items()))
