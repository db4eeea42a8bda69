"""Order steps: how one study's ready work is reordered, and the order across studies.

Within a study (``OrderStep``, one per policy the study chose, applied in turn, so the last decides
first; ties go to the work whose first request came first): GENIE's width and waiting allowance
(``QosOrder``), POP's promising trials first and the others round robin (``SearchOrder``), Hermes'
score (``TimeShareOrder``), HyperSack's longest first for the decreasing packing policies
(``DecreasingOrder``). A study that chose none keeps the cut's order (the critical path) and is cut
lazily.

Across studies (``share_key``): the next batch comes from the study whose owner, then whose study,
holds the fewest slots (running and placed this round), so that a study that arrives while another
has hundreds of requests waiting gets the next slots that free (a fair share by default). When a
study in the round has a QoS class, GENIE's order key comes first (``Work.tier``: its waiting
allowance, or its arrival under a baseline width policy; work without a class counts as ``normal``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from stagetree.core.ids import StudyId
from stagetree.core.policies import genie, hermes
from stagetree.core.policies.state import PolicyState
from stagetree.core.policies.study import TimeShareParams
from stagetree.core.round.work import Work


@dataclass(frozen=True)
class OrderView:
    """What an order step may read besides the work: the clock, the policies' state, the cluster's
    shape (node managers x their most slots) and the most slots one node manager has free now."""

    now: float
    state: PolicyState
    shape: genie.ClusterShape
    most_free: int


class OrderStep(Protocol):
    def order(self, work: Sequence[Work], view: OrderView) -> list[Work]:
        """``work`` (one study's, in its current order) reordered."""
        ...


MIN_LATENCY_S = 1e-6  # work with no steps (an evaluation of a saved model) still takes some time


def widths_of(w: Work) -> tuple[tuple[int, float], ...]:
    """The (slots, seconds) ``w`` may run on: its widths, or its own slots; every latency positive."""
    return tuple((n, max(t, MIN_LATENCY_S)) for n, t in (w.widths or ((w.slots, w.cost_s),)))


@dataclass(frozen=True)
class QosOrder:
    """GENIE: each batch's width by the study's width policy (``genie.WIDTH_POLICIES``), the other
    widths it may start on and whether it holds free slots when none fits, then the work in increasing
    order key (the waiting allowance ``ECT - (now + latency)``, after them the work that can no longer
    meet its ECT; arrival for a baseline)."""

    qos: str
    width: str = genie.DEFAULT_WIDTH_POLICY

    def order(self, work: Sequence[Work], view: OrderView) -> list[Work]:
        choose = genie.width_policy(self.width)
        out = []
        for w in work:
            c = choose(self.qos, w.arrival, widths_of(w), view.now, view.shape, view.most_free)
            out.append(replace(w, slots=c.slots, cost_s=c.latency, tier=c.key, others=c.others, hold=c.hold))
        out.sort(key=lambda w: (w.tier, w.arrival, w.first))
        return out


def normal_tier(w: Work, view: OrderView) -> float:
    """GENIE's waiting allowance of work of a study without a QoS class (it counts as ``normal``)."""
    own = ((w.slots, max(w.cost_s, MIN_LATENCY_S)),)
    return genie.choose_width("normal", w.arrival, own, view.now, _shape_for(w, view))[2]


def _shape_for(w: Work, view: OrderView) -> genie.ClusterShape:
    return genie.ClusterShape(view.shape.nodes, max(view.shape.gpus_per_node, w.slots))


@dataclass(frozen=True)
class SearchOrder:
    """POP: the promising trials first (highest confidence ``p``), then the others in the order they
    became idle (a suspended trial when it was suspended, a new one when it arrived): the round robin
    of the opportunistic trials (HyperDrive's ``AllocateJobs``)."""

    study: StudyId

    def order(self, work: Sequence[Work], view: OrderView) -> list[Work]:
        policy = view.state.search.get(self.study)
        if policy is None:
            return list(work)
        suspended = view.state.suspended_at

        def key(w: Work) -> tuple[float, float, int]:
            p = policy.priority(w.key)
            return (-(p if p is not None else -1.0), suspended.get(w.key, w.arrival), w.first)

        return sorted(work, key=key)


@dataclass(frozen=True)
class TimeShareOrder:
    """Hermes (or a baseline): the largest score first (never-run jobs first), then the oldest."""

    params: TimeShareParams

    def order(self, work: Sequence[Work], view: OrderView) -> list[Work]:
        policy = self.params.make()
        jobs = view.state.jobs

        def key(w: Work) -> tuple[float, float, int]:
            job = jobs.get(w.key) or hermes.TimeShareJob(w.key, w.arrival)
            return (-policy.score(job, view.now), w.arrival, w.first)

        return sorted(work, key=key)


@dataclass(frozen=True)
class DecreasingOrder:
    """HyperSack's ``ffd`` and ``wfd``: the longest expected work first."""

    def order(self, work: Sequence[Work], view: OrderView) -> list[Work]:
        return sorted(work, key=lambda w: (-w.cost_s, w.first))


def share_key(
    w: Work, held: Mapping[StudyId | None, int], owner_held: Mapping[str, int], owners: Mapping[StudyId, str]
) -> tuple[float, int, int, tuple[float, ...]]:
    """The order across studies of the next batch of each: GENIE's tier, then the slots the study's owner
    holds, then those the study holds, then the cut's order."""
    owner = owners.get(w.study, "") if w.study is not None else ""
    return (w.tier, owner_held.get(owner, 0), held.get(w.study, 0), w.batch.rank)


Q = TypeVar("Q")


class FairShare(Generic[Q]):
    """Queues of work taken in ``share_key``'s order of their heads, ties to the queue pushed first.

    A placement changes the slots held by one study and its owner, which moves the key of every queue of
    that owner; one heap of all queues would re-key each of them after every placement (a round filling
    1,600 slots from 50 plans popped 15 stale entries a placement). So the queues are kept in three
    levels of heaps, each ordered by what is the same for all its entries at the level above: a study's
    queues by (tier, rank), an owner's studies by (tier, slots the study holds, rank) of their best
    queue, the owners by (tier, slots the owner holds, ...) of their best study. A placement re-keys its
    study and its owner only. Entries that a re-key replaced stay in the heaps and are skipped (each
    level's entry carries the version of the study or owner it was made from)."""

    def __init__(self, owners: Mapping[StudyId, str]) -> None:
        self.owners = owners
        self.held: dict[StudyId | None, int] = {}
        self.owner_held: dict[str, int] = {}
        self._seq = itertools.count()
        self._study: dict[StudyId | None, list[tuple[tuple[float, tuple[float, ...], int], Q]]] = {}
        self._owner: dict[str, list[tuple[tuple[float, int, tuple[float, ...], int], StudyId | None, int]]] = {}
        self._top: list[tuple[tuple[float, int, int, tuple[float, ...], int], str, int]] = []
        self._study_ver: dict[StudyId | None, int] = {}
        self._owner_ver: dict[str, int] = {}

    def owner_of(self, study: StudyId | None) -> str:
        return self.owners.get(study, "") if study is not None else ""

    def took(self, study: StudyId | None, slots: int) -> None:
        """``study`` holds ``slots`` more (running, or placed this round)."""
        self.held[study] = self.held.get(study, 0) + slots
        owner = self.owner_of(study)
        if study is not None:
            self.owner_held[owner] = self.owner_held.get(owner, 0) + slots
        self._restudy(study)

    def push(self, q: Q, study: StudyId | None, tier: float, rank: tuple[float, ...]) -> None:
        """Queue ``q`` whose head is of ``study``, with that tier and rank."""
        heapq.heappush(self._study.setdefault(study, []), ((tier, rank, next(self._seq)), q))
        self._restudy(study)

    def pop(self) -> Q | None:
        """The queue whose head comes first (taken out; push it again with its next head), None when empty."""
        while self._top:
            _, owner, ver = heapq.heappop(self._top)
            if ver != self._owner_ver[owner]:
                continue
            _, study, _ = self._owner[owner][0]  # _reowner left a current entry on top
            _, q = heapq.heappop(self._study[study])
            self._restudy(study)
            return q
        return None

    def queues(self) -> list[Q]:
        """The queues still in, in no particular order."""
        return [q for h in self._study.values() for _, q in h]

    def _restudy(self, study: StudyId | None) -> None:
        ver = self._study_ver[study] = self._study_ver.get(study, 0) + 1
        owner = self.owner_of(study)
        mine = self._study.get(study)
        if mine:
            (tier, rank, seq), _ = mine[0]
            entry = ((tier, self.held.get(study, 0), rank, seq), study, ver)
            heapq.heappush(self._owner.setdefault(owner, []), entry)
        self._reowner(owner)

    def _reowner(self, owner: str) -> None:
        ver = self._owner_ver[owner] = self._owner_ver.get(owner, 0) + 1
        studies = self._owner.get(owner)
        while studies and studies[0][2] != self._study_ver[studies[0][1]]:
            heapq.heappop(studies)
        if studies:
            (tier, held, rank, seq), _, _ = studies[0]
            heapq.heappush(self._top, ((tier, self.owner_held.get(owner, 0), held, rank, seq), owner, ver))
