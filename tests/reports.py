"""Build the bus messages of a node manager's direct report from the flags and tuples it carries.

The report goes through the master's own reading of a structured ``ReportBatchRequest``
(``master.api.reports.messages_of``): the same request sent twice is the same messages (the same ids).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stagetree.bus.messages import BatchMessage, BatchStarted
from stagetree.core.lifecycle import AttemptTiming, CheckpointPoint, MetricPoint, RankChange
from stagetree.master.api.reports import DIRECT, messages_of
from stagetree.proto.stagetree.v1 import master_pb2 as pb


def attempt_report(
    batch_id: int,
    attempt: int,
    ok: bool,
    metrics: Iterable[Any] = (),
    checkpoints: Iterable[Any] = (),
    *,
    error: str = "",
    oom: bool = False,
    preempted: bool = False,
    user_error: bool = False,
    curve: Iterable[Any] = (),
    rescaled: RankChange | None = None,
    timing: AttemptTiming | None = None,
    started_at: float | None = None,
) -> list[BatchMessage]:
    """``metrics`` and ``curve``: MetricPoints or (node, step, values); ``checkpoints``: CheckpointPoints
    or (node, step, uri, bytes, kind); a preemption's checkpoint is the last one. ``started_at``: a
    ``batch_started`` first, as the worker's pipe sends it."""
    mets = [p if isinstance(p, MetricPoint) else MetricPoint(*p) for p in metrics]
    points = [p if isinstance(p, MetricPoint) else MetricPoint(*p) for p in curve]
    ckpts = [c if isinstance(c, CheckpointPoint) else CheckpointPoint(*c) for c in checkpoints]
    request = pb.ReportBatchRequest(
        batch_id=batch_id,
        attempt=attempt,
        ok=ok,
        metrics=[pb.MetricPoint(node=p.node, step=p.step, values=p.values) for p in mets],
        checkpoints=[
            pb.CheckpointPoint(node=c.node, step=c.step, uri=c.uri, bytes=c.bytes, kind=c.kind, ranks=c.ranks)
            for c in ckpts
        ],
        error="" if ok else error,
        oom=oom,
        preempted=preempted,
        user_error=user_error,
        curve=[pb.MetricPoint(node=p.node, step=p.step, values=p.values) for p in points],
    )
    if rescaled is not None:
        r = rescaled
        request.rescaled.CopyFrom(
            pb.Rescaled(node=r.node, step=r.step, uri=r.uri, from_ranks=r.from_ranks, to_ranks=r.to_ranks)
        )
    if timing is not None:
        t = timing
        request.timing.CopyFrom(
            pb.AttemptTiming(given_at=t.given_at, startup_s=t.startup_s, checkpoint_s=t.checkpoint_s, train_s=t.train_s)
        )
    out = messages_of(request)
    if started_at is not None:
        msg_id = f"{DIRECT}:{batch_id}:{attempt}:{BatchStarted.TYPE}"
        out.insert(
            0,
            BatchStarted(msg_id=msg_id, node_manager=DIRECT, batch_id=batch_id, attempt=attempt, started_at=started_at),
        )
    return out
