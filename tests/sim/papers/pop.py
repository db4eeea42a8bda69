"""HyperDrive's CIFAR-10 study (§6.2, Fig. 7), as a workload of the simulator: 100 trials on 4 machines.

A trial is one configuration's validation accuracy after every epoch (one step each) and its epoch
duration (``Trace``). The study's ``search`` policy decides: POP, or the baselines ``default`` (every
trial to its last epoch), ``bandit`` and ``earlyterm``; each reported epoch is one of the policy's
epochs, and every tenth an evaluation boundary. A kill cancels the trial's request; a suspension
preempts its batch (the epoch in flight is finished and a checkpoint saved, ``suspend_s``) and the
trial waits for a slot again, resuming from that checkpoint (``resume_s``). The figure is the time at
which any trial first reports the target accuracy.

``cifar_like_traces`` generates workloads shaped like HyperDrive's CIFAR-10 study (Fig. 1, 2c): 100
random configurations of at most 120 epochs of about a minute each, a third of them never leaving the
10% of random guessing, most of the rest plateauing well below the target, a handful reaching it, and
curves that cross (slow starters overtaking fast ones).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from stagetree.core.config import Config
from stagetree.core.policies.study import parse_policies
from stagetree.core.simulator import Ask, SimReport, Simulator
from stagetree.core.slots import Slot
from tests.sim.papers import index_of


@dataclass(frozen=True)
class Trace:
    id: str
    epoch_s: float
    values: tuple[float, ...]  # the metric after epochs 1..len(values)

    @property
    def max_epochs(self) -> int:
        return len(self.values)


def cifar_like_traces(
    n: int = 100,
    max_epochs: int = 120,
    seed: int = 0,
    non_learning: float = 0.32,
    noise: float = 0.01,
) -> list[Trace]:
    """Validation-accuracy traces. Non-learners stay near 0.10 (random guessing on 10 classes). Learners
    follow the usual two-phase CNN curve, a fast rise over the first epochs then a slow creep:
    ``0.1 + (F - 0.1) (1 - w exp(-e / tau1) - (1 - w) exp(-e / tau2))`` towards a final accuracy ``F``
    whose distribution puts a few percent of all configurations above 0.77; a small ``w`` with a high
    ``F`` is a slow starter that overtakes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        epoch_s = rng.uniform(40.0, 90.0)
        if rng.random() < non_learning:
            vals = [0.1 + rng.gauss(0.0, noise) for _ in range(max_epochs)]
        else:
            final = 0.12 + 0.70 * rng.betavariate(1.6, 1.4)
            w = rng.uniform(0.4, 0.9)
            tau1 = rng.uniform(1.5, 6.0)
            tau2 = math.exp(rng.uniform(math.log(15.0), math.log(60.0)))
            vals = [
                0.1
                + (final - 0.1) * (1.0 - w * math.exp(-e / tau1) - (1.0 - w) * math.exp(-e / tau2))
                + rng.gauss(0.0, noise)
                for e in range(1, max_epochs + 1)
            ]
        out.append(Trace(f"c{i:03d}", epoch_s, tuple(min(max(v, 0.0), 1.0) for v in vals)))
    return out


def trial_index(config: Config) -> int:
    return index_of(config, "trial")


@dataclass(frozen=True)
class TraceWorkload:
    """Epoch ``step`` of trial ``config["trial"]`` takes its trace's epoch time and reports its accuracy."""

    traces: Sequence[Trace]

    def step_s(self, config: Config, step: int, slots: int, gpu_type: str) -> float:
        return self.traces[trial_index(config)].epoch_s

    def metrics(self, config: Config, step: int) -> dict[str, float]:
        values = self.traces[trial_index(config)].values
        return {"accuracy": values[min(max(step, 1), len(values)) - 1]}


class AllTrials:
    """Every trial to its last epoch, submitted at once in trace order."""

    def __init__(self, traces: Sequence[Trace], study: str = "search", plan: str = "search") -> None:
        self.traces, self.study, self.plan = traces, study, plan

    def start(self) -> list[Ask]:
        return [
            Ask(t.id, Config.of({"trial": i}), t.max_epochs, self.study, self.plan) for i, t in enumerate(self.traces)
        ]

    def on_result(self, tag: object, step: int, metrics: dict[str, float]) -> list[Ask]:
        return []


def search_policies(
    name: str, target: float, t_max_s: float, kill_threshold: float, max_epochs: int, eval_every: int = 10
) -> dict[str, object]:
    """A study's ``policies`` for one of the search policies: a report every epoch, a boundary every
    ``eval_every``."""
    params = {
        "metric": "accuracy",
        "target": target,
        "t_max_s": t_max_s,
        "kill_threshold": kill_threshold,
        "max_epochs": max_epochs,
        "eval_every": eval_every,
        "report_every": 1,
    }
    return {"search": name, "search_params": params}


@dataclass(frozen=True)
class SearchRun:
    policy: str
    time_to_target: float  # math.inf when no trial reached it
    report: SimReport
    fed: dict[str, int]  # trial -> the epochs its study's policy was fed
    trained: dict[str, int]  # trial -> the epochs it trained

    @property
    def end(self) -> float:
        return self.report.makespan


def run_search(
    traces: Sequence[Trace],
    policy: str,
    machines: int,
    target: float,
    t_max_s: float = 24 * 3600.0,
    kill_threshold: float = 0.15,
    suspend_s: float = 1.0,
    resume_s: float = 1.0,
    eval_every: int = 10,
) -> SearchRun:
    """The traces under the search ``policy`` on ``machines`` machines, through the live scheduling round,
    until some trial reports ``target``."""
    max_epochs = max(t.max_epochs for t in traces)
    reached: list[float] = []

    def on_step(config: Config, step: int, t: float) -> None:
        if not reached and traces[trial_index(config)].values[step - 1] >= target:
            reached.append(t)

    sim = Simulator(
        AllTrials(traces),
        [Slot(f"m{i}", f"m{i}") for i in range(machines)],
        workload=TraceWorkload(traces),
        policies={
            "search": parse_policies(search_policies(policy, target, t_max_s, kill_threshold, max_epochs, eval_every))
        },
        load_s=resume_s,
        save_s=suspend_s,
        on_step=on_step,
        stop_when=lambda: bool(reached),
    )
    report = sim.run()
    node_trial = {n.id: traces[trial_index(n.config)].id for p in sim.plans.values() for n in p.plan.nodes.values()}
    fed = {node_trial[int(job.split(":")[1])]: n for job, n in sim.state.epochs.items()}
    trained: dict[str, int] = {}
    for _, node, a, b in sim.executed:
        trained[node_trial[node]] = trained.get(node_trial[node], 0) + b - a
    return SearchRun(policy, reached[0] if reached else math.inf, report, fed, trained)
