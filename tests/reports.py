"""Build the domain's ``AttemptReport`` from the flags and tuples a node manager's report carries."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stagetree.core.lifecycle import AttemptReport, CheckpointPoint, MetricPoint, Outcome


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
) -> AttemptReport:
    """``metrics``: MetricPoints or (node, step, values); ``checkpoints``: CheckpointPoints or
    (node, step, uri, bytes, kind)."""
    mets = [p if isinstance(p, MetricPoint) else MetricPoint(*p) for p in metrics]
    ckpts = [c if isinstance(c, CheckpointPoint) else CheckpointPoint(*c) for c in checkpoints]
    return AttemptReport(batch_id, attempt, Outcome.of_report(ok, preempted=preempted, oom=oom), mets, ckpts, error)
