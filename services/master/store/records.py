"""The plain records the store's roles take and return (no ORM object leaves the store)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from stagetree.core.batch import Point
from stagetree.core.ids import RequestId, StudyId
from stagetree.core.lifecycle import Assignment, BatchState, NodeManagerState, RequestState
from stagetree.core.loglines import LoggedLine
from stagetree.core.slots import Slot, SlotInfo

__all__ = [
    "Assignment",
    "BatchRecord",
    "DispatchItem",
    "FinishedAttempt",
    "LoggedLine",
    "NewNode",
    "NewRequest",
    "NewTreeNode",
    "NodeManagerRecord",
    "NodeRecord",
    "RequestRecord",
    "RoundReads",
    "SlotInfo",
    "StudyRecord",
    "json_safe_metrics",
    "metric_value",
]


@dataclass(frozen=True)
class StudyRecord:
    id: str
    owner: str
    name: str
    fixed_json: str | None
    created_at: float
    retry_user_errors: bool = False
    curve_every_steps: int | None = None  # None: the master's default
    curve_max_per_s: float | None = None


@dataclass(frozen=True)
class NodeRecord:
    id: int
    parent: int | None
    start: int
    config_json: str


@dataclass(frozen=True)
class NewNode:
    parent: int | None
    start: int
    branch_digest: str
    config_json: str


@dataclass(frozen=True)
class NewTreeNode:
    """A node to write whose parent may itself be new: ``parent`` is a database id (> 0), a ``ref`` of an
    earlier node of the same write (< 0), or None for a root."""

    ref: int  # < 0, unique within one write
    parent: int | None
    start: int
    branch_digest: str
    config_json: str


@dataclass(frozen=True)
class FinishedAttempt:
    """A batch attempt that ran to its end: what the cost estimator learns from."""

    batch_id: int
    attempt: int
    spec_json: str
    seconds: float  # from its worker's start (else the node manager taking it, else its dispatch) to its end
    finished_at: float
    gpu_type: str  # of its slot ("" when the slot is no longer registered)


@dataclass(frozen=True)
class NewRequest:
    client_request_id: str
    node: int
    step: int
    label: str = ""  # the tuner's name for the trial it belongs to


@dataclass(frozen=True)
class RequestRecord:
    id: int
    study_id: str
    plan_id: int
    node: int
    step: int
    state: RequestState
    client_request_id: str
    batch_id: int | None
    metrics: dict[str, float] | None = None
    error: str | None = None  # why it failed, or why a policy cancelled it
    label: str = ""

    def with_metrics(self, metrics: dict[str, float] | None) -> RequestRecord:
        return self if metrics is None else replace(self, metrics=dict(metrics))


@dataclass(frozen=True)
class NodeManagerRecord:
    id: str
    address: str
    state: NodeManagerState
    last_heartbeat: float
    slots: tuple[SlotInfo, ...] = ()

    def placed_slots(self) -> list[Slot]:
        """Its slots as the scheduler places work on them."""
        return [Slot.on(self.id, i) for i in self.slots]


@dataclass(frozen=True)
class DispatchItem:
    """One batch for ``BatchLedger.dispatch_many``; ``spec_for(batch_id, attempt) -> str`` renders its spec."""

    plan_id: int
    spec_for: Callable[[int, int], str]
    request_ids: Sequence[int]
    node_manager_id: str
    slot_ids: tuple[str, ...]  # of that node manager, in rank order (a batch on n slots holds n)


@dataclass(frozen=True)
class BatchRecord:
    id: int
    plan_id: int
    state: BatchState
    attempt: int
    spec_json: str
    node_manager_id: str | None
    slot_ids: tuple[str, ...] = ()  # the slots it holds on that node manager, in rank order


@dataclass(frozen=True)
class RoundReads:
    """What a scheduling round reads (``RoundReader.round_reads``)."""

    node_managers: list[NodeManagerRecord]
    busy: set[tuple[str, str]]  # (node manager, slot) running a batch
    policy_studies: list[tuple[str, str]]  # (study id, fixed json) with policies and live requests
    pending: dict[int, list[tuple[int, Point]]]  # per plan: (request id, point) of NOT_SCHED requests
    running: list[BatchRecord]
    # (batch, attempt) -> when its worker started, of the running ones whose batch_started was recorded
    started: dict[tuple[int, int], float] = field(default_factory=dict)
    studies: dict[RequestId, StudyId] = field(default_factory=dict)  # pending request -> its study
    arrivals: dict[RequestId, float] = field(default_factory=dict)  # pending request -> when it was submitted
    # running (batch, attempt) -> (the study of its last request, when it was dispatched)
    served: dict[tuple[int, int], tuple[str | None, float]] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)  # the owner of each study above
    # per plan: the node managers that cannot run its trainer, and why (``BatchLedger.host_problems_in``)
    host_problems: dict[int, dict[str, str]] = field(default_factory=dict)
    # the attempts that ran out of memory: how many, and the latest one's end (what tells a round that
    # the cost model has new ones to learn: ``CostLearner.refresh_oom``)
    out_of_memory: tuple[int, float | None] = (0, None)


def metric_value(v: float | str) -> float:
    """A stored metric value as a float: non-finite values (a diverged loss) are stored as the strings
    ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, since Postgres's JSON type refuses the bare tokens."""
    return float(v)


def json_safe_metrics(values: dict[str, float]) -> dict[str, float | str]:
    """``values`` with each non-finite value as the string :func:`metric_value` reads back."""
    if all(math.isfinite(v) for v in values.values()):
        return values  # type: ignore[return-value]
    return {
        k: v if math.isfinite(v) else ("NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity"))
        for k, v in values.items()
    }
