"""Hermes: Eq. 2-4 and Alg. 1-3 by hand, the quantum's growth, and time-sharing studies through the live
round on the simulator (``tests.sim.papers.hermes``)."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.hermes import (
    TIME_SHARE_POLICIES,
    Hermes,
    Quantum,
    RoundRobin,
    RunningJob,
    Slaq,
    Switch,
    TimeShareJob,
    convergence,
    find_available_gpu,
    node_round,
    place_jobs,
    representative_loss,
    time_share_policy,
)
from tests.sim.papers.hermes import MODELS, hermes_bin, run_time_sharing


def test_convergence_by_hand() -> None:
    first = [4.0, 3.0, 3.5]
    assert representative_loss(first) == pytest.approx(3.5)  # (4 + 3) / 2
    assert convergence(first, None) == pytest.approx(1.0 / 3)  # Eq. 4: (4 - 3) / 3
    second = [3.2, 2.8]
    assert convergence(second, 3.5) == pytest.approx((3.5 - 3.0) / 2)  # Eq. 3
    job = TimeShareJob("j")
    assert job.record(first, 10.0).convergence == pytest.approx(1.0 / 3)
    assert job.record(second, 20.0).convergence == pytest.approx(0.25)
    with pytest.raises(InvalidArgument):
        representative_loss([])


def test_quantum_grows_at_loss_milestones() -> None:
    pol = Hermes(quantum_s=10.0, growth=2.0, milestones=(0.3, 0.45, 0.6))
    job = TimeShareJob("j")
    job.record([10.0, 10.0], 1.0, pol.milestones)
    assert pol.quantum(job) == 10.0
    job.record([6.0, 6.0], 2.0, pol.milestones)  # 40% shed: one milestone
    assert pol.quantum(job) == 20.0
    job.record([3.0, 3.0], 3.0, pol.milestones)  # 70% shed: all three
    assert pol.quantum(job) == 80.0
    job.record([9.0, 9.0], 4.0, pol.milestones)  # a noisy bump does not take a milestone back
    assert pol.quantum(job) == 80.0


def test_global_placement_alg_1_2() -> None:
    assert find_available_gpu({"g0": 2, "g1": 1, "g2": 3}) == "g1"
    assert find_available_gpu({"g0": 4, "g1": 4}) is None
    assert find_available_gpu({"g0": 1, "g1": 1}) == "g0"  # first on ties
    out = place_jobs([f"j{i}" for i in range(10)], {"g0": 0, "g1": 2, "g2": 0}, g_thres=3)
    # least loaded first: g0, g2 (0 jobs), g0, g2 (1 each, g1 has 2), then g0, g1, g2 at 2; then all full
    assert out == {"j0": "g0", "j1": "g2", "j2": "g0", "j3": "g2", "j4": "g0", "j5": "g1", "j6": "g2"}


@given(st.dictionaries(st.sampled_from([f"g{i}" for i in range(6)]), st.integers(0, 5), min_size=1), st.integers(1, 40))
def test_placement_respects_the_cap_and_balances(load: dict[str, int], n: int) -> None:
    out = place_jobs([f"j{i}" for i in range(n)], load, g_thres=4)
    counts = dict(load)
    for g in out.values():
        counts[g] += 1
    assert all(counts[g] <= max(4, load[g]) for g in counts)
    room = sum(max(4 - c, 0) for c in load.values())
    assert len(out) == min(n, room)  # stops only when every GPU is full
    if all(c == 0 for c in load.values()):
        assert max(counts.values()) - min(counts.values()) <= 1


def with_rates(jid: str, rates: list[float], end: float = 0.0) -> TimeShareJob:
    """A job whose quanta measured these convergences (Eq. 3), the last ending at ``end``."""
    return TimeShareJob(jid, quanta=[Quantum(5.0, 5.0, 5.0, 1, r, end) for r in rates])


def test_node_round_alg_3() -> None:
    pol = Hermes(quantum_s=10.0)
    fast, slow, new = with_rates("fast", [0.5]), with_rates("slow", [0.1]), with_rates("new", [])
    running = {"g0": RunningJob(slow, started=0.0)}
    waiting = {"g0": [fast, slow, new]}
    assert node_round(pol, running, waiting, now=5.0) == []  # quantum not expired: not preemptible
    assert node_round(pol, running, waiting, now=10.0) == [Switch("g0", "slow", "new")]  # never run: first
    waiting = {"g0": [fast, slow]}
    assert node_round(pol, running, waiting, now=10.0) == [Switch("g0", "slow", "fast")]
    keep = {"g0": RunningJob(fast, started=0.0)}
    assert node_round(pol, keep, {"g0": [fast, slow]}, now=10.0) == []  # still the best: keeps the GPU
    assert node_round(pol, {"g1": None}, {"g1": [slow]}, now=0.0) == [Switch("g1", None, "slow")]


def test_baseline_scores() -> None:
    rr = RoundRobin()
    assert rr.score(with_rates("b", [0.1], end=2.0), 10.0) > rr.score(with_rates("a", [0.3], end=5.0), 10.0)
    slaq = Slaq()
    # SLAQ: the next reduction extrapolated geometrically (last * last / previous), normalized by the job's
    # largest: a fast-converging job 0.5 * 0.5 / 1.0 = 0.25, a steadily (slowly) converging one 1.0
    assert slaq.score(with_rates("d", [1.0, 0.5]), 0.0) == pytest.approx(0.25)
    assert slaq.score(with_rates("s", [0.2, 0.2]), 0.0) == pytest.approx(1.0)
    assert slaq.score(with_rates("n", []), 0.0) == math.inf
    assert set(TIME_SHARE_POLICIES) == {"hermes", "fifo", "rr", "slaq"}
    with pytest.raises(InvalidArgument, match="known"):
        time_share_policy("lottery")


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 1000),
    bin_type=st.sampled_from([1, 2]),
    policy=st.sampled_from(sorted(TIME_SHARE_POLICIES)),
    gpus=st.integers(1, 4),
    g_thres=st.integers(1, 4),
)
def test_every_job_finishes_and_preemption_loses_no_iteration(
    seed: int, bin_type: int, policy: str, gpus: int, g_thres: int
) -> None:
    jobs = hermes_bin(bin_type, seed, iterations=200, n_jobs=8)
    model = MODELS["googlenet"]
    run = run_time_sharing(jobs, policy, model, n_gpus=gpus, g_thres=g_thres)
    finished = run.report.served_at
    assert set(finished) == {j.id for j in jobs}
    work = sum(j.iterations for j in jobs) * model.iter_s
    assert run.report.makespan >= work / gpus - 1e-6
    # nothing redone, nothing skipped: every iteration trained once
    assert run.report.executed_steps == run.report.unique_steps == sum(j.iterations for j in jobs)
    # every measured job got to the goal before (or when) it finished
    assert all(run.reach[j] <= finished[j] + 1e-9 for j in run.reach)
    if policy == "fifo":
        assert run.report.preemptions == 0


def test_hermes_gets_the_good_jobs_there_sooner_than_fifo_and_rr() -> None:
    model = MODELS["vgg16"]
    mean = {}
    for name in ("fifo", "rr", "hermes"):
        mean[name] = statistics.mean(run_time_sharing(hermes_bin(1, seed), name, model).mean_reach for seed in range(3))
    assert math.isfinite(mean["hermes"])
    assert mean["hermes"] < mean["rr"] < mean["fifo"]


@pytest.mark.parametrize("policy", sorted(TIME_SHARE_POLICIES))
def test_a_job_alone_on_its_gpu_pays_no_preemption(policy: str) -> None:
    jobs = hermes_bin(1, 0, iterations=300, n_jobs=2)
    model = MODELS["vgg19"]
    run = run_time_sharing(jobs, policy, model, n_gpus=2)
    assert run.report.preemptions == 0
    assert run.report.makespan == pytest.approx(300 * model.iter_s)
