"""In-memory cache of each search plan's node structure, and the walk that turns configs into points.

The plan is append-only, so a core ``SearchPlan`` per plan, refreshed with the nodes whose id is above
the last one seen, is always a correct prefix of the database. A plan is read whole the first time any
reader touches it (a master that starts or takes over holds none, while batches of its plans still run),
and a reader that names nodes refreshes until it holds them. Walking happens here with core code;
writing happens in the store. When the walk needs a node that does not exist, the node is written
insert-or-ignore under its unique key (plan, parent-or-0, start, branch digest), the cache is
refreshed, and the walk is repeated: whichever master wrote first, every master ends on the same node.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from stagetree.core.batch import Point
from stagetree.core.config import Config
from stagetree.core.errors import Conflict
from stagetree.core.searchplan import Node, SearchPlan, check_step
from stagetree.core.sequences import Segments
from stagetree.master.store.plans import PlanStore
from stagetree.master.store.records import NewTreeNode

log = logging.getLogger(__name__)


def config_text(config: Config) -> str:
    return json.dumps(config.to_json(), sort_keys=True, separators=(",", ":"))


def branch_digest(config: Config, step: int) -> str:
    """Digest of the values in force at ``step`` (with their types): two configs that agree before ``step``
    take the same child at ``step`` exactly when these agree (the core's ``divergence`` compares values)."""
    parts = [[name, type(v).__name__, v] for name, v in sorted(config.values_at(step).items())]
    blob = json.dumps(parts, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class _CachedPlan(SearchPlan):
    """A core plan whose locally created (not yet written) nodes get negative ids, never a database id."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self._node_ids = itertools.count(-1, -1)


@dataclass
class _Entry:
    plan: _CachedPlan
    last_id: int = 0
    loaded: bool = False  # read from the store once at least
    lock: threading.Lock = field(default_factory=threading.Lock)


class PlanCache:
    """Node structure of every plan this master touched, kept in step with the store."""

    def __init__(self, store: PlanStore, max_passes: int = 64) -> None:
        self._store = store
        # every hyper-parameter sequence held once: a node's config differs from its parent's in one
        # sequence, so a plan of a million nodes shares most of them (see tests.bench.scale --phase memory)
        self._sequences: dict[tuple[str, Segments], tuple[str, Segments]] = {}
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()
        self._max_passes = max_passes

    def _entry(self, plan_id: int) -> _Entry:
        """The plan's entry, read from the store on its first use: an empty cache is not an empty plan."""
        with self._lock:
            e = self._entries.get(plan_id)
            if e is None:
                e = self._entries[plan_id] = _Entry(_CachedPlan(str(plan_id)))
        if not e.loaded:
            with e.lock:
                if not e.loaded:
                    self._refresh(e, plan_id)
                    e.loaded = True
        return e

    def _refresh(self, e: _Entry, plan_id: int, *, full: bool = False) -> None:
        """Add the nodes written since the last refresh. Ids come from a sequence but transactions commit
        in any order, so a node can appear below ``last_id`` after we moved past it: ``full`` re-reads
        the whole plan (parents always have smaller ids than their children) and adds what is missing."""
        for rec in self._store.load_nodes(plan_id, after=0 if full else e.last_id):
            if rec.id in e.plan.nodes:
                continue
            if rec.parent is not None and rec.parent not in e.plan.nodes:
                if full:
                    raise Conflict(f"plan {plan_id}: node {rec.id}'s parent {rec.parent} is missing; retry")
                self._refresh(e, plan_id, full=True)  # the parent committed after a later id was read
                return
            e.plan.add_node(
                rec.parent, rec.start, self._shared(Config.from_json(json.loads(rec.config_json))), node_id=rec.id
            )
            e.last_id = max(e.last_id, rec.id)

    def _shared(self, config: Config) -> Config:
        """``config`` made of the sequences this cache holds already (equal ones are one object)."""
        seen = self._sequences
        return Config(tuple(seen.setdefault(item, item) for item in config.items))

    def refresh(self, plan_id: int) -> SearchPlan:
        """The plan with every node written so far (callers must treat it as read-only)."""
        e = self._entry(plan_id)
        with e.lock:
            self._refresh(e, plan_id)
            return e.plan

    def find(self, plan_id: int, config: Config, step: int) -> Point | None:
        """The point of ``config`` at ``step`` if its node exists; never writes."""
        e = self._entry(plan_id)
        with e.lock:
            self._refresh(e, plan_id)
            point, _ = e.plan.locate(config, step, create=False)
            return point

    def canonical(self, plan_id: int, p: Point) -> Point:
        e = self._entry(plan_id)
        with e.lock:
            if p.node not in e.plan.nodes:
                self._refresh(e, plan_id)
            if p.node not in e.plan.nodes:
                self._refresh(e, plan_id, full=True)
            return e.plan.canonical(p)

    def ensure(self, plan_id: int, node_ids: Iterable[int]) -> SearchPlan:
        """The plan, refreshed until it holds every node in ``node_ids`` (read-only for callers)."""
        e = self._entry(plan_id)
        with e.lock:
            missing = [n for n in node_ids if n not in e.plan.nodes]
            if missing:
                self._refresh(e, plan_id)
                if any(n not in e.plan.nodes for n in missing):
                    self._refresh(e, plan_id, full=True)
            return e.plan

    def locate_many(self, plan_id: int, items: Sequence[tuple[Config, int]]) -> list[Point]:
        """Canonical points for (config, step) items, creating the nodes they need.

        One pass walks every item, creating missing nodes in memory (negative ids) so later items of
        the batch walk through them; all of them are written in one transaction; when another writer's
        node took one of their keys, the cache is refreshed and the items walked again (that pass
        creates more only when the other writer's config diverges later)."""
        e = self._entry(plan_id)
        with e.lock:
            # The plan is append-only, so a walk that creates nothing is correct as it is: a node written
            # elsewhere since could only have been needed where this walk stopped. One walk serves both
            # cases: it finds what exists and creates, in memory, what does not.
            # No read of what other masters wrote first: the insert keeps theirs under the same key and
            # returns fewer ids, and only then is the cache refreshed and the walk done again. (A read
            # here was a third of every submission's time on the scale bench, and found nothing with one
            # master.)
            previous: set[tuple[int | None, int, str]] = set()
            for attempt in range(self._max_passes):
                located, created = locate_all(e.plan, items, create=True)
                points = [p for p in located if p is not None]
                if not created:
                    return points
                for node, _ in reversed(created):
                    _forget(e.plan, node)
                rows = [
                    NewTreeNode(n.id, n.parent, n.start, branch_digest(c, n.start), config_text(c)) for n, c in created
                ]
                keys = {(r.parent, r.start, r.branch_digest) for r in rows if r.parent is None or r.parent > 0}
                log.debug("creating nodes", extra={"plan_id": plan_id, "nodes": len(rows), "pass": attempt})
                ids = self._store.insert_node_tree(plan_id, rows)
                if len(ids) == len(rows) and not previous:
                    # every node is ours as walked: add them and translate the points, no second walk
                    for (node, config), row in zip(created, rows, strict=True):
                        parent = ids[row.parent] if row.parent is not None and row.parent < 0 else row.parent
                        e.plan.add_node(parent, node.start, self._shared(config), node_id=ids[row.ref])
                    return [Point(ids[p.node], p.step) if p.node < 0 else p for p in points]
                # asking twice for the same key means another writer's node committed below last_id
                self._refresh(e, plan_id, full=bool(previous & keys))
                previous = keys
        raise Conflict(f"plan {plan_id}: could not settle new nodes after {self._max_passes} passes; retry")


def _forget(plan: SearchPlan, node: Node) -> None:
    """Undo a node the walk created in memory only (the database decides which node exists)."""
    plan.forget_node(node.id)


def locate_all(
    plan: SearchPlan, items: Sequence[tuple[Config, int]], *, create: bool
) -> tuple[list[Point | None], list[tuple[Node, Config]]]:
    """``plan.locate`` of every item, walking the tree once per distinct configuration (at its largest
    step) instead of once per item: a tuner asks for the same trial at many steps (a learning curve),
    and each walk compares sequences node by node. The other steps' points lie on that walk's path:
    each is on the deepest node of the path that starts before it. Also returns the nodes created
    (with ``create``), each with the configuration it was created for."""
    groups: dict[Config, list[int]] = {}
    for i, (config, step) in enumerate(items):
        check_step(step)
        groups.setdefault(config, []).append(i)
    out: list[Point | None] = [None] * len(items)
    created: list[tuple[Node, Config]] = []
    for config, idxs in groups.items():
        top = max(items[i][1] for i in idxs)
        point, new = plan.locate(config, top, create=create)
        created.extend((n, config) for n in new)
        if point is None:
            continue  # the path is not all there: the caller walks again with create
        path = [plan.nodes[point.node]]  # root first, once reversed
        while path[-1].parent is not None:
            path.append(plan.nodes[path[-1].parent])
        path.reverse()
        for i in idxs:
            step = items[i][1]
            node = path[0]
            for n in path[1:]:
                if n.start >= step:
                    break
                node = n
            out[i] = plan.canonical(Point(node.id, step))
    return out, created
