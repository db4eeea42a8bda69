"""The round's unit of work: a batch cut from a plan's forest, with the study and trial it serves.

``cut`` cuts one plan's forest lazily in its order policy's order (``core.scheduler.iter_batches``), with
the plan's stage costs from the round's cost table; ``Work`` is such a batch as the order, place and
preempt steps see it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from stagetree.core.ids import JobKey, StudyId
from stagetree.core.round.model import PlanWork
from stagetree.core.scheduler import Boundaries, PlannedBatch, iter_batches, order_policy
from stagetree.core.slots import Slot
from stagetree.core.stagetree import Stage


@dataclass(frozen=True)
class Work:
    """A ready batch of the round: the study of its last request, the trial (``job``) it advances, its
    estimated seconds on ``slots`` slots, and when its oldest request arrived (0 when the round did not
    need it). ``widths`` are the (slots, seconds) a QoS study may choose from; ``tier`` is the order key
    across studies that its QoS class gives it (0 without one). ``key`` and ``first`` are given by the
    round's cut: the job's text and the batch's first request id."""

    batch: PlannedBatch
    study: StudyId | None
    job: JobKey
    cost_s: float
    slots: int
    arrival: float = 0.0
    widths: tuple[tuple[int, float], ...] = ()
    tier: float = 0.0
    key: str = ""  # ``str(job)``: the policies' handle of the trial
    first: int = 0  # its first request's id: the order requests were submitted in
    avoid: frozenset[str] = frozenset()  # node managers that cannot run it (``PlanWork.unable``)
    # other (slots, seconds) it may start on when its ``slots`` are not free on one node manager, in
    # preference order (``genie.WidthChoice.others``)
    others: tuple[tuple[int, float], ...] = ()
    # the free slot whose worker holds the trainer where this batch starts (``RoundInput.warm``), if any
    warm: Slot | None = None
    # when its slots (and its other widths) are not free together on one node manager: whether it holds
    # the free slots of the one closest to having them, so later work of the round leaves them free
    # (``genie.WidthChoice.hold``)
    hold: bool = False


def _boundaries(steps: Sequence[int]) -> Boundaries | None:
    """The steps of ``steps`` (sorted) strictly inside (start, end), for ``iter_batches``."""
    if not steps:
        return None

    def inside(node: int, start: int, end: int) -> Sequence[int]:
        return steps[bisect.bisect_right(steps, start) : bisect.bisect_left(steps, end)]

    return inside


def cut(plan: PlanWork, order: str) -> Iterator[PlannedBatch]:
    """The plan's batches in the order ``order`` (a name of ``core.scheduler.ORDER_POLICIES``) serves
    them, each at ``plan.slots`` slots."""
    costs = plan.cost_s

    def cost(st: Stage) -> float:
        return costs[st.id]

    for b in iter_batches(plan.forest, order_policy(order), cost, _boundaries(plan.boundaries)):
        b.slots = plan.slots
        yield b
