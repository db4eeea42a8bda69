"""The learning-curve use cases both API adapters (REST, gRPC) and the dashboard call.

Owns reading curves for a principal: a trial's curve by request id (its path's points: the shared
prefix from the ancestors, then its own), and a plan's curves per node (each shared step once, which
is how the dashboard draws a prefix as one line that splits). Step ranges are checked, and the server
thins what it sends (``core.downsample``) when asked. Visibility is ``MasterService.get_study``'s: a
study of another owner does not exist for the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stagetree.core.batch import Point
from stagetree.core.downsample import downsample, share_budget
from stagetree.core.errors import InvalidArgument, NotFound
from stagetree.core.searchplan import check_step
from stagetree.core.text import check_id
from stagetree.master.auth import Principal
from stagetree.master.service import MasterService

MAX_POINTS = 100_000  # the most points one answer may ask for


@dataclass(frozen=True)
class CurvePoint:
    node: int
    step: int
    values: dict[str, float]


@dataclass(frozen=True)
class TrialCurve:
    request_id: int
    node: int  # the trial's node and step (where its curve ends)
    step: int
    points: list[CurvePoint] = field(default_factory=list)
    total: int = 0  # points in the range before thinning


@dataclass(frozen=True)
class NodeCurve:
    node: int
    parent: int | None
    start: int
    points: list[CurvePoint] = field(default_factory=list)
    total: int = 0
    series: list[tuple[int, float]] = field(default_factory=list)  # (step, value) of one metric, if asked
    times: list[float] = field(default_factory=list)  # when each point of ``series`` was recorded, if asked


def check_range(start: int, end: int | None, max_points: int) -> None:
    """Steps and a point budget in range; ``end`` below ``start`` is an empty range (no points)."""
    check_step(start, "start")
    if end is not None:
        check_step(end, "end")
    if not 0 <= max_points <= MAX_POINTS:
        raise InvalidArgument(f"max_points must be in [0, {MAX_POINTS}] (0: every point), got {max_points}")


class CurveService:
    def __init__(self, service: MasterService) -> None:
        self.service = service
        self.store = service.store

    def trial_curve(
        self,
        who: Principal,
        study_id: str,
        request_id: int,
        start: int = 0,
        end: int | None = None,
        max_points: int = 0,
    ) -> TrialCurve:
        """The curve of request ``request_id`` of the study over steps ``[start, end]`` (up to its own step
        when ``end`` is None), thinned to ``max_points`` (0: all)."""
        check_id(request_id, "request_id")
        check_range(start, end, max_points)
        recs = self.service.get_requests(who, study_id, [request_id])
        if not recs:
            raise NotFound(f"request {request_id} does not exist in study {study_id!r}")
        r = recs[0]
        plan = self.service.plans.ensure(r.plan_id, {r.node})
        segments = plan.path(Point(r.node, r.step))
        hi = r.step if end is None else min(end, r.step)
        found = self.store.curves.path_points(segments, start, hi) if hi >= start else []
        pts = [CurvePoint(n, st, v) for n, st, v in found]
        return TrialCurve(r.id, r.node, r.step, downsample(pts, max_points), len(pts))

    def metric_names(self, who: Principal, study_id: str, plan_key: str = "") -> list[str]:
        """The step metrics the study's curves hold (those of its latest point)."""
        study = self.service.get_study(who, study_id)
        _key, pid = self.service._study_plan(study, plan_key)
        return self.store.curves.sample_names(sorted(self.service.plans.refresh(pid).nodes))

    def plan_curves(
        self,
        who: Principal,
        study_id: str,
        plan_key: str = "",
        max_points: int = 0,
        nodes: list[int] | None = None,
        since: float | None = None,
        metric: str | None = None,
        timed: bool = False,
    ) -> list[NodeCurve]:
        """Each node's own curve points in the study's plan (or those ``nodes``; only those recorded after
        ``since`` if given; only the points holding ``metric``, with that value alone, if given, and with
        ``timed`` when each was recorded), the whole answer thinned to about ``max_points`` (0: all), each
        node keeping its first and last point."""
        check_range(0, None, max_points)
        study = self.service.get_study(who, study_id)
        _key, pid = self.service._study_plan(study, plan_key)
        plan = self.service.plans.refresh(pid)
        ids = sorted(plan.nodes) if nodes is None else sorted(set(nodes))
        unknown = [n for n in ids if n not in plan.nodes]
        if unknown:
            raise NotFound(f"nodes {unknown[:5]} are not in the study's plan")
        if metric is not None:  # one value per point: read and thinned in the database
            totals = self.store.curves.point_counts(ids, since)  # a budget's basis: a scan of no JSON
            budgets = share_budget(max_points, [totals.get(n, 0) for n in ids])
            shares = dict(zip(ids, budgets, strict=True))
            if timed:
                got = self.store.curves.timed_series(shares, metric, since, totals)
                return [
                    NodeCurve(
                        n,
                        plan.nodes[n].parent,
                        plan.nodes[n].start,
                        [],
                        totals.get(n, 0),
                        [(st, v) for st, v, _ in got[n]],
                        [t for _, _, t in got[n]],
                    )
                    for n in ids
                ]
            series = self.store.curves.series(shares, metric, since, totals)
            return [
                NodeCurve(n, plan.nodes[n].parent, plan.nodes[n].start, [], totals.get(n, 0), series[n]) for n in ids
            ]
        by_node = self.store.curves.node_points(ids, since=since)
        lengths = [len(by_node[n]) for n in ids]
        budgets = share_budget(max_points, lengths)
        out = []
        for n, budget in zip(ids, budgets, strict=True):
            node = plan.nodes[n]
            pts = [CurvePoint(a, b, c) for a, b, c in by_node[n]]
            out.append(NodeCurve(n, node.parent, node.start, downsample(pts, budget), len(pts)))
        return out
