"""The four scheduling papers' comparisons through the live round (``python -m tests.bench.policies [--verbose]``).

Every comparison runs on ``core.simulator``, which calls the scheduling round the master's loop calls
(``stagetree.core.round.plan_round``): each paper's policy and its baselines are steps a study selects,
as a user of the master would select them. One line per paper, a line for studies with different
policies sharing one cluster, then the last line
``hermes_vs_best_baseline=<x> pop_vs_best_baseline=<x> wfd_vs_one_per_gpu=<x> wfd_occupancy_vs_exact=<x>
genie_qos_vs_best_baseline=<x> mixed_vs_single=<x> live_round=<true|false>``; every ratio reads "better
than 1". ``live_round`` is true when the simulator's round is the very function object the master's
loop calls and no paper has a simulation loop of its own. Workloads are seeded and shaped like the
papers' (``tests/sim/papers``); several seeds are averaged. The figures go to
``tests/bench/results/policies.json`` (``tests.bench.record``).

* Hermes (§4.2, Fig. 5-6): 16 jobs (4 or 12 good) on 4 GPUs, four CNNs, time until the (up to) four best
  jobs reach 90% of the best loss. Per scenario (bin x model) the best of FIFO / RR / SLAQ over Hermes,
  each averaged over seeds; the figure is the geometric mean over the eight scenarios.
* HyperDrive POP (§6.2, Fig. 7): 100 CIFAR-10-like configurations on 4 machines, target accuracy 0.77;
  mean time to target over seeds; the best of Bandit / EarlyTerm over POP.
* HyperSack (§V-B/C, Table III, Fig. 10, 13): SP1 (96 trials, utilization < 50%) on 4 A100s with the
  oversubscription ratio 3; one-per-GPU makespan over WFD's. Occupancy: one round's WFD placement over
  the exact optimum of that decision on one 2-GPU node with two to three times more trials pending than
  fit (r = 2 and 3, Table III's situation), mean over instances; the few-trials r = 1 case is printed.
* GENIE (§IV-B, Fig. 4): Poisson task queues of 24 h at 5, 10, 20 tasks/h on 4 nodes x 4 GPUs, models
  fitted from a noisy lightweight profile, Eq. 5's theta = 0.02; a batch's slots are on one node (the
  round places them on one node manager, so widths are 1 to 4); per density GENIE's QoS-guarantee %
  over the best baseline's, geometric mean over densities. An Urgent task's ECT is its arrival, which
  nothing meets, so no policy passes the share of the other tasks (about 95%): the line also gives the
  geometric mean a policy meeting every other deadline would reach against the same baselines.
* Mixed: on 8 GPUs (2 nodes), a Hermes-bin study (16 jobs) and an ASHA study (shared prefixes) at once,
  the lookahead on, run three ways: both with the default steps, both time-shared by Hermes, and each
  with the steps that suit it (Hermes for the first, the default for ASHA). Each run's score is the
  geometric mean of the Hermes study's time to 90% and the ASHA study's completion; ``mixed_vs_single``
  is the mixed run's score against the better of the two single-policy runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from stagetree.core import simulator
from stagetree.core.config import Config
from stagetree.core.ids import PlanId, RequestId, StudyId
from stagetree.core.policies import packing
from stagetree.core.policies.genie import ClusterShape
from stagetree.core.policies.packing import GpuBin, PackItem, exact_place, occupancy
from stagetree.core.policies.study import StudyPolicies, parse_policies
from stagetree.core.round import PlanWork, RoundInput, plan_round
from stagetree.core.searchplan import SearchPlan
from stagetree.core.simulator import Ask, Fault, Simulator, synthetic_curve
from stagetree.core.slots import Slot
from stagetree.core.stagetree import build_stage_tree
from tests.bench.record import record
from tests.bench.scheduler import asha_configs, step_time
from tests.sim.drivers import ASHADriver
from tests.sim.papers import genie as genie_w
from tests.sim.papers import hermes as hermes_w
from tests.sim.papers import hypersack as sack
from tests.sim.papers import pop as pop_w

VERBOSE = False
ONE_PLAN = PlanId(1)


def detail(msg: str) -> None:
    if VERBOSE:
        print(f"  {msg}", flush=True)


def geomean(xs: Sequence[float]) -> float:
    return math.exp(statistics.mean(math.log(x) for x in xs))


# ---------------------------------------------------------------------------------------------
# Hermes


def hermes(seeds: int = 10) -> tuple[float, str]:
    baselines = ("fifo", "rr", "slaq")
    ratios = []
    wins = 0
    for bin_type in (1, 2):
        for model in hermes_w.MODELS.values():
            mean = {}
            for name in (*baselines, "hermes"):
                times = [
                    hermes_w.run_time_sharing(hermes_w.hermes_bin(bin_type, seed), name, model).mean_reach
                    for seed in range(seeds)
                ]
                mean[name] = statistics.mean(times)
            best = min(baselines, key=lambda b: mean[b])
            ratios.append(mean[best] / mean["hermes"])
            wins += mean["hermes"] <= mean[best]
            detail(
                f"hermes bin={bin_type} {model.name:9s} "
                + " ".join(f"{k}={v:6.1f}s" for k, v in mean.items())
                + f" best_baseline={best} speedup={ratios[-1]:.2f}"
            )
    g = geomean(ratios)
    line = (
        f"hermes: time to 90% of the best loss, 2 bins x 4 CNNs x {seeds} seeds, 4 GPUs: speedup over the best of "
        f"FIFO/RR/SLAQ per scenario geomean={g:.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}), "
        f"Hermes best in {wins}/{len(ratios)}"
    )
    return g, line


# ---------------------------------------------------------------------------------------------
# HyperDrive POP


def pop(seeds: int = 8) -> tuple[float, str]:
    names = ("default", "bandit", "earlyterm", "pop")
    times: dict[str, list[float]] = {n: [] for n in names}
    for seed in range(seeds):
        traces = pop_w.cifar_like_traces(seed=seed)
        for n in names:
            run = pop_w.run_search(traces, n, 4, 0.77)
            # A search that never gets there counts its whole length (it only happens to Bandit, rarely).
            times[n].append(run.time_to_target if math.isfinite(run.time_to_target) else run.end)
        detail("pop seed=" + str(seed) + " " + " ".join(f"{n}={times[n][-1] / 3600:5.2f}h" for n in names))
    mean = {n: statistics.mean(v) / 3600 for n, v in times.items()}
    best = min(("bandit", "earlyterm"), key=lambda n: mean[n])
    ratio = mean[best] / mean["pop"]
    line = (
        f"pop: hours to 0.77 accuracy, 100 configs on 4 machines, {seeds} seeds: "
        + " ".join(f"{n}={mean[n]:.2f}" for n in names)
        + f"; pop vs {best} {ratio:.2f}x"
    )
    return ratio, line


# ---------------------------------------------------------------------------------------------
# HyperSack


def hypersack(seeds: int = 3) -> tuple[float, float, str]:
    policies = ("one_per_gpu", "ff", "ffd", "wf", "wfd")
    makespan: dict[str, list[float]] = {p: [] for p in policies}
    for seed in range(seeds):
        jobs = sack.sp_workload(seed=seed)
        seen = sack.estimates(jobs, seed=seed)
        for p in policies:
            makespan[p].append(sack.run_packing(jobs, sack.a100_slots(4), p, seen).makespan)
    mean = {p: statistics.mean(v) for p, v in makespan.items()}
    speed = {p: mean["one_per_gpu"] / mean[p] for p in policies}
    detail("hypersack SP1 4xA100 r=3 speedup " + " ".join(f"{p}={speed[p]:.2f}" for p in policies))
    if VERBOSE:
        sweep = []
        jobs = sack.sp_workload(seed=0)
        for r in (1.0, 2.0, 3.0, 4.0):
            run = sack.run_packing(jobs, sack.a100_slots(4), "wfd", sack.estimates(jobs, seed=0), oversub=r)
            sweep.append(f"r={r:g}:{makespan['one_per_gpu'][0] / run.makespan:.2f}")
        detail("hypersack WFD speedup by oversubscription ratio (Fig. 13) " + " ".join(sweep))
    # Heterogeneous SP4 (384 trials) on 4 H100 + 6 A100, with one A100 failing and one added mid-run.
    jobs = sack.sp_workload(n_lr=16, seed=0)
    slots = sack.h100_slots(4) + sack.a100_slots(6)
    lost = [s for s in slots if s.id.startswith("a0.")]
    added = tuple(sack.a100_slots(1, first=8))
    faults = [Fault(1800.0, "lose", tuple(lost)), Fault(3600.0, "add", added)]
    hetero = {p: sack.run_packing(jobs, slots, p, sack.estimates(jobs), faults=faults) for p in ("one_per_gpu", "wfd")}
    hetero_speed = hetero["one_per_gpu"].makespan / hetero["wfd"].makespan
    occ, small = occupancy_vs_exact()
    line = (
        f"hypersack: SP1 96 trials on 4 A100 (r=3), {seeds} seeds, makespan speedup over one-per-GPU "
        + " ".join(f"{p}={speed[p]:.2f}" for p in policies[1:])
        + f"; SP4 384 trials on 4 H100 + 6 A100 with a failure and an added GPU: wfd {hetero_speed:.2f}x "
        f"({hetero['wfd'].requeued} batches lost); occupancy wfd/exact {occ:.3f} (few-trials r=1 case {small:.3f})"
    )
    return speed["wfd"], occ, line


def _sampled(jobs: list[sack.PackJob], n: int, rng: random.Random) -> list[PackItem]:
    chosen = rng.sample(jobs, n)
    # NVML reports whole percentages; the exact search relies on it for its subset-sum bound.
    out = []
    for j in chosen:
        d = j.true["a100"]
        out.append(
            PackItem(j.id, {"a100": packing.Demand(float(round(d.compute)), d.memory * sack.GB, d.cpus, d.runtime_s)})
        )
    return out


def one_decision(items: Sequence[PackItem], slots: Sequence[Slot], oversub: float) -> dict[str, str]:
    """The live round's WFD placement of ``items`` (one study each, declaring its demand) on ``slots``:
    item id -> device."""
    plan = SearchPlan("occupancy")
    requests: dict[RequestId, StudyId] = {}
    policies: dict[StudyId, StudyPolicies] = {}
    for i, it in enumerate(items):
        d = it.demand["a100"]
        res = plan.add_request(Config.of({"item": i}), 1, study=it.id)
        assert res.request is not None
        requests[RequestId(res.request.id)] = StudyId(it.id)
        params = {"compute": d.compute, "memory_bytes": d.memory, "cpus": d.cpus, "oversub": oversub}
        policies[StudyId(it.id)] = parse_policies({"placement": "wfd", "placement_params": params})
    pending = [(RequestId(r.id), r.point) for r in plan.pending()]
    forest = build_stage_tree(plan.nodes, {}, pending, plan=ONE_PLAN)
    by_node = {r.point.node: items[i].demand["a100"].runtime_s for i, r in enumerate(plan.requests.values())}
    work = PlanWork(ONE_PLAN, forest, [by_node[st.node] for st in forest.stages])
    dec = plan_round(RoundInput(now=0.0, plans=[work], requests=requests, free=slots, policies=policies))
    return {str(d.study): d.slot.device for d in dec.dispatches}


def occupancy_vs_exact(instances: int = 8) -> tuple[float, float]:
    """The live round's WFD occupancy over the exact optimum for one decision on one node of two 80 GB
    GPUs (96 cores, HyperSack's H100 node shape) with A100 demands: small enough for the exact search."""
    slots = sack.gpu_slots("x", "a100", 2, 2, 96, 24)
    memory = {s.device: 0 for s in slots}
    for s in slots:
        memory[s.device] += s.memory_bytes

    def ratios(r: float, pending: int) -> list[float]:
        out = []
        for seed in range(instances):
            rng = random.Random(f"occ:{r}:{pending}:{seed}")
            items = _sampled(sack.sp_workload(seed=seed), pending, rng)
            gpus = [GpuBin(Slot(dev, "nx0", "a100"), float(mem), r) for dev, mem in memory.items()]
            exact = occupancy(exact_place(items, gpus, {"nx0": 96.0}), items, gpus)
            live = occupancy(one_decision(items, slots, r), items, gpus)
            out.append(live / exact)
        return out

    # Table III's situation: more trials pending than fit (2x and 3x), the oversubscription ratio tuned.
    main = ratios(2.0, 16) + ratios(3.0, 24) + ratios(3.0, 32)
    small = ratios(1.0, 8)  # few trials, no oversubscription: where greedy packing loses the most
    detail(f"hypersack occupancy wfd/exact per instance (r=2,3): {[round(x, 3) for x in main]}")
    return statistics.mean(main), statistics.mean(small)


# ---------------------------------------------------------------------------------------------
# GENIE


def genie(seeds: int = 4) -> tuple[float, str]:
    shape = ClusterShape(4, 4)
    baselines = ("maxocc", "minocc", "perfpre", "cerpre")
    ratios = []
    bounds = []
    parts = []
    for density in (5, 10, 20):
        qos: dict[str, list[float]] = {p: [] for p in (*baselines, "genie")}
        span: dict[str, list[float]] = {p: [] for p in qos}
        meetable = []
        for seed in range(seeds):
            tasks = genie_w.genie_tasks(density, seed=seed)
            meetable.append(100.0 * sum(t.qos != "urgent" for t in tasks) / len(tasks))
            believed = genie_w.profiled_models(shape, seed=seed)
            for p in qos:
                run = genie_w.run_qos(tasks, p, shape, believed)
                qos[p].append(run.qos_pct)
                span[p].append(run.makespan / 3600)
        mean = {p: statistics.mean(v) for p, v in qos.items()}
        best = max(baselines, key=lambda p: mean[p])
        ratios.append(mean["genie"] / mean[best])
        bounds.append(statistics.mean(meetable) / mean[best])
        best_span = min(statistics.mean(span[p]) for p in baselines)
        parts.append(
            f"{density}/h genie {mean['genie']:.1f}% vs {best} {mean[best]:.1f}% ({ratios[-1]:.2f}x), "
            f"makespan {statistics.mean(span['genie']):.1f}h vs {best_span:.1f}h"
        )
        detail(f"genie {density}/h " + " ".join(f"{p}={mean[p]:.1f}%/{statistics.mean(span[p]):.1f}h" for p in qos))
    g = geomean(ratios)
    line = (
        f"genie: QoS-guarantee %, 16 GPUs, {seeds} seeds: "
        + "; ".join(parts)
        + f"; geomean {g:.2f}x (every non-urgent deadline met: {geomean(bounds):.2f}x)"
    )
    return g, line


# ---------------------------------------------------------------------------------------------
# Studies with different policies on one cluster


class _Mixed:
    """The Hermes bin's jobs (study ``ts``) and an ASHA study (study ``asha``) submitted together."""

    def __init__(self, jobs: Sequence[hermes_w.LossJob], asha: ASHADriver) -> None:
        self.hermes = hermes_w.AllJobs(jobs, study="ts", plan="ts")
        self.asha = asha

    def start(self) -> list[Ask]:
        return [*self.hermes.start(), *(_asha(a) for a in self.asha.start())]

    def on_result(self, tag: Any, step: int, metrics: dict[str, float]) -> list[Ask]:
        if isinstance(tag, str):
            return []
        return [_asha(a) for a in self.asha.on_result(tag, step, metrics)]


def _asha(a: Ask) -> Ask:
    return Ask(a.tag, a.config, a.step, "asha", "asha")


class _MixedWorkload:
    def __init__(self, jobs: Sequence[hermes_w.LossJob], model: hermes_w.Model, curve: simulator.Curve) -> None:
        self.hermes = hermes_w.HermesWorkload(jobs, model)
        self.curve = curve

    def step_s(self, config: Config, step: int, slots: int, gpu_type: str) -> float:
        if "job" in config.names():
            return self.hermes.step_s(config, step, slots, gpu_type)
        return step_time(config, step) / slots

    def metrics(self, config: Config, step: int) -> dict[str, float]:
        if "job" in config.names():
            return self.hermes.metrics(config, step)
        return {"loss": self.curve(config, step)}


def mixed_run(how: str, seed: int) -> tuple[float, float]:
    """(the Hermes study's time to 90%, the ASHA study's completion) with the studies' steps ``how``:
    ``default`` for both, ``hermes`` for both, or ``mixed``."""
    jobs = hermes_w.hermes_bin(1, seed)
    model = hermes_w.MODELS["vgg16"]
    curve = synthetic_curve(seed)
    asha = ASHADriver(asha_configs(120, seed=seed), min_step=4, eta=4, max_step=64, concurrency=16, curve=curve)
    ts = parse_policies(hermes_w.time_share_policies("hermes"))
    policies = {"default": {}, "hermes": {"ts": ts, "asha": ts}, "mixed": {"ts": ts}}[how]
    targets = hermes_w.goal_iterations(jobs)
    want = {(i, targets[j.id]): j.id for i, j in enumerate(jobs) if j.id in targets}
    reach: dict[str, float] = {}

    def on_step(config: Config, step: int, t: float) -> None:
        if "job" in config.names():
            job = want.get((hermes_w.job_index(config), step))
            if job is not None and job not in reach:
                reach[job] = t

    gpus = [Slot(f"g{h}.{i}", f"h{h}", "gpu", i) for h in range(2) for i in range(4)]
    sim = Simulator(
        _Mixed(jobs, asha),
        gpus,
        workload=_MixedWorkload(jobs, model, curve),
        policies=policies,
        load_s=model.restore_s,
        save_s=model.save_s,
        lookahead_s=3.0,
        on_step=on_step,
    )
    report = sim.run()
    asha_done = max(t for tag, t in report.served_at.items() if not isinstance(tag, str))
    return statistics.mean(reach.values()), asha_done


def mixed(seeds: int = 3) -> tuple[float, str]:
    scores: dict[str, list[float]] = {}
    parts: dict[str, tuple[float, float]] = {}
    for how in ("default", "hermes", "mixed"):
        runs = [mixed_run(how, seed) for seed in range(seeds)]
        ts = statistics.mean(r[0] for r in runs)
        asha = statistics.mean(r[1] for r in runs)
        parts[how] = (ts, asha)
        scores[how] = [math.sqrt(ts * asha)]
        detail(f"mixed {how}: hermes study to 90% {ts:.1f}s, asha study done {asha:.1f}s")
    score = {h: v[0] for h, v in scores.items()}
    ratio = min(score["default"], score["hermes"]) / score["mixed"]
    line = (
        f"mixed: a Hermes study and an ASHA study on 8 GPUs, lookahead on, {seeds} seeds: "
        + "; ".join(f"{h}: hermes study {ts:.0f}s, asha study {a:.0f}s" for h, (ts, a) in parts.items())
        + f"; mixed vs the better single policy {ratio:.2f}x"
    )
    return ratio, line


# ---------------------------------------------------------------------------------------------


def live_round() -> bool:
    """Whether the simulator's round is the function object the master's loop calls, and no paper has a
    simulation loop of its own."""
    from stagetree.master import scheduling

    own_loops = [
        m
        for m in ("hermes_sim", "pop_sim", "packing_sim", "genie_sim")
        if importlib.util.find_spec(f"stagetree.core.policies.{m}") is not None
    ]
    return getattr(scheduling, "plan_round", None) is simulator.ROUND is plan_round and not own_loops


def main() -> None:
    global VERBOSE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true", help="per-scenario lines too")
    VERBOSE = ap.parse_args().verbose
    t0 = time.perf_counter()
    lines = []
    h, line = hermes()
    lines.append(line)
    print(line, flush=True)
    p, line = pop()
    lines.append(line)
    print(line, flush=True)
    w, occ, line = hypersack()
    lines.append(line)
    print(line, flush=True)
    g, line = genie()
    lines.append(line)
    print(line, flush=True)
    m, line = mixed()
    lines.append(line)
    print(line, flush=True)
    live = live_round()
    took = time.perf_counter() - t0
    print(f"(simulated in {took:.0f} s)", file=sys.stderr, flush=True)
    last = (
        f"hermes_vs_best_baseline={h:.2f} pop_vs_best_baseline={p:.2f} wfd_vs_one_per_gpu={w:.2f} "
        f"wfd_occupancy_vs_exact={occ:.3f} genie_qos_vs_best_baseline={g:.2f} mixed_vs_single={m:.2f} "
        f"live_round={str(live).lower()}"
    )
    print(record("policies", last, extra={"lines": lines, "seconds": round(took)}), flush=True)


if __name__ == "__main__":
    main()
