"""The dashboard's HTTP side, added to the master's FastAPI app by ``create_rest_app``.

- ``/`` and ``/dashboard`` redirect to ``/dashboard/``: the single page (``static/index.html``); its
  modules and ECharts under ``/dashboard/static/``. These carry no data and need no token.
- ``/api/v1/dashboard/...``: each page's JSON (``views``, ``tree``, ``cluster``; shapes in ``schemas``),
  with the REST API's bearer tokens and owner isolation (another owner's study is a 404).
- ``/api/v1/dashboard/events``: server-sent events fed by the master's wake-up channels: ``results``
  and ``round`` become ``counts`` (request states changed), ``curves`` becomes ``curves`` (new
  learning-curve points), each at most every ``EVENT_MIN_GAP_S``; a comment every ``KEEPALIVE_S``.
  With ``study``, only that study's changes: on each wake-up the stream compares the study's requests
  by state and the time of its plans' latest curve point with what it last saw, so a page of an idle
  study hears nothing while another study runs. The page reads it with ``fetch`` (so the token travels
  in the header, never in a URL) and falls back to polling when the stream breaks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from stagetree.core.text import INT64_MAX
from stagetree.dashboard import schemas
from stagetree.dashboard.cache import VersionedCache
from stagetree.dashboard.cluster import LOG_TAIL_BYTES, MAX_LOG_TAIL_BYTES, ClusterViews
from stagetree.dashboard.tree import TreeViews
from stagetree.dashboard.views import DashboardViews
from stagetree.master.api.openapi import responses
from stagetree.master.api.rest import PREFIX, PlanKey, StudyId, Who
from stagetree.master.auth import Principal
from stagetree.master.curves import MAX_POINTS, CurveService
from stagetree.master.service import CH_CURVES, CH_RESULTS, CH_ROUND, MAX_ID_LEN
from stagetree.master.store.activity import ActivityReader

if TYPE_CHECKING:
    from stagetree.master.app import MasterApp

STATIC = Path(__file__).parent / "static"
EVENT_MIN_GAP_S = 0.1
KEEPALIVE_S = 15.0
CURVE_LATE_S = 2.0  # how late a curve point may be stored with an earlier time than the latest seen
DEFAULT_CURVE_POINTS = 20_000  # what the study page asks for: enough for the eye, light for the browser

# A source of the latest GPU samples (the embedded mode's aggregator keeps them); none in cluster mode
Telemetry = Callable[[], Sequence[Mapping[str, Any]]]

Id = Annotated[int, PathParam(ge=1, le=INT64_MAX)]


def add_dashboard_routes(api: FastAPI, master: MasterApp) -> None:
    views = DashboardViews(master.service)
    trees = TreeViews(master.service)
    clusters = ClusterViews(master.service, lambda: master.worker_logs)
    curves = CurveService(master.service)
    activity = ActivityReader(master.store.db)
    curve_answers: VersionedCache[dict[str, Any]] = VersionedCache(size=16)  # see ``cache``

    api.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")

    @api.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    @api.get("/dashboard", include_in_schema=False)
    def dashboard_no_slash() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    @api.get("/dashboard/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})

    @api.get(f"{PREFIX}/dashboard/studies", responses=responses(), response_model=list[schemas.StudyRow])
    def studies(who: Who) -> Any:
        """Every study of the caller: its state, when it ran and for how long, its requests and trials by
        state, best trial, merge rate and compute saved."""
        return views.studies(who)

    @api.get(f"{PREFIX}/dashboard/studies/{{study_id}}", responses=responses(404), response_model=schemas.StudyPage)
    def study(study_id: StudyId, who: Who) -> Any:
        """A study's trials (each with its rungs, schedule, tuned choices, metrics and error), the best
        trial, and how much each tuned choice matters to each evaluation metric."""
        return JSONResponse(views.study(who, study_id))  # large: written as built (its shape is tested)

    @api.get(
        f"{PREFIX}/dashboard/studies/{{study_id}}/trial", responses=responses(404), response_model=schemas.TrialPage
    )
    def trial(
        study_id: StudyId,
        who: Who,
        label: Annotated[str | None, Query(min_length=1, max_length=MAX_ID_LEN)] = None,
        request_id: Annotated[int | None, Query(ge=1, le=INT64_MAX)] = None,
    ) -> Any:
        """One trial, by its label or by any of its requests' ids: its schedule over every step, rungs,
        learning curve, failure (what was raised, the traceback, where the worker's log is), the batch
        attempts that ran it and which of its steps it shares with which other trials."""
        return views.trial(who, study_id, label, request_id)

    @api.get(f"{PREFIX}/dashboard/studies/{{study_id}}/tree", responses=responses(404), response_model=schemas.Tree)
    def tree(study_id: StudyId, who: Who, plan_key: PlanKey = "") -> Any:
        """The study's plan: each node's span, what was trained of it and its own state, checkpoints and
        how many trials pass through it; and each trial's last node (to find it in the tree)."""
        # large (2 MB at 10,000 nodes): written as built and kept encoded (its shape is tested)
        return Response(trees.tree_json(who, study_id, plan_key), media_type="application/json")

    @api.get(
        f"{PREFIX}/dashboard/studies/{{study_id}}/tree/nodes/{{node_id}}",
        responses=responses(404),
        response_model=schemas.TreeNodeDetail,
    )
    def tree_node(study_id: StudyId, node_id: Id, who: Who, plan_key: PlanKey = "") -> Any:
        """One node of the study's plan: its schedule on its span, checkpoints, evaluations, curve points,
        path changes and the trials through it."""
        return trees.node(who, study_id, node_id, plan_key)

    @api.get(f"{PREFIX}/dashboard/studies/{{study_id}}/curves", responses=responses(404), response_model=schemas.Curves)
    def study_curves(
        study_id: StudyId,
        who: Who,
        metric: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
        kind: Annotated[
            Literal["step", "eval"] | None,
            Query(description="step: what train() returned, per plan node; eval: what evaluate() returned, per trial"),
        ] = None,
        max_points: Annotated[int, Query(ge=0, le=MAX_POINTS)] = DEFAULT_CURVE_POINTS,
        since: Annotated[float | None, Query(ge=0, le=1e12, allow_inf_nan=False)] = None,
        times: Annotated[bool, Query(description="with when each step point was recorded (a wall-time axis)")] = False,
        plan_key: PlanKey = "",
    ) -> Any:
        """A metric's curves. Step metrics: each plan node's own ``[step, value]`` points (a shared step
        once), thinned to about ``max_points`` in all; with ``since``, only points recorded after it
        (``as_of`` is the next call's ``since``). Evaluation metrics: each trial's rungs as ``[step, value,
        answered at]``. Without ``metric``: the step curves' first loss-like metric, or the first
        evaluation metric when there is no step curve. ``metrics`` lists the step metrics when ``metric``
        or ``kind`` is not given, ``eval_metrics`` the evaluation metrics when they were read."""
        as_of = time.time()  # before anything is read: the next call's ``since``
        if since is None:  # a whole answer: kept while the plan's curves and the study's requests are unchanged
            st = master.service.get_study(who, study_id)
            _key, pid = master.service.study_plan(who, study_id, plan_key)
            version = (
                len(master.service.plans.refresh(pid).nodes),
                activity.curve_version(pid),
                activity.request_version(st.id),
            )
            got = curve_answers.get(
                (st.id, pid, metric, kind, max_points, times),
                version,
                lambda: read_curves(who, study_id, metric, kind, max_points, None, times, plan_key),
            )
        else:
            got = read_curves(who, study_id, metric, kind, max_points, since, times, plan_key)
        # large (20,000 points by default): written as built, its shape tested against the spec, where
        # validating it through the response model cost several times the encoding (tests/bench/dashboard)
        return JSONResponse({**got, "as_of": as_of if got["kind"] is not None else None})

    def read_curves(
        who: Principal,
        study_id: str,
        metric: str | None,
        kind: str | None,
        max_points: int,
        since: float | None,
        times: bool,
        plan_key: str,
    ) -> dict[str, Any]:
        names = curves.metric_names(who, study_id, plan_key) if metric is None or kind is None else []
        evals: list[str] = []  # listed when they are read anyway (the study page has them already)
        if kind is None:
            if metric is None:
                metric = next((n for n in names if "loss" in n.lower()), names[0] if names else None)
                kind = "step" if metric is not None else None
                if metric is None:
                    evals = views.eval_metrics(who, study_id)
                    metric, kind = (evals[0], "eval") if evals else (None, None)
            elif metric not in names:
                evals = views.eval_metrics(who, study_id)
                kind = "eval" if metric in evals else "step"
            else:
                kind = "step"
        if kind == "eval" and not evals:
            evals = views.eval_metrics(who, study_id)
        out: dict[str, Any] = {"metric": metric, "kind": kind, "metrics": names, "eval_metrics": evals}
        if metric is None:
            return {**out, "kind": None}
        if kind == "eval":
            return {**out, "trials": views.eval_curves(who, study_id, metric)}
        got = curves.plan_curves(who, study_id, plan_key, max_points, since=since, metric=metric, timed=times)
        out["nodes"] = [
            {
                "node": c.node,
                "parent": c.parent,
                "start": c.start,
                "total": c.total,
                "points": c.series,
                "times": c.times if times else None,
            }
            for c in got
            if c.series or since is None
        ]
        return out

    @api.get(
        f"{PREFIX}/dashboard/studies/{{study_id}}/batches/{{batch_id}}/log",
        responses=responses(404),
        response_model=schemas.WorkerLog,
    )
    def worker_log(
        study_id: StudyId,
        batch_id: Id,
        who: Who,
        attempt: Annotated[int, Query(ge=1, le=1 << 31)] = 1,
        tail_bytes: Annotated[int, Query(ge=1, le=MAX_LOG_TAIL_BYTES)] = LOG_TAIL_BYTES,
    ) -> Any:
        """The end of the worker log of a batch attempt that ran for the study: its text where this master
        can read it (the embedded mode), else which host keeps it."""
        return clusters.worker_log(who, study_id, batch_id, attempt, tail_bytes)

    @api.get(
        f"{PREFIX}/dashboard/cluster",
        responses=responses(),
        response_model=schemas.Cluster,
        response_model_exclude_unset=True,  # another owner's work: {"busy": true, "sent_ahead": ...} only
    )
    def cluster(who: Who) -> Any:
        """The hosts (node managers), their slots and what runs on each (the caller's work in detail:
        which study and trials; a batch sent ahead apart), GPU telemetry when there is any, the slots'
        utilisation over the last half hour, and the caller's recent failures and policy decisions."""
        source: Telemetry | None = master.telemetry
        return clusters.cluster(who, source() if source is not None else ())

    @api.get(
        f"{PREFIX}/dashboard/events",
        response_class=StreamingResponse,
        responses={
            **responses(404),
            200: {"content": {"text/event-stream": {}}, "description": "server-sent events; never ends"},
        },
    )
    async def events(
        request: Request,
        who: Who,
        study: Annotated[
            str | None, Query(min_length=1, max_length=MAX_ID_LEN, description="only this study's changes")
        ] = None,
        since: Annotated[
            float | None,
            Query(
                ge=0,
                le=1e12,
                allow_inf_nan=False,
                description="with study: the as_of of the page's curves; points recorded after it are announced "
                "at once (they may have arrived before the stream was open)",
            ),
        ] = None,
    ) -> StreamingResponse:
        """Server-sent events: ``counts`` when request states changed, ``curves`` when curve points
        arrived (see the module doc); with ``study``, that study's only, and with ``since`` a ``curves``
        event first when the study has points recorded after it."""
        scope = await asyncio.to_thread(_Scope.open, master, activity, who, study, since) if study is not None else None
        subs = {
            "counts": [await master.coordination.subscribe(CH_RESULTS), await master.coordination.subscribe(CH_ROUND)],
            "curves": [await master.coordination.subscribe(CH_CURVES)],
        }

        async def stream() -> AsyncIterator[bytes]:
            try:
                yield b"retry: 2000\nevent: hello\ndata: {}\n\n"
                if scope is not None and scope.caught_up is False:  # points between the page's read and now
                    yield f"event: curves\ndata: {time.time():.3f}\n\n".encode()
                last_keepalive = time.monotonic()
                while not await request.is_disconnected():
                    waits = {
                        asyncio.ensure_future(sub.wait(KEEPALIVE_S)): name for name, ss in subs.items() for sub in ss
                    }
                    done, pending = await asyncio.wait(waits, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED)
                    for t in pending:
                        t.cancel()
                    fired = sorted({waits[t] for t in done if t.result()})
                    if scope is not None and fired:
                        fired = await asyncio.to_thread(scope.changed, fired)
                    for name in fired:
                        yield f"event: {name}\ndata: {time.time():.3f}\n\n".encode()
                    if not fired and time.monotonic() - last_keepalive >= KEEPALIVE_S - 0.5:
                        yield b": keepalive\n\n"
                        last_keepalive = time.monotonic()
                    await asyncio.sleep(EVENT_MIN_GAP_S)
            finally:
                for ss in subs.values():
                    for sub in ss:
                        await sub.close()

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"cache-control": "no-cache", "x-accel-buffering": "no"}
        )


class _Scope:
    """What one study's event stream last saw: its requests by state, its plans' latest curve point."""

    def __init__(self, master: MasterApp, activity: ActivityReader, study_id: str, since: float | None = None) -> None:
        self.master = master
        self.activity = activity
        self.study_id = study_id
        self.requests = activity.request_version(study_id)
        self.plans = master.store.plans.study_plan_ids(study_id)
        self.curve_at = activity.latest_curve_time()  # the writers' clock, not this host's
        # whether the page that opens the stream has every point: None when it did not say what it read
        self.caught_up: bool | None = None
        if since is not None:
            self.curve_at = min(self.curve_at, since)
            self.caught_up = "curves" not in self.changed(["curves"])

    @classmethod
    def open(
        cls, master: MasterApp, activity: ActivityReader, who: Principal, study_id: str, since: float | None = None
    ) -> _Scope:
        study = master.service.get_study(who, study_id)  # NotFound (404) for another owner's study
        return cls(master, activity, study.id, since)

    def changed(self, fired: Sequence[str]) -> list[str]:
        """Of the events that ``fired``, those that changed this study."""
        out = []
        if "counts" in fired:
            now = self.activity.request_version(self.study_id)
            if now != self.requests:
                self.requests = now
                self.plans = self.master.store.plans.study_plan_ids(self.study_id)  # a new fixed part: a new plan
                out.append("counts")
        if "curves" in fired:
            latest = self.activity.curve_points_since(self.plans, self.curve_at - CURVE_LATE_S)
            if latest is not None and latest > self.curve_at:
                self.curve_at = latest
                out.append("curves")
        return out
