"""A node manager's direct ``ReportBatchRequest`` as the bus messages it carries.

The direct report is one more transport of the worker's events (``stagetree.bus.messages``): its
``events`` are ``encode_many`` records, decoded here and validated as an aggregator validates them, and
``MasterService.report_batches`` hands them to the same ``Ingestor`` the aggregators use. The older form
of the request, the structured fields 3-14, is read too: :func:`messages_of` turns it into the messages
a node manager of this release sends (ids derived from the batch and attempt, so a report sent again
after a lost answer changes nothing).
"""

from __future__ import annotations

from typing import Any, TypeVar

from stagetree.bus.messages import (
    BatchFailed,
    BatchFinished,
    BatchMessage,
    BatchPreempted,
    BatchTiming,
    CheckpointSaved,
    Curve,
    MalformedMessage,
    Metrics,
    Progress,
    Rescaled,
    decode_many,
)
from stagetree.core.errors import InvalidArgument
from stagetree.proto.stagetree.v1 import master_pb2 as pb

M = TypeVar("M", bound=BatchMessage)
DIRECT = "direct"  # the node_manager field of the messages of a structured report (it names none)


def messages_of(request: pb.ReportBatchRequest) -> list[BatchMessage]:
    """The report's messages, in order. Raises ``InvalidArgument`` (a ``MalformedMessage``) for an
    event that is not a valid message of this batch attempt; nothing of such a report is applied."""
    if request.events:
        return _decoded(request)
    return _structured(request)


def _decoded(request: pb.ReportBatchRequest) -> list[BatchMessage]:
    out: list[BatchMessage] = []
    for record in request.events:
        for msg in decode_many(record):
            if isinstance(msg, MalformedMessage):
                raise msg
            if not isinstance(msg, BatchMessage) or (msg.batch_id, msg.attempt) != (request.batch_id, request.attempt):
                raise InvalidArgument(
                    f"events: a {msg.TYPE} message that is not of batch {request.batch_id} attempt {request.attempt}"
                )
            out.append(msg)
    return out


def _structured(request: pb.ReportBatchRequest) -> list[BatchMessage]:
    """The messages of a report in the structured form (fields 3-14)."""
    seq = iter(range(1 << 62))

    def new(cls: type[M], **fields: Any) -> M:
        msg_id = f"{DIRECT}:{request.batch_id}:{request.attempt}:{cls.TYPE}:{next(seq)}"
        return cls(msg_id=msg_id, node_manager=DIRECT, batch_id=request.batch_id, attempt=request.attempt, **fields)

    out: list[BatchMessage] = []
    checkpoints = [
        new(
            CheckpointSaved,
            node=c.node,
            step=c.step,
            uri=c.uri,
            bytes=c.bytes,
            kind=c.kind or "central",  # type: ignore[arg-type]  # checked by the message
            ranks=max(c.ranks, 1),  # 0: unset
        )
        for c in request.checkpoints
    ]
    out += checkpoints
    if request.HasField("rescaled"):
        r = request.rescaled
        if r.from_ranks < 1 or r.to_ranks < 1 or r.from_ranks == r.to_ranks:
            raise InvalidArgument(f"rescaled: from_ranks and to_ranks must be two different counts >= 1, got {r}")
        out.append(
            new(
                Rescaled,
                node=r.node,
                step=r.step,
                uri=r.uri,
                from_ranks=r.from_ranks,
                to_ranks=r.to_ranks,
            )
        )
    out += [new(Metrics, node=p.node, step=p.step, metrics=dict(p.values)) for p in request.metrics]
    by_node: dict[int, list[pb.MetricPoint]] = {}
    for p in request.curve:
        by_node.setdefault(p.node, []).append(p)
    out += [
        new(Curve, node=node, steps=[p.step for p in ps], values=[dict(p.values) for p in ps])
        for node, ps in by_node.items()
    ]
    if request.reached_step:
        out.append(new(Progress, node=0, step=request.reached_step))
    if request.HasField("timing"):
        t = request.timing
        out.append(
            new(
                BatchTiming,
                given_at=t.given_at,
                startup_s=t.startup_s,
                checkpoint_s=t.checkpoint_s,
                train_s=t.train_s,
            )
        )
    if request.ok:
        out.append(new(BatchFinished, steps=0))
        return out
    if request.preempted:  # the preemption's checkpoint is the report's last one
        if not checkpoints:
            raise InvalidArgument("a preempted report names the checkpoint its preemption saved (checkpoints)")
        last = checkpoints[-1]
        out.append(new(BatchPreempted, node=last.node, step=last.step, uri=last.uri, ranks=last.ranks))
        return out
    out.append(
        new(
            BatchFailed,
            error=request.error,
            traceback="",
            oom=request.oom,
            user_error=request.user_error,
            host_problem=request.host_problem,
        )
    )
    return out
