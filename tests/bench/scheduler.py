"""Scheduler figures, all simulated in one process (`python -m tests.bench.scheduler`).

* a grid study (>= 200 trials whose learning-rate schedules share prefixes) and an ASHA study (>= 400
  trials, reduction 4), each on W = 8 and W = 40 simulated workers, under every ordering policy;
* a 10,000-request plan: time to build the stage tree and order it (one scheduling round).

Last line: ``merge_rate=<m> critical_vs_lower_bound=<r> critical_vs_bfs=<a> critical_vs_most_children=<b>
round_ms_10k=<t>``. ``merge_rate`` is the grid study's; ``critical_vs_lower_bound`` the worst makespan over
max(critical path, work / W) across scenarios; the two policy ratios are critical_path's makespan over
the baseline's on the ASHA scenario (worst over W).
"""

from __future__ import annotations

import itertools
import random
import statistics
import time

from stagetree.core.config import Config
from stagetree.core.round import plan_round
from stagetree.core.searchplan import SearchPlan
from stagetree.core.sequences import Constant, MultiStep, Piecewise, Warmup
from stagetree.core.simulator import SimReport, simulate, synthetic_curve
from stagetree.core.slots import Slot
from tests.bench import refs
from tests.bench.record import record
from tests.sim.drivers import ASHADriver, GridDriver
from tests.sim.inputs import plan_input

POLICIES = ("critical_path", "bfs", "most_children")
WORKERS = (8, 40)


def step_time(config: Config, step: int) -> float:
    """Seconds per step grow with the batch size, as on a GPU that is not saturated."""
    bs = config.values_at(step)["bs"]
    return 0.2 + float(bs) / 64.0


def lr_schedule(lr0: float, warmup: int, m1: int, m2: int, gamma: float) -> object:
    base = MultiStep(lr0, [m1, m2], gamma)
    return Warmup(0.0, warmup, base) if warmup else base


def grid_configs() -> list[Config]:
    """216 trials: warmup length, two milestones, decay factor, a batch-size ramp and a late weight-decay drop."""
    out = []
    for warm, m1, m2, g, bs, wd in itertools.product(
        (0, 5, 10), (30, 40), (60, 70, 80), (0.1, 0.2, 0.5), (0, 1), (0, 1)
    ):
        bsq = Constant(32) if bs == 0 else Piecewise([Constant(32), Constant(64)], [50])
        wdq = Constant(5e-4) if wd == 0 else MultiStep(5e-4, [90], 0.1)
        out.append(Config.of({"lr": lr_schedule(0.1, warm, m1, m2, g), "bs": bsq, "wd": wdq}))
    return out


def asha_configs(n: int, seed: int) -> list[Config]:
    space = list(
        itertools.product((0.2, 0.1, 0.05, 0.02), (0, 5, 10), (20, 30, 40), (50, 60, 70), (0.1, 0.3, 0.5), (0, 1, 2))
    )
    rng = random.Random(seed)
    chosen = rng.sample(space, n)
    out = []
    for lr0, warm, m1, m2, g, bs in chosen:
        bsq = [Constant(32), Constant(64), Piecewise([Constant(32), Constant(64)], [40])][bs]
        out.append(Config.of({"lr": lr_schedule(lr0, warm, m1, m2, g), "bs": bsq}))
    return out


def run_grid(workers: int, policy: str) -> SimReport:
    return simulate(GridDriver(grid_configs(), 100), workers, policy, step_time=step_time, load_s=0.5)


def run_asha(workers: int, policy: str) -> SimReport:
    curve = synthetic_curve(7)
    configs = asha_configs(400, seed=3)
    # More jobs outstanding than workers (as TreeML's ASHA study submits), so the order matters.
    driver = ASHADriver(configs, min_step=4, eta=4, max_step=64, concurrency=3 * workers, curve=curve)
    return simulate(driver, workers, policy, step_time=step_time, curve=curve, load_s=0.5)


def round_ms(n_requests: int, repeats: int = 5) -> float:
    """Build the stage tree of ``n_requests`` pending requests and order all of it, median of runs."""
    rng = random.Random(11)
    plan = SearchPlan("bench")
    space = list(
        itertools.product(
            (0.2, 0.1, 0.05, 0.02, 0.01), (0, 5, 10), (20, 30, 40, 45), (50, 60, 70, 80), (0.1, 0.3, 0.5), (0, 1, 2)
        )
    )
    configs = []
    for lr0, warm, m1, m2, g, bs in space:
        bsq = [Constant(32), Constant(64), Piecewise([Constant(32), Constant(64)], [40])][bs]
        configs.append(Config.of({"lr": lr_schedule(lr0, warm, m1, m2, g), "bs": bsq}))
    steps = (25, 50, 100, 150, 200, 300)
    while len(plan.requests) < n_requests:
        plan.add_request(rng.choice(configs), rng.choice(steps))
    slots = [Slot(f"w{i}") for i in range(40)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = plan_round(plan_input(plan, slots))
        times.append((time.perf_counter() - t0) * 1000)
        # the stage tree branches by value: the requests' 2,160 configs share their first steps, so fewer
        # batches than slots are ready at the start (each batch one slot; none dispatched twice)
        assert 0 < len(result.dispatches) <= len(slots)
        assert len({d.slots for d in result.dispatches}) == len(result.dispatches)
    return statistics.median(times)


def main() -> None:
    worst_bound = 0.0
    vs_bfs = 0.0
    vs_most = 0.0
    grid_merge = 0.0
    for name, runner in (("grid", run_grid), ("asha", run_asha)):
        for w in WORKERS:
            reports = {p: runner(w, p) for p in POLICIES}
            for p, r in reports.items():
                exact = r.executed_steps / r.unique_steps
                print(
                    f"{name:5s} W={w:<3d} {p:14s} requests={r.requests:4d} merge_rate={r.merge_rate:5.2f} "
                    f"makespan={r.makespan:9.1f} lower_bound={r.lower_bound:9.1f} ratio={r.vs_lower_bound:5.3f} "
                    f"executed/unique={exact:.2f} worker_s={r.worker_seconds:9.1f}",
                    flush=True,
                )
            crit = reports["critical_path"]
            worst_bound = max(worst_bound, crit.vs_lower_bound)
            if name == "grid":
                grid_merge = crit.merge_rate
            else:
                vs_bfs = max(vs_bfs, crit.makespan / reports["bfs"].makespan)
                vs_most = max(vs_most, crit.makespan / reports["most_children"].makespan)
    rms = round_ms(10_000)
    loop_rate = refs.python_rate()
    print(f"reference (same run): python_loop_per_s={loop_rate:.0f}")
    print(
        record(
            "scheduler",
            f"merge_rate={grid_merge:.2f} critical_vs_lower_bound={worst_bound:.3f} critical_vs_bfs={vs_bfs:.3f} "
            f"critical_vs_most_children={vs_most:.3f} round_ms_10k={rms:.1f} "
            f"round_10k_x_loop_rate={rms * loop_rate / 1000:.0f}",
        )
    )


if __name__ == "__main__":
    main()
