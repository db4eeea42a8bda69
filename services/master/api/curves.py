"""REST routes of the learning curves (``master.curves``): a trial's curve by request id, a plan's
curves per node. Added to the master's FastAPI app by ``create_rest_app``; same tokens, same owner
isolation (another owner's study is a 404), errors through the app's handlers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import FastAPI, Query
from pydantic import BaseModel, Field

from stagetree.core.searchplan import MAX_STEP
from stagetree.master.api.openapi import responses
from stagetree.master.api.rest import PREFIX, PlanKey, RequestId, StudyId, Who
from stagetree.master.curves import MAX_POINTS, CurvePoint, CurveService

if TYPE_CHECKING:
    from stagetree.master.app import MasterApp

Step = Annotated[int, Query(ge=0, le=MAX_STEP)]
MaxPoints = Annotated[int, Query(ge=0, le=MAX_POINTS, description="thin to at most this many points (0: all)")]


class PointOut(BaseModel):
    node: int
    step: int
    values: dict[str, float]


class TrialCurveOut(BaseModel):
    request_id: int
    node: int
    step: int
    total: int = Field(description="points in the range before thinning")
    points: list[PointOut]


class NodeCurveOut(BaseModel):
    node: int
    parent: int | None
    start: int
    total: int
    points: list[PointOut]


def _points(pts: list[CurvePoint]) -> list[PointOut]:
    return [PointOut(node=p.node, step=p.step, values=p.values) for p in pts]


def add_curve_routes(api: FastAPI, master: MasterApp) -> None:
    curves = CurveService(master.service)

    @api.get(f"{PREFIX}/studies/{{study_id}}/requests/{{request_id}}/curve", responses=responses(404))
    def trial_curve(
        study_id: StudyId,
        request_id: RequestId,
        who: Who,
        start: Step = 0,
        end: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
        max_points: MaxPoints = 0,
    ) -> TrialCurveOut:
        """The learning curve of one request (trial): its shared prefix's points, then its own, over steps
        ``[start, end]`` (up to its step by default), thinned on the server to ``max_points``."""
        c = curves.trial_curve(who, study_id, request_id, start, end, max_points)
        return TrialCurveOut(request_id=c.request_id, node=c.node, step=c.step, total=c.total, points=_points(c.points))

    @api.get(f"{PREFIX}/studies/{{study_id}}/curves", responses=responses(404))
    def plan_curves(
        study_id: StudyId,
        who: Who,
        plan_key: PlanKey = "",
        max_points: MaxPoints = 0,
        nodes: Annotated[list[Annotated[int, Field(ge=1)]] | None, Query()] = None,
    ) -> list[NodeCurveOut]:
        """Each plan node's own points (a step shared by many trials appears once), the answer thinned to
        about ``max_points`` in all; a trial's curve is its path through these."""
        return [
            NodeCurveOut(node=c.node, parent=c.parent, start=c.start, total=c.total, points=_points(c.points))
            for c in curves.plan_curves(who, study_id, plan_key, max_points, nodes)
        ]
