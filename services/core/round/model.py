"""What a scheduling round reads (``RoundInput``) and what it decides (``RoundDecision``), as plain data.

The master's reader builds a ``RoundInput`` from the database and the simulator builds one from its
virtual cluster; ``plan_round`` never changes it (the stage forests and report lists inside are read,
never written) and returns a ``RoundDecision`` that the master's applier, or the simulator, carries out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stagetree.core.batch import Point
from stagetree.core.ids import BatchId, PlanId, RequestId, StudyId
from stagetree.core.policies.state import Kill, PolicyState
from stagetree.core.policies.study import StudyPolicies
from stagetree.core.scheduler import PlannedBatch
from stagetree.core.searchplan import Checkpoint, Node
from stagetree.core.slots import Slot
from stagetree.core.stagetree import StageForest


@dataclass(frozen=True)
class PlanWork:
    """One plan's pending work: its stage forest (``stage.plan`` is ``plan``) and each stage's estimated
    seconds by stage id, on the ``slots`` slots a batch of the plan takes."""

    plan: PlanId
    forest: StageForest
    cost_s: Sequence[float]
    slots: int = 1
    asked: int = 1  # the slots its studies asked for: ``slots`` above it means it ran out of memory before
    # time per step on n slots over that on 1, for the widths a QoS study may choose (absent: 1 / n)
    step_scale: Mapping[int, float] = field(default_factory=dict)
    # steps where some config of the plan starts a new piece: a batch also saves there (likely branch points)
    boundaries: Sequence[int] = ()
    # node manager -> why it cannot run the plan's trainer (its module is not installed there): the plan's
    # batches go to the others, and with none left the plan is unplaceable, for these reasons
    unable: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BusySlot:
    """A slot running work: when its one batch should end (None: unknown, or it holds a batch on several
    slots, or a batch waits on it already)."""

    slot: Slot
    ends_at: float | None = None


@dataclass(frozen=True)
class RunningAttempt:
    """A batch attempt that holds slots: its stages as ``(node, start, end)``, the study it serves (that
    of its last request), when it was dispatched and where it loaded from."""

    batch: BatchId
    attempt: int
    plan: PlanId
    slots: tuple[Slot, ...]
    stages: tuple[tuple[int, int, int], ...]
    study: StudyId | None = None
    dispatched_at: float = 0.0
    source: Point | None = None

    @property
    def end(self) -> Point:
        node, _, end = self.stages[-1]
        return Point(node, end)


@dataclass(frozen=True)
class Report:
    """A value a trainer reported at ``step`` of a plan node (an evaluation or a learning-curve point)."""

    step: int
    at: float  # when it was recorded
    values: Mapping[str, float]


@dataclass(frozen=True)
class CheckpointBudget:
    """The checkpoint catalog when it holds more than ``budget_bytes``: what eviction chooses from."""

    budget_bytes: int
    checkpoints: Mapping[Point, Checkpoint]
    nodes: Mapping[int, Node]  # the plans' nodes, for the cost of computing a prefix again
    step_s: float = 1.0  # a step's cost in that estimate


@dataclass(frozen=True)
class RoundSettings:
    order: str = "critical_path"  # the cut's order for studies that choose none
    lookahead_s: float = 0.0  # busy slots ending within this are offered to work that allows it (0: off)


@dataclass(frozen=True)
class RoundInput:
    """Everything one round decides from. ``requests`` is the study of every pending request (the
    reader gives all of them), ``arrivals`` when each arrived; ``reports`` hold, per (plan, node), the
    reports recorded there sorted by time (at least those after what the state has learnt from, for
    the running attempts of studies whose policies learn)."""

    now: float
    plans: Sequence[PlanWork]
    requests: Mapping[RequestId, StudyId]
    free: Sequence[Slot]
    busy: Sequence[BusySlot] = ()
    running: Sequence[RunningAttempt] = ()
    policies: Mapping[StudyId, StudyPolicies] = field(default_factory=dict)
    owners: Mapping[StudyId, str] = field(default_factory=dict)
    arrivals: Mapping[RequestId, float] = field(default_factory=dict)
    state: PolicyState = field(default_factory=PolicyState)
    reports: Mapping[tuple[PlanId, int], Sequence[Report]] = field(default_factory=dict)
    settings: RoundSettings = field(default_factory=RoundSettings)
    checkpoints: CheckpointBudget | None = None
    # (plan, point) -> the free slot whose worker last ended a batch there and may hold its trainer in memory:
    # a batch loading that point runs there without reading a checkpoint (``place.FirstFit``)
    warm: Mapping[tuple[PlanId, Point], Slot] = field(default_factory=dict)


@dataclass(frozen=True)
class Dispatch:
    """Run ``batch`` on ``slots`` (rank order). ``ahead``: the first slot is busy and about to free (the
    lookahead): its node manager starts the batch when it frees."""

    batch: PlannedBatch
    slots: tuple[Slot, ...]
    study: StudyId | None = None
    ahead: bool = False

    @property
    def slot(self) -> Slot:
        return self.slots[0]


@dataclass(frozen=True)
class RoundDecision:
    """What one round decided. ``preempts`` and ``kills`` include those decided earlier and not yet known
    to be carried out (the state's pending ones); ``state`` is the policies' state after the round, to
    save before any of it is carried out."""

    dispatches: tuple[Dispatch, ...] = ()
    preempts: tuple[BatchId, ...] = ()
    kills: tuple[Kill, ...] = ()
    evictions: tuple[Point, ...] = ()
    unplaceable: Mapping[PlanId, str] = field(default_factory=dict)  # why no node manager can run the plan
    wake_at: float | None = None  # the next time the round should run without any event
    state: PolicyState = field(default_factory=PolicyState)
    queued: int = 0  # batches of the pending work not dispatched
