"""The identities that travel between the store, the scheduling round and the node managers.

Each is its own type, so that a plan id is never passed where a batch id is expected and a study id is
never formatted into something else: ``PlanId``, ``BatchId``, ``RequestId`` are the database's integer
keys, ``StudyId`` and ``SlotId`` strings, ``HostId`` the id a node manager registers under. ``JobKey``
names a trial as the scheduling policies see it (``str`` gives its text form, ``parse`` reads it back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

from stagetree.core.errors import InvalidArgument

PlanId = NewType("PlanId", int)
BatchId = NewType("BatchId", int)
RequestId = NewType("RequestId", int)
StudyId = NewType("StudyId", str)
SlotId = NewType("SlotId", str)
HostId = NewType("HostId", str)

NO_PLAN = PlanId(0)  # a stage or batch built outside any stored plan (tests, one-plan tools)


@dataclass(frozen=True, order=True)
class JobKey:
    """A trial as the policies see it: the end point of its batches in its plan. A preempted batch's
    remaining work ends at the same point, so the trial keeps its key across preemptions."""

    plan: PlanId
    node: int
    step: int

    def __str__(self) -> str:
        return f"{self.plan}:{self.node}:{self.step}"

    @classmethod
    def parse(cls, text: str) -> JobKey:
        """The key ``str`` wrote (``"plan:node:step"``)."""
        try:
            plan, node, step = text.split(":")
            return cls(PlanId(int(plan)), int(node), int(step))
        except ValueError:
            raise InvalidArgument(f"a job key is 'plan:node:step', got {text!r}") from None
