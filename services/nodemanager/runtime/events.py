"""The events a running batch emits, their exact fields, and their JSON-lines wire form.

``EVENT_FIELDS`` is the contract the node manager and the Kafka schemas build on: every payload has
exactly these keys; ``WORKER_EVENTS`` are the worker's own, read by the node manager and never
reported. On the wire (worker stdout or ``--events-fd``) one event is one line
``{"kind": ..., "ts": <unix seconds>, "payload": {...}}``; the payload is nested because
``checkpoint_saved`` has a field named ``kind`` of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from stagetree.core.errors import InvalidArgument

Emit = Callable[[str, dict[str, Any]], None]

EVENT_FIELDS: dict[str, frozenset[str]] = {
    "batch_started": frozenset({"batch_id", "attempt"}),
    "progress": frozenset({"batch_id", "attempt", "node", "step"}),
    "metrics": frozenset({"batch_id", "attempt", "node", "step", "metrics"}),
    # learning-curve points of one node, in step order: ``points`` is ``[[step, {name: value}], ...]``
    "curve": frozenset({"batch_id", "attempt", "node", "points"}),
    # ``ranks``: how many ranks' training wrote the checkpoint (rank 0 saves for all of them)
    "checkpoint_saved": frozenset({"batch_id", "attempt", "node", "step", "uri", "bytes", "kind", "ranks"}),
    # the batch resumed the checkpoint at (node, step) written by ``from_ranks`` ranks on ``to_ranks``
    # (its trainer is ``rescalable``): the master records it as the plan's path change
    "rescaled": frozenset({"batch_id", "attempt", "node", "step", "uri", "from_ranks", "to_ranks"}),
    # where the attempt's time went, just ahead of its terminal event (``executor._Times``): when the worker
    # was handed the batch (epoch seconds), its start-up, checkpoint I/O and training (seconds)
    "batch_timing": frozenset({"batch_id", "attempt", "given_at", "startup_s", "checkpoint_s", "train_s"}),
    "batch_finished": frozenset({"batch_id", "attempt", "steps"}),
    "batch_preempted": frozenset({"batch_id", "attempt", "node", "step", "uri", "ranks"}),
    # ``user_error``: the trainer's own code raised; ``host_problem``: this host cannot import the trainer
    "batch_failed": frozenset({"batch_id", "attempt", "error", "traceback", "oom", "user_error", "host_problem"}),
    # a line of text the trainer logged (``Trainer.log_text``): the attempt's ``seq``-th, logged at ``at``
    # (epoch seconds) while the batch stood at (node, step); bounded by ``core.loglines``
    "log_line": frozenset({"batch_id", "attempt", "seq", "node", "step", "at", "line"}),
}

# What a worker says of itself, for the node manager alone (never reported): ``worker_idle`` after a batch
# that finished, when the worker waits for its next one (``runtime.worker --serve``): how many batches it
# ran, its resident memory and the processes its batch left running (``nodemanager.reuse`` decides).
WORKER_EVENTS: dict[str, frozenset[str]] = {
    "worker_idle": frozenset({"batches", "rss_bytes", "children"}),
}

CHECKPOINT_KINDS = frozenset({"central", "peripheral"})


def encode_event(kind: str, payload: dict[str, Any], ts: float | None = None) -> str:
    """One JSON line (with the trailing newline)."""
    return json.dumps({"kind": kind, "ts": time.time() if ts is None else ts, "payload": payload}) + "\n"


def decode_event(line: str | bytes) -> tuple[str, float, dict[str, Any]]:
    """``(kind, ts, payload)`` of one line, checked against ``EVENT_FIELDS``."""
    try:
        obj = json.loads(line)
        kind, ts, payload = obj["kind"], float(obj["ts"]), obj["payload"]
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidArgument(f"malformed event line {line!r}: {e}") from None
    fields = EVENT_FIELDS.get(kind) or WORKER_EVENTS.get(kind)
    if fields is None:
        raise InvalidArgument(f"unknown event kind {kind!r}; known: {sorted([*EVENT_FIELDS, *WORKER_EVENTS])}")
    if not isinstance(payload, dict) or set(payload) != fields:
        raise InvalidArgument(f"event {kind}: expected fields {sorted(fields)}, got {payload!r}")
    return kind, ts, payload
