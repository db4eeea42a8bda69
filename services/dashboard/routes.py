"""The dashboard's HTTP side, added to the master's FastAPI app by ``create_rest_app``.

- ``/`` and ``/dashboard`` redirect to ``/dashboard/``: the single page (``static/index.html``); its
  modules and ECharts under ``/dashboard/static/``. These carry no data and need no token.
- ``/api/v1/dashboard/...``: each page's JSON (``views``), with the REST API's bearer tokens and
  owner isolation (another owner's study is a 404).
- ``/api/v1/dashboard/events``: server-sent events fed by the master's wake-up channels: ``results``
  and ``round`` become ``counts`` (request states changed), ``curves`` becomes ``curves`` (new
  learning-curve points), each at most every ``EVENT_MIN_GAP_S``; a comment every ``KEEPALIVE_S``.
  The page reads it with ``fetch`` (so the token travels in the header, never in a URL) and falls
  back to polling when the stream breaks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from stagetree.dashboard.views import DashboardViews
from stagetree.master.api.openapi import responses
from stagetree.master.api.rest import PREFIX, Who
from stagetree.master.curves import MAX_POINTS, CurveService
from stagetree.master.service import CH_CURVES, CH_RESULTS, CH_ROUND

if TYPE_CHECKING:
    from stagetree.master.app import MasterApp

STATIC = Path(__file__).parent / "static"
EVENT_MIN_GAP_S = 0.1
KEEPALIVE_S = 15.0
DEFAULT_CURVE_POINTS = 20_000  # what the study page asks for: enough for the eye, light for the browser

# A source of the latest GPU samples (the embedded mode's aggregator keeps them); none in cluster mode
Telemetry = Callable[[], Sequence[Mapping[str, Any]]]


def add_dashboard_routes(api: FastAPI, master: MasterApp) -> None:
    views = DashboardViews(master.service)
    curves = CurveService(master.service)

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

    @api.get(f"{PREFIX}/dashboard/studies", responses=responses())
    def studies(who: Who) -> list[dict[str, Any]]:
        """Every study of the caller with its state counts, best metric, merge rate and compute saved."""
        return views.studies(who)

    @api.get(f"{PREFIX}/dashboard/studies/{{study_id}}", responses=responses(404))
    def study(study_id: str, who: Who) -> dict[str, Any]:
        """A study's trials (readable schedules, hyper-parameter values, metrics, errors) and best trial."""
        return views.study(who, study_id)

    @api.get(f"{PREFIX}/dashboard/studies/{{study_id}}/tree", responses=responses(404))
    def tree(study_id: str, who: Who, plan_key: str = "") -> dict[str, Any]:
        """The study's plan as a tree: nodes with span, state, checkpoints, curve points and trials."""
        return views.tree(who, study_id, plan_key)

    @api.get(f"{PREFIX}/dashboard/studies/{{study_id}}/curves", responses=responses(404))
    def study_curves(
        study_id: str,
        who: Who,
        metric: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
        max_points: Annotated[int, Query(ge=0, le=MAX_POINTS)] = DEFAULT_CURVE_POINTS,
        since: Annotated[float | None, Query(ge=0, allow_inf_nan=False)] = None,
        plan_key: str = "",
    ) -> dict[str, Any]:
        """Each plan node's own points of ``metric`` as ``[step, value]`` pairs (a shared step once),
        thinned to about ``max_points`` in all; with ``since``, only points recorded after it. ``as_of``
        is the ``since`` of the next call. Without ``metric``: the curves' first loss-like metric (so the
        page asks for its curves and its trials at once), and ``metrics`` lists what the curves hold."""
        as_of = time.time()
        names = curves.metric_names(who, study_id, plan_key) if metric is None else []
        if metric is None:
            metric = next((n for n in names if "loss" in n.lower()), names[0] if names else None)
            if metric is None:
                return {"as_of": None, "metric": None, "metrics": [], "nodes": []}
        got = curves.plan_curves(who, study_id, plan_key, max_points, since=since, metric=metric)
        return {
            "as_of": as_of,
            "metric": metric,
            "metrics": names,
            "nodes": [
                {
                    "node": c.node,
                    "parent": c.parent,
                    "start": c.start,
                    "total": c.total,
                    "points": c.series,
                }
                for c in got
                if c.series or since is None
            ],
        }

    @api.get(f"{PREFIX}/dashboard/cluster", responses=responses(403))
    def cluster(who: Who) -> dict[str, Any]:
        """Node managers, their slots and what runs on each (the caller's work in detail), GPU telemetry
        when there is any, and recent policy decisions on the caller's studies."""
        source: Telemetry | None = master.telemetry
        return views.cluster(who, source() if source is not None else ())

    @api.get(
        f"{PREFIX}/dashboard/events",
        response_class=StreamingResponse,
        responses={
            **responses(),
            200: {"content": {"text/event-stream": {}}, "description": "server-sent events; never ends"},
        },
    )
    async def events(request: Request, who: Who) -> StreamingResponse:
        """Server-sent events: ``counts`` when request states changed, ``curves`` when curve points
        arrived (see the module doc)."""
        del who  # authenticated; the events say only "look again", each page reads through its own checks
        subs = {
            "counts": [await master.coordination.subscribe(CH_RESULTS), await master.coordination.subscribe(CH_ROUND)],
            "curves": [await master.coordination.subscribe(CH_CURVES)],
        }

        async def stream() -> AsyncIterator[bytes]:
            try:
                yield b"retry: 2000\nevent: hello\ndata: {}\n\n"
                last_keepalive = time.monotonic()
                while not await request.is_disconnected():
                    waits = {
                        asyncio.ensure_future(sub.wait(KEEPALIVE_S)): name for name, ss in subs.items() for sub in ss
                    }
                    done, pending = await asyncio.wait(waits, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED)
                    for t in pending:
                        t.cancel()
                    fired = sorted({waits[t] for t in done if t.result()})
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
