"""The node manager's side of the master: the ``MasterLink`` port and its gRPC adapter.

The node manager registers its slots, heartbeats, consumes its assignment stream and (on the direct
path) reports finished batch attempts. ``GrpcMasterLink`` does it over ``stagetree.v1.MasterService``
with the admin token as a bearer token; an in-process adapter (the embedded mode) can call the
master's service layer directly with the same four methods.

gRPC status codes stop here and become the core error tree through the one status table
(``stagetree.status``): ``Unavailable`` (retriable: the master is down, restarting or overloaded; try
again later), ``Unauthenticated`` / ``PermissionDenied`` (the token is wrong: retrying cannot help, the
message names the setting to fix), ``NotFound`` and the rest; a code outside the table (INTERNAL,
UNKNOWN, ...) is a bug in the master, not retriable.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from stagetree.bus.messages import (
    BatchFailed,
    BatchFinished,
    BatchMessage,
    BatchPreempted,
    CheckpointSaved,
    Metrics,
    encode_many,
)
from stagetree.core import errors
from stagetree.core.lifecycle import Assignment, AssignmentKind
from stagetree.core.slots import SlotInfo
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from stagetree.status import error_class_of, error_of_code
from stagetree.tls import ClientTls, open_channel

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BatchMessage)

RUN, ABORT, PREEMPT, DELETE_CHECKPOINTS = "RUN", "ABORT", "PREEMPT", "DELETE_CHECKPOINTS"

TOKEN_HINT = "set STAGETREE_NM_ADMIN_TOKEN to the master's admin token (its STAGETREE_MASTER_AUTH__ADMIN_TOKEN)"


@dataclass(frozen=True)
class BatchReport:
    """What one batch attempt produced and how it ended: its worker's events as bus messages
    (``stagetree.bus.messages``), in order, sent as the ``events`` of one ``ReportBatchRequest``.

    The properties read the report back (logs, tests); the master reads the messages themselves."""

    batch_id: int
    attempt: int
    messages: tuple[BatchMessage, ...] = ()

    def of_type(self, cls: type[M]) -> list[M]:
        return [m for m in self.messages if isinstance(m, cls)]

    @property
    def ok(self) -> bool:
        return bool(self.of_type(BatchFinished))

    @property
    def preempted(self) -> bool:
        return bool(self.of_type(BatchPreempted))

    @property
    def failure(self) -> BatchFailed | None:
        failed = self.of_type(BatchFailed)
        return failed[0] if failed else None

    @property
    def error(self) -> str:
        return self.failure.error if self.failure else ""

    @property
    def oom(self) -> bool:
        return bool(self.failure and self.failure.oom)

    @property
    def user_error(self) -> bool:
        return bool(self.failure and self.failure.user_error)

    @property
    def metrics(self) -> list[Metrics]:
        return self.of_type(Metrics)

    @property
    def checkpoints(self) -> list[CheckpointSaved]:
        return self.of_type(CheckpointSaved)


class MasterLink(ABC):
    """How a node manager talks to the master. Errors are the core tree (``Unavailable`` is retriable)."""

    @abstractmethod
    async def register(self, node_manager_id: str, address: str, slots: Sequence[SlotInfo]) -> float:
        """Register (or re-register) with these slots; returns the heartbeat interval the master wants."""

    async def register_known(
        self, node_manager_id: str, address: str, slots: Sequence[SlotInfo], known: Sequence[tuple[int, int]]
    ) -> float:
        """``register``, also telling the master every (batch, attempt) this process runs or recently
        ended, so it requeues the other attempts it sent here (a restarted process lost them). An adapter
        that cannot say so just registers."""
        return await self.register(node_manager_id, address, slots)

    @abstractmethod
    async def heartbeat(self, node_manager_id: str, known: Sequence[tuple[int, int]] | None = None) -> None:
        """Say this node manager is alive; ``known`` (as in ``register_known``) lets the master requeue
        attempts it sent long ago that never arrived."""

    async def leave(self, node_manager_id: str, known: Sequence[tuple[int, int]]) -> list[int]:
        """Tell the master this node manager is stopping (its workers stopped, their reports sent), so
        it sends no more work here and requeues what it gave that is not in ``known`` (as in
        ``register_known``); the batch ids it requeued. An adapter that cannot say so says nothing: the
        master then finds the node manager gone a heartbeat TTL later."""
        return []

    @abstractmethod
    def assignments(self, node_manager_id: str) -> AsyncIterator[Assignment]:
        """The assignment stream; ends or raises when the connection does."""

    @abstractmethod
    async def report(self, report: BatchReport) -> list[int]:
        """The direct report of a batch attempt; returns the request ids it completed."""

    async def close(self) -> None:  # noqa: B027  (an optional hook)
        """Release the connection."""


def translate(exc: grpc.aio.AioRpcError, target: str, what: str) -> errors.StagetreeError:
    """The core error for a failed call ``what`` to the master at ``target``, through the status table.
    Callers retry a ``retriable`` class only; INTERNAL, UNKNOWN, CANCELLED and the other codes outside
    the table come back as a base error pointing at the master's log, as re-sending fails the same way."""
    code, details = exc.code(), exc.details() or ""
    cls = error_class_of(code)
    if cls is errors.Unavailable:
        return errors.Unavailable(
            f"{what}: the master at {target} is unavailable ({code.name}: {details}); if it serves TLS, set "
            "STAGETREE_NM_TLS__CA_FILE (and, for mutual TLS, STAGETREE_NM_TLS__CERT_FILE and __KEY_FILE)"
        )
    if cls is errors.Unauthenticated:
        return errors.Unauthenticated(f"{what}: the master at {target} rejected the token ({details}); {TOKEN_HINT}")
    if cls is errors.PermissionDenied:
        return errors.PermissionDenied(f"{what}: the token is not the master's admin token ({details}); {TOKEN_HINT}")
    if cls is errors.StagetreeError:
        return error_of_code(code, f"{what}: the master at {target} failed: {details}")
    return cls(f"{what}: {code.name}: {details}")


def _slot_pb(s: SlotInfo) -> pb.Slot:
    return pb.Slot(
        id=s.id,
        gpu_type=s.gpu_type,
        memory_bytes=s.memory_bytes,
        compute_capability=s.compute_capability,
        share=s.share,
        cpu_cores=s.cpu_cores,
        gpu_index=s.gpu_index,
    )


def _assignment(a: pb.Assignment) -> Assignment:
    return Assignment(
        batch_id=int(a.batch_id),
        attempt=int(a.attempt),
        kind=AssignmentKind(pb.AssignmentKind.Name(a.kind)),
        spec_json=a.batch_spec_json,
        checkpoint_uris=tuple(a.checkpoint_uris),
        slot_id=str(getattr(a, "slot_id", "") or ""),  # a field the master may add
    )


class GrpcMasterLink(MasterLink):
    """``MasterLink`` over ``grpc.aio`` to ``target`` (``host:port``). The channel is created on first use
    (inside the running loop) and reconnects by itself; calls fail fast while the master is away."""

    def __init__(
        self,
        target: str,
        admin_token: str,
        *,
        rpc_timeout_s: float = 10.0,
        max_backoff_s: float = 10.0,
        tls: ClientTls | None = None,
    ):
        if not admin_token:
            raise errors.InvalidArgument(f"no admin token; {TOKEN_HINT}")
        self.target = target
        self._metadata = (("authorization", f"Bearer {admin_token}"),)
        self._timeout = rpc_timeout_s
        self._options = [
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", int(max_backoff_s * 1000)),
        ]
        self._tls = tls  # verify the master's certificate (and show ours, for mutual TLS); None: plaintext
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.MasterServiceStub | None = None

    def _get_stub(self) -> pb_grpc.MasterServiceStub:
        if self._stub is None:
            self._channel = open_channel(self.target, self._tls, self._options)
            self._stub = pb_grpc.MasterServiceStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    async def register(self, node_manager_id: str, address: str, slots: Sequence[SlotInfo]) -> float:
        req = pb.RegisterNodeManagerRequest(
            node_manager_id=node_manager_id, address=address, slots=[_slot_pb(s) for s in slots]
        )
        return await self._register(req)

    async def register_known(
        self, node_manager_id: str, address: str, slots: Sequence[SlotInfo], known: Sequence[tuple[int, int]]
    ) -> float:
        req = pb.RegisterNodeManagerRequest(
            node_manager_id=node_manager_id,
            address=address,
            slots=[_slot_pb(s) for s in slots],
            lists_attempts=True,
            known_attempts=[pb.AttemptRef(batch_id=b, attempt=a) for b, a in known],
        )
        return await self._register(req)

    async def _register(self, req: pb.RegisterNodeManagerRequest) -> float:
        try:
            resp = await self._get_stub().RegisterNodeManager(req, metadata=self._metadata, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e, self.target, "register") from None
        return float(resp.heartbeat_interval_s)

    async def heartbeat(self, node_manager_id: str, known: Sequence[tuple[int, int]] | None = None) -> None:
        req = pb.HeartbeatRequest(
            node_manager_id=node_manager_id,
            lists_attempts=known is not None,
            known_attempts=[pb.AttemptRef(batch_id=b, attempt=a) for b, a in known or ()],
        )
        try:
            await self._get_stub().Heartbeat(req, metadata=self._metadata, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e, self.target, "heartbeat") from None

    async def leave(self, node_manager_id: str, known: Sequence[tuple[int, int]]) -> list[int]:
        req = pb.LeaveNodeManagerRequest(
            node_manager_id=node_manager_id, known_attempts=[pb.AttemptRef(batch_id=b, attempt=a) for b, a in known]
        )
        try:
            resp = await self._get_stub().LeaveNodeManager(req, metadata=self._metadata, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e, self.target, "leave") from None
        return [int(b) for b in resp.requeued_batch_ids]

    async def assignments(self, node_manager_id: str) -> AsyncIterator[Assignment]:
        call = self._get_stub().StreamAssignments(
            pb.StreamAssignmentsRequest(node_manager_id=node_manager_id), metadata=self._metadata
        )
        try:
            async for a in call:
                yield _assignment(a)
        except grpc.aio.AioRpcError as e:
            raise translate(e, self.target, "assignment stream") from None
        finally:
            call.cancel()

    async def report(self, report: BatchReport) -> list[int]:
        req = pb.ReportBatchRequest(
            batch_id=report.batch_id, attempt=report.attempt, events=encode_many(report.messages)
        )
        try:
            resp = await self._get_stub().ReportBatch(req, metadata=self._metadata, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e, self.target, f"report of batch {report.batch_id}") from None
        return [int(i) for i in resp.completed_request_ids]

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
