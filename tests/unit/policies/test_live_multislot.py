"""The policy round with batches on several slots: GENIE's width by its cost-effective ratio (Eq. 5)
under the deadline (Alg. 1), wide work on n slots of one node manager, and Hermes' G_thres."""

from __future__ import annotations

import pytest

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.genie import ClusterShape, choose_width
from stagetree.core.policies.live import Running, Work, parse_policies, place_work, plan_round
from stagetree.core.slots import Slot

SHAPE = ClusterShape(1, 4)


def test_genie_takes_the_most_cost_effective_width_that_meets_the_deadline() -> None:
    overhead = [(1, 100.0), (2, 55.0), (4, 32.0)]  # t = 10 + 90 / n: widening pays less and less
    # Normal: the ECT (2 x 100 s) is met by every width, and one slot is the most cost-effective
    assert choose_width("normal", 0.0, overhead, 0.0, SHAPE)[0] == 1
    # Prior, 50 s after it arrived: only 4 slots finish by the ECT (arrival + 100 s)
    n, latency, allowance = choose_width("prior", 0.0, overhead, 50.0, SHAPE)
    assert (n, latency) == (4, 32.0) and allowance == pytest.approx(100 - (50 + 32))
    # ideal scaling: the wider the cheaper per unit of work (Eq. 5's node term amortized)
    ideal = [(1, 100.0), (2, 50.0), (4, 25.0)]
    assert choose_width("normal", 0.0, ideal, 0.0, SHAPE)[0] == 4
    # Urgent: nothing meets an ECT of its arrival; the highest CER of all
    assert choose_width("urgent", 0.0, overhead, 1.0, SHAPE)[0] == 1
    # widths the cluster does not have are not candidates
    assert choose_width("prior", 0.0, [(1, 100.0), (8, 13.0)], 50.0, SHAPE)[0] == 1
    with pytest.raises(InvalidArgument):
        choose_width("asap", 0.0, overhead, 0.0, SHAPE)


def test_the_round_gives_a_qos_batch_the_width_genie_picks_on_one_node_manager() -> None:
    free = [Slot("a0", "a"), Slot("b0", "b"), Slot("b1", "b"), Slot("b2", "b"), Slot("b3", "b")]
    pols = {"s": parse_policies({"qos": "prior", "slots": 4})}
    work = [Work(0, "s", "j", 32.0, 0.0, 4, ((1, 100.0), (2, 55.0), (4, 32.0)))]
    plan = plan_round(work, free, {}, [], pols, {}, now=50.0)
    assert plan.dispatch == [(0, "b0,b1,b2,b3")]
    relaxed = plan_round(work, free, {}, [], pols, {}, now=0.0)  # time enough: one slot is cheapest
    assert relaxed.dispatch == [(0, "a0")]


def test_wide_work_takes_n_slots_of_one_node_manager_or_waits() -> None:
    free = [Slot("a0", "a"), Slot("b0", "b"), Slot("b1", "b")]
    work = [Work(0, "s", "j0", 1.0, 0.0, 2), Work(1, "s", "j1", 1.0, 0.0, 2), Work(2, "s", "j2", 1.0, 0.0)]
    assert place_work(work, free, {}, [], {}) == [(0, "b0,b1"), (2, "a0")]


def test_hermes_g_thres_caps_the_time_sharing_jobs_of_a_device() -> None:
    gpu0a, gpu0b = Slot("g0a", "nm", "A100", 0), Slot("g0b", "nm", "A100", 0)
    gpu1a, gpu1b = Slot("g1a", "nm", "A100", 1), Slot("g1b", "nm", "A100", 1)
    pols = {"ts": parse_policies({"time_share": "hermes", "time_share_params": {"g_thres": 1}})}
    assert pols["ts"].time_share is not None and pols["ts"].time_share.g_thres == 1
    running = [Running(9, "g0a", "ts", "old", 0.0)]
    work = [Work(0, "ts", "j0", 1.0, 0.0), Work(1, "ts", "j1", 1.0, 0.0)]
    # gpu0 holds one job already: j0 goes to gpu1, and j1 finds every GPU at G_thres (the global queue)
    got = place_work(work, [gpu0b, gpu1a, gpu1b], {"g0a": gpu0a}, running, pols)
    assert got == [(0, "g1a")]
    roomy = {"ts": parse_policies({"time_share": "hermes"})}  # G_thres 4: the fewest jobs first
    assert place_work(work, [gpu0b, gpu1a, gpu1b], {"g0a": gpu0a}, running, roomy) == [(0, "g1a"), (1, "g0b")]
    with pytest.raises(InvalidArgument, match="g_thres >= 1"):
        parse_policies({"time_share": "hermes", "time_share_params": {"g_thres": 0}})
