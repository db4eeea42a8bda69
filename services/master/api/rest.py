"""REST adapter (FastAPI, OpenAPI at ``/api/v1/openapi.json``): the same use cases as gRPC.

Owns only translation: JSON bodies to use-case arguments (configs as JSON objects here, serialized
to the core's JSON text), records to JSON, and domain errors to HTTP statuses through
``stagetree.status.status_of``. Routes are plain ``def``: FastAPI runs them in its thread pool, as the
use cases are synchronous; the long poll is ``async`` and runs them in threads itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING, Annotated, Any, get_args

from fastapi import FastAPI, Path, Query, Request, Security
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from stagetree.core.batch import MAX_CURVE_EVERY_STEPS, MAX_CURVE_RATE
from stagetree.core.errors import StagetreeError
from stagetree.core.loglines import MAX_LINE_CHARS, MAX_LINES
from stagetree.core.searchplan import MAX_STEP
from stagetree.core.seqforms import config_family_json
from stagetree.core.text import INT64_MAX
from stagetree.master import metrics as prometheus
from stagetree.master.api.admission import AdmissionGuard
from stagetree.master.api.guard import BodyGuard
from stagetree.master.api.openapi import (
    MAX_ID_LEN,
    MetricValue,
    StudyFixedJson,
    TrialConfigJson,
    add_components,
    responses,
    text,
)
from stagetree.master.auth import Principal, bearer
from stagetree.master.service import CH_RESULTS, SubmitItem
from stagetree.master.store.records import RequestRecord, SlotInfo, StudyRecord
from stagetree.status import INTERNAL, status_of

if TYPE_CHECKING:
    from stagetree.master.app import MasterApp

log = logging.getLogger(__name__)
PREFIX = "/api/v1"
KEPT_PLANS = "kept: they belong to the owner's scope; 'stagetree plan forget' drops what they computed"
MAX_WAIT_S = 60.0  # the longest a long poll may hold a request
# documented here, judged by core.searchplan.check_step (the one place, for gRPC too)
STEP = Field(description="training steps", json_schema_extra={"minimum": 0, "maximum": MAX_STEP})


class In(BaseModel):
    """A request body: where the spec says number, true and false are refused (pydantic would read them as
    1 and 0)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, bool) and info.field_name:
            kind = cls.model_fields[info.field_name].annotation
            if {kind, *get_args(kind)} & {int, float}:
                raise ValueError("must be a number, not true or false")
        return v


class StudyIn(In):
    name: str = Field(json_schema_extra=text(256, blank=False))  # maxLength: the master's max_name_len
    fixed: StudyFixedJson | None = None
    retry_user_errors: bool = Field(
        False,
        strict=True,  # JSON true/false only, as the spec says (not 0, 1 or "yes")
        description="retry work whose failure was the user's code raising (default: it fails at once)",
    )
    curve_every_steps: int | None = Field(
        None,
        ge=0,
        le=MAX_CURVE_EVERY_STEPS,
        description="learning curves: a point every this many steps (0: no curve; default: the master's)",
    )
    curve_max_per_s: float | None = Field(
        None,
        ge=0,
        le=MAX_CURVE_RATE,
        allow_inf_nan=False,
        strict=True,  # a JSON number: not false, not "5"
        description="learning curves: at most this many points a second per batch (0: no limit; default: the master's)",
    )


class StudyOut(BaseModel):
    id: str
    name: str
    owner: str
    fixed: StudyFixedJson | None
    created_at: float
    retry_user_errors: bool = False
    curve_every_steps: int | None = None
    curve_max_per_s: float | None = None


class ItemIn(In):
    client_request_id: str = Field(
        json_schema_extra=text(MAX_ID_LEN),
        description="the caller's id of this request: sent again (in this batch or a later one) with the same "
        "item, it answers with the same request; with another item, 409",
    )
    config: TrialConfigJson = Field(description='{"fixed": {...}, "tuned": {name: sequence}}; fixed may be omitted')
    step: int = STEP
    label: str = Field(
        "", json_schema_extra=text(MAX_ID_LEN, empty=True), description="the tuner's trial this request belongs to"
    )


class SubmitIn(BaseModel):
    items: list[ItemIn] = Field(json_schema_extra={"minItems": 1})  # maxItems: the master's max_batch_items


class RequestOut(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")  # a diverged loss: "NaN", as openapi.METRIC_VALUE says

    request_id: int
    client_request_id: str
    state: str
    metrics: dict[str, MetricValue] | None
    node: int
    step: int
    error: str | None = None
    label: str = ""
    plan_key: str = Field("", description="the plan the request is on (set when listing a study's requests)")
    code_version: str = Field(
        "", description="the trainer code version of that plan (set when listing): results of edited code differ"
    )


class LogLineOut(BaseModel):
    batch_id: int
    attempt: int
    seq: int = Field(description="the line's place among its batch attempt's lines")
    node: int = Field(description="the plan node the batch was training when its trainer logged the line")
    step: int
    at: float = Field(description="when the trainer logged it (epoch seconds, its host's clock)")
    line: str


class RequestLogOut(BaseModel):
    request_id: int
    lines: list[LogLineOut]


class StudyDeleted(BaseModel):
    id: str
    requests_deleted: int
    plans: str = Field(description="what happened to the study's plans")


class MetricsQuery(In):
    config: TrialConfigJson
    step: int = STEP


class MetricsOut(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")

    found: bool
    metrics: dict[str, MetricValue] | None = None
    node: int | None = None
    step: int | None = None


class SlotIn(In):
    id: str = Field(json_schema_extra=text(MAX_ID_LEN), description="distinct among the node manager's slots")
    gpu_type: str = Field(default="cpu", json_schema_extra=text(64))
    memory_bytes: int = Field(default=0, ge=0, le=INT64_MAX)
    compute_capability: str = Field(default="", json_schema_extra=text(16, empty=True))
    share: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False, strict=True)
    cpu_cores: int = Field(default=0, ge=0, le=1 << 16)
    gpu_index: int = Field(default=-1, ge=-1, le=1 << 10)


class NodeManagerIn(BaseModel):
    node_manager_id: str = Field(json_schema_extra=text(MAX_ID_LEN))
    address: str = Field("", json_schema_extra=text(256, empty=True))
    slots: list[SlotIn] = Field(min_length=1)


_scheme = HTTPBearer(auto_error=False, description="a user's token, or the admin token for /hosts")


def _principal(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Security(_scheme)] = None
) -> Principal:
    token = bearer(f"Bearer {creds.credentials}") if creds is not None else None
    return request.app.state.master.auth.authenticate(token)  # type: ignore[no-any-return]


Who = Annotated[Principal, Security(_principal)]
RequestId = Annotated[int, Path(ge=1, le=INT64_MAX)]
StudyId = Annotated[str, Path(json_schema_extra=text(MAX_ID_LEN))]
PlanKey = Annotated[
    str, Query(json_schema_extra=text(MAX_ID_LEN, empty=True), description="which plan (default: the study's own)")
]


def _study(s: StudyRecord) -> StudyOut:
    return StudyOut(
        id=s.id,
        name=s.name,
        owner=s.owner,
        fixed=None if s.fixed_json is None else json.loads(s.fixed_json),
        created_at=s.created_at,
        retry_user_errors=s.retry_user_errors,
        curve_every_steps=s.curve_every_steps,
        curve_max_per_s=s.curve_max_per_s,
    )


def _node_config(config_json: str) -> dict[str, Any]:
    """A plan node's config: ``config`` in the family form a user submits (``core.seqforms``), and
    ``segments``, the canonical segments the plan compares (the unit of sharing)."""
    segments = json.loads(config_json)
    return {"config": config_family_json(segments), "segments": segments}


def _request(r: RequestRecord, plan: tuple[str, str] = ("", "")) -> RequestOut:
    """A request as JSON; ``plan``: its plan's key and code version, where the call lists them."""
    return RequestOut(
        request_id=r.id,
        client_request_id=r.client_request_id,
        state=r.state,
        metrics=r.metrics,
        node=r.node,
        step=r.step,
        error=r.error,
        label=r.label,
        plan_key=plan[0],
        code_version=plan[1],
    )


DOCS_ASSETS = f"{PREFIX}/docs/assets"


def mount_docs(api: FastAPI) -> None:
    """``/api/v1/docs``: Swagger UI over the spec, its scripts and styles served by the master itself
    (``swagger-ui-bundle``), so the page loads on a cluster with no route to a CDN."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles
    from swagger_ui_bundle import swagger_ui_path

    api.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_path), name="docs-assets")

    @api.get(f"{PREFIX}/docs", include_in_schema=False)
    async def _docs() -> Response:
        return get_swagger_ui_html(
            openapi_url=f"{PREFIX}/openapi.json",
            title="stagetree master: REST API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )


def _methods(route: BaseRoute) -> set[str]:
    return set(getattr(route, "methods", None) or ())


def create_rest_app(master: MasterApp) -> FastAPI:
    svc = master.service
    api = FastAPI(
        title="stagetree master",
        version="1",
        openapi_url=f"{PREFIX}/openapi.json",
        docs_url=None,  # served below from the packaged Swagger UI: the page works with no internet
        redoc_url=None,
    )
    mount_docs(api)
    api.state.master = master
    api.add_middleware(BodyGuard, max_bytes=master.settings.limits.max_body_bytes)
    api.add_middleware(AdmissionGuard, admission=master.admission)  # outermost: a shed call reads nothing

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            spec = get_openapi(title=api.title, version=api.version, routes=api.routes, description=api.description)
            api.openapi_schema = add_components(spec, master.settings.limits)
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]

    @api.exception_handler(RequestValidationError)
    async def _bad_shape(_req: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer echoes each bad input, which may not be JSON-serializable: say where and why
        detail = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        message = "; ".join(f"{'.'.join(str(x) for x in d['loc'])}: {d['msg']}" for d in detail[:5])
        return JSONResponse(
            status_code=422, content={"error": "INVALID_ARGUMENT", "message": message, "detail": detail}
        )

    @api.exception_handler(StarletteHTTPException)
    async def _no_route(req: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code != 405:
            return await http_exception_handler(req, exc)
        # Starlette names the methods of the first route on the path only: name them all (RFC 9110)
        allowed = sorted({m for r in api.router.routes if r.matches(req.scope)[0] != Match.NONE for m in _methods(r)})
        return JSONResponse(
            status_code=405,
            content={"error": "UNIMPLEMENTED", "message": f"{req.method} is not served here; use {', '.join(allowed)}"},
            headers={"Allow": ", ".join(allowed)},
        )

    @api.exception_handler(StagetreeError)
    async def _domain_error(_req: Request, exc: StagetreeError) -> JSONResponse:
        return JSONResponse(status_code=status_of(exc).http, content={"error": exc.code, "message": exc.message})

    @api.exception_handler(Exception)
    async def _internal_error(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error in REST call", exc_info=exc)
        return JSONResponse(
            status_code=INTERNAL.http, content={"error": INTERNAL.grpc.name, "message": "internal error; see the log"}
        )

    @api.get("/metrics", include_in_schema=False)
    def prometheus_metrics() -> Response:
        # Prometheus text format; installation-wide totals only, no owner's data (docs/metrics.md)
        body, content_type = prometheus.exposition()
        return Response(body, media_type=content_type)

    @api.get(f"{PREFIX}/health", responses={503: responses()[503]})
    def health() -> dict[str, str]:
        master.store.studies.list_studies("")  # a round trip: the database answers
        return {"status": "ok"}

    @api.post(f"{PREFIX}/studies", status_code=201, responses=responses(409, 413))
    def create_study(body: StudyIn, who: Who) -> StudyOut:
        fixed = "" if body.fixed is None else json.dumps(body.fixed)
        return _study(
            svc.create_study(
                who,
                body.name,
                fixed,
                retry_user_errors=body.retry_user_errors,
                curve_every_steps=body.curve_every_steps,
                curve_max_per_s=body.curve_max_per_s,
            )
        )

    @api.get(f"{PREFIX}/studies", responses=responses())
    def list_studies(who: Who) -> list[StudyOut]:
        return [_study(s) for s in svc.list_studies(who)]

    @api.get(f"{PREFIX}/studies/{{study_id}}", responses=responses(404))
    def get_study(study_id: StudyId, who: Who) -> StudyOut:
        return _study(svc.get_study(who, study_id))

    @api.delete(f"{PREFIX}/studies/{{study_id}}", responses=responses(404, 413))
    def delete_study(study_id: StudyId, who: Who) -> StudyDeleted:
        """Cancel the study's live requests, then delete it and its requests. Its plans are kept: they
        belong to the owner (or team) and keep answering other studies; ``POST .../plan/forget`` first
        to drop what they computed."""
        n = svc.delete_study(who, study_id)
        return StudyDeleted(id=study_id, requests_deleted=n, plans=KEPT_PLANS)

    @api.get(f"{PREFIX}/studies/{{study_id}}/stats", responses=responses(404))
    def stats(
        study_id: StudyId,
        who: Who,
        code_version: Annotated[
            str | None, Query(max_length=128, description="only the requests of this trainer code version")
        ] = None,
    ) -> dict[str, Any]:
        """What sharing bought the study: steps executed, unique and trial-by-trial, merge rate, compute
        seconds used and saved (definitions: ``stagetree.core.sharing``)."""
        return svc.study_stats(who, study_id, code_version).to_json()

    @api.post(f"{PREFIX}/studies/{{study_id}}/plan/forget", responses=responses(404, 412, 413))
    def forget_plan(study_id: StudyId, who: Who, plan_key: PlanKey = "") -> dict[str, int]:
        """Drop the plan's checkpoints and metrics and the finished requests they answered (every study of
        the owner's scope); refused (412) while a request on it is live."""
        return dataclasses.asdict(svc.forget_plan(who, study_id, plan_key))

    @api.post(f"{PREFIX}/studies/{{study_id}}/requests", responses=responses(404, 409, 413))
    def submit(study_id: StudyId, body: SubmitIn, who: Who) -> list[RequestOut]:
        items = [SubmitItem(i.client_request_id, json.dumps(i.config), i.step, i.label) for i in body.items]
        return [_request(r) for r in svc.submit(who, study_id, items)]

    @api.get(f"{PREFIX}/studies/{{study_id}}/requests", responses=responses(404))
    async def get_requests(
        study_id: StudyId,
        who: Who,
        ids: Annotated[list[Annotated[int, Field(ge=1, le=INT64_MAX)]] | None, Query()] = None,
        wait_s: Annotated[
            float,
            Query(ge=0, le=MAX_WAIT_S, description="long poll: answer once every listed request has finished"),
        ] = 0,
    ) -> list[RequestOut]:
        """The study's requests (or those ``ids``). With ``wait_s``, the answer waits until all of them are
        DONE, FAILED or CANCELLED, or ``wait_s`` seconds have passed, so a CI job need not poll hard."""
        deadline = time.monotonic() + wait_s
        wakeups = await master.coordination.subscribe(CH_RESULTS) if wait_s > 0 else None
        try:
            while True:
                recs = await asyncio.to_thread(svc.get_requests, who, study_id, ids)
                left = deadline - time.monotonic()
                if wakeups is None or left <= 0 or all(r.state.is_finished() for r in recs):
                    plans = await asyncio.to_thread(svc.plan_versions, {r.plan_id for r in recs})
                    return [_request(r, plans[r.plan_id]) for r in recs]
                await wakeups.wait(min(left, 1.0))
        finally:
            if wakeups is not None:
                await wakeups.close()

    @api.delete(f"{PREFIX}/studies/{{study_id}}/requests/{{request_id}}", responses=responses(404, 413))
    def cancel(study_id: StudyId, request_id: RequestId, who: Who) -> RequestOut:
        return _request(svc.cancel(who, study_id, request_id))

    @api.get(
        f"{PREFIX}/studies/{{study_id}}/requests/{{request_id}}/logs",
        responses=responses(404),
        description="The text lines the trainer logged (`self.log_text`) in every batch attempt that trained "
        f"the request, in the order they ran. A batch attempt keeps at most {MAX_LINES} lines of at most "
        f"{MAX_LINE_CHARS} characters (docs/trainers.md).",
    )
    def request_log(study_id: StudyId, request_id: RequestId, who: Who) -> RequestLogOut:
        lines = svc.request_log(who, study_id, request_id)
        return RequestLogOut(request_id=request_id, lines=[LogLineOut(**dataclasses.asdict(ln)) for ln in lines])

    @api.post(f"{PREFIX}/studies/{{study_id}}/metrics/query", responses=responses(404, 413))
    def metrics(study_id: StudyId, body: MetricsQuery, who: Who) -> MetricsOut:
        point, values = svc.get_metrics(who, study_id, json.dumps(body.config), body.step)
        if point is None or values is None:
            return MetricsOut(found=False)
        return MetricsOut(found=True, metrics=values, node=point.node, step=point.step)

    @api.get(f"{PREFIX}/studies/{{study_id}}/plan", responses=responses(404))
    def plan(study_id: StudyId, who: Who, plan_key: PlanKey = "") -> dict[str, Any]:
        view = svc.get_plan(who, study_id, plan_key)
        return {
            "key": view.key,
            "fixed": json.loads(view.fixed_json),
            "nodes": [
                {
                    "id": n.id,
                    "parent": n.parent,
                    "start": n.start,
                    **_node_config(n.config_json),
                    "requests": n.requests,
                    "checkpoint_steps": n.checkpoints,
                    "metric_steps": n.metrics,
                    "path_changes": [c.to_json() for c in n.path_changes],
                }
                for n in view.nodes
            ],
        }

    # The hosts: the node managers and their slots ("node" names a node of a search plan only). ``/nodes``
    # is a deprecated alias, kept for one release.
    def register_host(body: NodeManagerIn, who: Who) -> dict[str, str]:
        who.require_admin()
        master.coordination.heartbeat(body.node_manager_id, master.settings.scheduling.heartbeat_ttl_s)
        svc.register_node_manager(
            who, body.node_manager_id, body.address, [SlotInfo(**s.model_dump()) for s in body.slots]
        )
        return {"node_manager_id": body.node_manager_id}

    def list_hosts(who: Who) -> list[dict[str, Any]]:
        return [
            {
                "node_manager_id": n.id,
                "address": n.address,
                "state": n.state,
                "last_heartbeat": n.last_heartbeat,
                "slots": [dataclasses.asdict(i) for i in n.slots],
            }
            for n in svc.list_node_managers(who)
        ]

    for path, old in ((f"{PREFIX}/hosts", False), (f"{PREFIX}/nodes", True)):
        note = "Deprecated: an alias of `/hosts`, removed in the next release. " if old else ""
        api.post(
            path,
            status_code=201,
            responses=responses(403, 409, 413),
            deprecated=old,
            description=note
            + "Register a host: a node manager and its slots (admin token; node managers do this over gRPC).",
        )(register_host)
        api.get(
            path,
            responses=responses(403),
            deprecated=old,
            description=note + "The hosts: each node manager, its state, last heartbeat and slots (admin token).",
        )(list_hosts)

    # modules whose routes import this one's types: the learning curves, and the dashboard
    from stagetree.dashboard.routes import add_dashboard_routes
    from stagetree.master.api.curves import add_curve_routes

    add_curve_routes(api, master)
    add_dashboard_routes(api, master)
    return api
