"""gRPC adapter (``stagetree.v1.MasterService`` on ``grpc.aio``): protobuf in, use cases, protobuf out.

Owns only translation: the bearer token from metadata, messages to use-case arguments, records to
messages, and domain errors to status codes through ``stagetree.status.status_of``. Use cases are
synchronous and run in a worker thread; streams wait on coordination wake-ups with a polling fallback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from stagetree.bus.messages import BatchMessage
from stagetree.core.errors import InvalidArgument, StagetreeError
from stagetree.core.lifecycle import (
    FINISHED_REQUEST_STATES,
)
from stagetree.core.sharing import SharingStats
from stagetree.core.text import check_id
from stagetree.master.api.admission import RETRY_AFTER_MD, Admission
from stagetree.master.api.assignment_hub import STREAM_POLL_S, AssignmentHub
from stagetree.master.api.grouping import Grouper
from stagetree.master.api.grpc_guard import GuardedRegistration
from stagetree.master.api.reports import messages_of
from stagetree.master.api.results_hub import ResultsHub
from stagetree.master.auth import Authenticator, Principal, bearer
from stagetree.master.coordination import Coordination, Subscription
from stagetree.master.curves import CurveService
from stagetree.master.service import (
    MasterService,
    SubmitItem,
    ch_node_manager,
)
from stagetree.master.store.records import RequestRecord, SlotInfo, StudyRecord
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from stagetree.status import status_of

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_S = 1.0  # a stream re-checks at least this often even when a wake-up is missed
HEARTBEAT_GROUP = 256  # heartbeats per transaction at most
Beat = tuple[Principal, str, list[tuple[int, int]] | None]  # who, node manager, the attempts it lists


def study_pb(s: StudyRecord) -> pb.Study:
    return pb.Study(
        id=s.id,
        name=s.name,
        owner=s.owner,
        fixed_json=s.fixed_json or "",
        created_at=s.created_at,
        retry_user_errors=s.retry_user_errors,
        curve_every_steps=s.curve_every_steps,
        curve_max_per_s=s.curve_max_per_s,
    )


def result_pb(r: RequestRecord, plan: tuple[str, str] = ("", "")) -> pb.RequestResult:
    """A request's result; ``plan``: its plan's key and code version, where the call lists them."""
    return pb.RequestResult(
        request_id=r.id,
        client_request_id=r.client_request_id,
        state=r.state,  # the enum value's name
        metrics=r.metrics or {},
        node=r.node,
        step=r.step,
        error=r.error or "",
        label=r.label,
        plan_key=plan[0],
        code_version=plan[1],
    )


def stats_pb(st: SharingStats) -> pb.StudyStats:
    return pb.StudyStats(
        requests=dict(st.requests),
        steps_executed=st.steps_executed,
        unique_steps=st.unique_steps,
        trial_by_trial_steps=st.trial_by_trial_steps,
        merge_rate=st.merge_rate,
        saved_steps=st.saved_steps,
        compute_seconds=st.compute_seconds,
        saved_seconds=st.saved_seconds,
        queue_seconds=st.queue_seconds,
        startup_seconds=st.startup_seconds,
        checkpoint_seconds=st.checkpoint_seconds,
    )


def slot_pb(s: SlotInfo) -> pb.Slot:
    return pb.Slot(
        id=s.id,
        gpu_type=s.gpu_type,
        memory_bytes=s.memory_bytes,
        compute_capability=s.compute_capability,
        share=s.share,
        cpu_cores=s.cpu_cores,
        gpu_index=s.gpu_index,
    )


class MasterGrpc(pb_grpc.MasterServiceServicer):
    def __init__(
        self,
        service: MasterService,
        auth: Authenticator,
        coordination: Coordination,
        heartbeat_interval_s: float,
        admission: Admission | None = None,
    ) -> None:
        self.svc = service
        self.auth = auth
        self.coord = coordination
        self.heartbeat_interval_s = heartbeat_interval_s
        self.admission = admission or Admission(1 << 30, 1.0)
        self.curves = CurveService(service)
        self.results = ResultsHub(coordination, service.store.requests.finished_among)
        self.assignments = AssignmentHub(coordination, service.take_assignments_many, service.store.nodes.with_unsent)
        self._reports: Grouper[tuple[Principal, list[BatchMessage]], list[int]] = Grouper(self._report_group)
        # the heartbeats that arrive together share a transaction and a Redis round trip (HEARTBEAT_GROUP)
        self._beats: Grouper[Beat, None] = Grouper(self._beat_group, max_items=HEARTBEAT_GROUP)

    def _who(self, context: grpc.aio.ServicerContext) -> Principal:
        md = dict(context.invocation_metadata() or ())
        return self.auth.authenticate(bearer(md.get("authorization")))

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        st = status_of(exc)
        if isinstance(exc, StagetreeError):
            await context.abort(st.grpc, exc.message)
        log.exception("internal error in gRPC call", exc_info=exc)
        await context.abort(st.grpc, "internal error; see the master's log")

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[[Principal], T], *, shed: bool = True) -> T:
        """Run one use case in a thread; a client call (``shed``) past the admission limit is refused
        with RESOURCE_EXHAUSTED and ``retry-after-ms`` before anything of it is done."""
        if shed and not self.admission.try_enter():
            ms = str(round(self.admission.retry_after_s * 1000))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, self.admission.message(), trailing_metadata=((RETRY_AFTER_MD, ms),)
            )
        try:
            who = self._who(context)
            return await asyncio.to_thread(fn, who)
        except Exception as exc:
            await self._abort(context, exc)
            raise  # unreachable: abort raises
        finally:
            if shed:
                self.admission.leave()

    # -- studies --------------------------------------------------------------------------------

    async def CreateStudy(self, request: pb.CreateStudyRequest, context: Any) -> pb.Study:
        rec = await self._call(
            context,
            lambda who: self.svc.create_study(
                who,
                request.name,
                request.fixed_json,
                retry_user_errors=request.retry_user_errors,
                curve_every_steps=request.curve_every_steps if request.HasField("curve_every_steps") else None,
                curve_max_per_s=request.curve_max_per_s if request.HasField("curve_max_per_s") else None,
            ),
        )
        return study_pb(rec)

    async def GetStudy(self, request: pb.GetStudyRequest, context: Any) -> pb.Study:
        if request.name and not request.study_id:
            return study_pb(await self._call(context, lambda who: self.svc.find_study(who, request.name)))
        return study_pb(await self._call(context, lambda who: self.svc.get_study(who, request.study_id)))

    async def DeleteStudy(self, request: pb.DeleteStudyRequest, context: Any) -> pb.DeleteStudyResponse:
        n = await self._call(context, lambda who: self.svc.delete_study(who, request.study_id))
        return pb.DeleteStudyResponse(requests_deleted=n)

    async def GetStudyStats(self, request: pb.GetStudyStatsRequest, context: Any) -> pb.StudyStats:
        version = request.code_version if request.HasField("code_version") else None
        return stats_pb(await self._call(context, lambda who: self.svc.study_stats(who, request.study_id, version)))

    async def ListStudies(self, request: pb.ListStudiesRequest, context: Any) -> pb.ListStudiesResponse:
        recs = await self._call(context, self.svc.list_studies)
        return pb.ListStudiesResponse(studies=[study_pb(s) for s in recs])

    # -- requests -------------------------------------------------------------------------------

    async def SubmitRequests(self, request: pb.SubmitRequestsRequest, context: Any) -> pb.SubmitRequestsResponse:
        items = [SubmitItem(i.client_request_id, i.config_json, i.step, i.label) for i in request.items]
        recs = await self._call(context, lambda who: self.svc.submit(who, request.study_id, items))
        return pb.SubmitRequestsResponse(results=[result_pb(r) for r in recs])

    async def CancelRequest(self, request: pb.CancelRequestRequest, context: Any) -> pb.RequestResult:
        rec = await self._call(context, lambda who: self.svc.cancel(who, request.study_id, request.request_id))
        return result_pb(rec)

    async def GetMetrics(self, request: pb.GetMetricsRequest, context: Any) -> pb.GetMetricsResponse:
        point, metrics = await self._call(
            context, lambda who: self.svc.get_metrics(who, request.study_id, request.config_json, request.step)
        )
        if point is None or metrics is None:
            return pb.GetMetricsResponse(found=False)
        return pb.GetMetricsResponse(found=True, metrics=metrics, node=point.node, step=point.step)

    async def GetPlan(self, request: pb.GetPlanRequest, context: Any) -> pb.Plan:
        view = await self._call(context, lambda who: self.svc.get_plan(who, request.study_id, request.plan_key))
        return pb.Plan(
            key=view.key,
            fixed_json=view.fixed_json,
            nodes=[
                pb.PlanNode(
                    id=n.id,
                    parent=n.parent or 0,
                    start=n.start,
                    config_json=n.config_json,
                    requests=n.requests,
                    checkpoint_steps=n.checkpoints,
                    metric_steps=n.metrics,
                )
                for n in view.nodes
            ],
        )

    async def GetCurve(self, request: pb.GetCurveRequest, context: Any) -> pb.Curve:
        r = request
        end = int(r.end) if r.has_end else None
        c = await self._call(
            context,
            lambda who: self.curves.trial_curve(
                who, r.study_id, int(r.request_id), int(r.start), end, int(r.max_points)
            ),
        )
        points = [pb.CurvePoint(node=p.node, step=p.step, values=p.values) for p in c.points]
        return pb.Curve(request_id=c.request_id, node=c.node, step=c.step, total=c.total, points=points)

    async def GetRequestLog(self, request: pb.GetRequestLogRequest, context: Any) -> pb.RequestLog:
        lines = await self._call(
            context, lambda who: self.svc.request_log(who, request.study_id, int(request.request_id))
        )
        return pb.RequestLog(
            request_id=request.request_id,
            lines=[
                pb.RequestLogLine(
                    batch_id=ln.batch_id,
                    attempt=ln.attempt,
                    seq=ln.seq,
                    node=ln.node,
                    step=ln.step,
                    at=ln.at,
                    line=ln.line,
                )
                for ln in lines
            ],
        )

    async def ForgetPlan(self, request: pb.ForgetPlanRequest, context: Any) -> pb.ForgetPlanResponse:
        out = await self._call(context, lambda who: self.svc.forget_plan(who, request.study_id, request.plan_key))
        return pb.ForgetPlanResponse(
            checkpoints=out.checkpoints, bytes_freed=out.bytes_freed, metrics=out.metrics, requests=out.requests
        )

    async def StreamResults(self, request: pb.StreamResultsRequest, context: Any) -> AsyncIterator[pb.RequestResult]:
        wanted = set(request.request_ids)
        try:
            who = self._who(context)
            if not wanted:
                raise InvalidArgument("request_ids: name at least one request")
            for rid in wanted:  # in range before the hub reads them
                check_id(rid, "request_ids")
            watch = await self.results.watch(sorted(wanted))  # the hub listens before the first look
            try:
                # one look checks the ownership and existence of every id (nothing is sent before it passed)
                # and finds those that finished before the hub listened
                known = await asyncio.to_thread(self.svc.get_requests, who, request.study_id, sorted(wanted))
                missing = wanted - {r.id for r in known}
                if missing:
                    raise InvalidArgument(f"request_ids: {sorted(missing)[:10]} are not requests of this study")
                recs = watch.take([r for r in known if r.state in FINISHED_REQUEST_STATES])
                while True:
                    for r in recs:
                        yield result_pb(r)
                    if not watch.wanted:
                        break
                    recs = await watch.next(POLL_S)  # what the hub took for this stream
                    if not recs and not self.results.running:  # the hub failed: look for ourselves
                        mine = sorted(watch.wanted)
                        recs = watch.take(await asyncio.to_thread(self.svc.finished, who, request.study_id, mine))
            finally:
                self.results.unwatch(watch)
        except Exception as exc:
            await self._abort(context, exc)

    async def ListRequests(self, request: pb.ListRequestsRequest, context: Any) -> pb.ListRequestsResponse:
        ids = sorted(set(request.request_ids)) or None

        def listed(who: Principal) -> tuple[list[RequestRecord], dict[int, tuple[str, str]]]:
            recs = self.svc.get_requests(who, request.study_id, ids)
            return recs, self.svc.plan_versions({r.plan_id for r in recs})

        recs, plans = await self._call(context, listed)
        return pb.ListRequestsResponse(results=[result_pb(r, plans[r.plan_id]) for r in recs])

    # -- node managers --------------------------------------------------------------------------

    async def ListNodeManagers(self, request: pb.ListNodeManagersRequest, context: Any) -> pb.ListNodeManagersResponse:
        recs = await self._call(context, self.svc.list_node_managers)
        return pb.ListNodeManagersResponse(
            node_managers=[
                pb.NodeManager(
                    node_manager_id=n.id,
                    address=n.address,
                    state=n.state,
                    last_heartbeat=n.last_heartbeat,
                    slots=[slot_pb(s) for s in n.slots],
                )
                for n in recs
            ]
        )

    async def RegisterNodeManager(
        self, request: pb.RegisterNodeManagerRequest, context: Any
    ) -> pb.RegisterNodeManagerResponse:
        slots = [
            SlotInfo(
                s.id,
                s.gpu_type or "cpu",
                s.memory_bytes,
                s.compute_capability,
                s.share,
                s.cpu_cores,
                s.gpu_index if s.gpu_type and s.gpu_type != "cpu" else -1,
            )
            for s in request.slots
        ]

        def register(who: Principal) -> None:
            who.require_admin()
            # alive before it is registered: a round between the two would otherwise find it lost
            self.coord.heartbeat(request.node_manager_id, self.heartbeat_interval_s * 3)
            known = [(a.batch_id, a.attempt) for a in request.known_attempts] if request.lists_attempts else None
            self.svc.register_node_manager(who, request.node_manager_id, request.address, slots, known=known)

        await self._call(context, register, shed=False)
        return pb.RegisterNodeManagerResponse(heartbeat_interval_s=self.heartbeat_interval_s)

    async def LeaveNodeManager(self, request: pb.LeaveNodeManagerRequest, context: Any) -> pb.LeaveNodeManagerResponse:
        known = [(a.batch_id, a.attempt) for a in request.known_attempts]
        requeued = await self._call(
            context, lambda who: self.svc.leave_node_manager(who, request.node_manager_id, known), shed=False
        )
        return pb.LeaveNodeManagerResponse(requeued_batch_ids=requeued)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        try:
            who = self._who(context)
            known = [(a.batch_id, a.attempt) for a in request.known_attempts] if request.lists_attempts else None
            await self._beats.submit((who, request.node_manager_id, known))
        except Exception as exc:
            await self._abort(context, exc)
            raise  # unreachable: abort raises
        return pb.HeartbeatResponse()

    def _beat_group(self, beats: list[Beat]) -> list[Exception | None]:
        """One group of heartbeats: the database's (``MasterService.heartbeats``), then Redis's liveness
        keys of those that were registered."""
        errors = self.svc.heartbeats(beats)
        self.coord.heartbeat_many(
            (nm for (_, nm, _), err in zip(beats, errors, strict=True) if err is None), self.heartbeat_interval_s * 3
        )
        return list(errors)

    async def StreamAssignments(
        self, request: pb.StreamAssignmentsRequest, context: Any
    ) -> AsyncIterator[pb.Assignment]:
        nm = request.node_manager_id
        try:
            who = self._who(context)
            who.require_admin()
            wakeups = await self.coord.subscribe(ch_node_manager(nm))
            self.assignments.opened(nm)
            try:
                async for a in self._assignments(nm, wakeups):
                    yield a
            finally:
                self.assignments.closed(nm)
                await wakeups.close()
        except Exception as exc:
            await self._abort(context, exc)

    async def _assignments(self, nm: str, wakeups: Subscription) -> AsyncIterator[pb.Assignment]:
        """Every RUN and action is announced on the node manager's channel (a broken Redis connection
        reports a wake-up), and the hub's sweep wakes a stream whose wake-up was lost; the stream's own
        look when nothing wakes it is a last resort (``STREAM_POLL_S``)."""
        while True:
            for a in await self.assignments.take(nm):
                log.info(
                    "assignment sent",
                    extra={"batch_id": a.batch_id, "attempt": a.attempt, "kind": a.kind, "node_manager_id": nm},
                )
                yield pb.Assignment(
                    batch_id=a.batch_id,
                    attempt=a.attempt,
                    batch_spec_json=a.spec_json,
                    kind=a.kind,  # the enum value's name
                    checkpoint_uris=a.checkpoint_uris,
                    slot_id=a.slot_id,
                )
            await wakeups.wait(STREAM_POLL_S)

    async def ReportBatch(self, request: pb.ReportBatchRequest, context: Any) -> pb.ReportBatchResponse:
        try:
            report = messages_of(request)
            who = self._who(context)
            who.require_admin()
            done = await self._reports.submit((who, report))
        except Exception as exc:
            await self._abort(context, exc)
            raise  # unreachable: abort raises
        return pb.ReportBatchResponse(completed_request_ids=done)

    def _report_group(self, items: list[tuple[Principal, list[BatchMessage]]]) -> list[list[int] | Exception]:
        """Reports that arrived together, one transaction per principal (``Grouper``)."""
        out: dict[int, list[int] | Exception] = {}
        by_who: dict[Principal, list[int]] = {}
        for i, (who, _) in enumerate(items):
            by_who.setdefault(who, []).append(i)
        for who, idx in by_who.items():
            for i, res in zip(idx, self.svc.report_batches(who, [items[i][1] for i in idx]), strict=True):
                out[i] = res
        return [out[i] for i in range(len(items))]


async def start_grpc_server(
    servicer: MasterGrpc, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start serving (TLS with ``credentials``, else plaintext); ``port`` 0 picks a free one. Returns the
    server and the bound port."""
    server = grpc.aio.server()
    pb_grpc.add_MasterServiceServicer_to_server(servicer, GuardedRegistration(server))  # type: ignore[no-untyped-call]
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    await server.start()
    log.info("gRPC server listening", extra={"host": host, "port": bound, "tls": credentials is not None})
    return server, bound
