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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

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
    """GENIE: each batch's width by the study's width policy (``genie.WIDTH_POLICIES``), then the work
    in increasing order key (the waiting allowance ``ECT - (now + latency)``; arrival for a baseline)."""

    qos: str
    width: str = genie.DEFAULT_WIDTH_POLICY

    def order(self, work: Sequence[Work], view: OrderView) -> list[Work]:
        choose = genie.width_policy(self.width)
        out = []
        for w in work:
            n, latency, key = choose(self.qos, w.arrival, widths_of(w), view.now, view.shape, view.most_free)
            out.append(replace(w, slots=n, cost_s=latency, tier=key))
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
