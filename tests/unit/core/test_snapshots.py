"""No step trained twice when trials arrive late: batches that leave a snapshot at every step they train
(the runtime's in-memory snapshots of a small model, written as one pack when the batch ends) let a trial
that branches inside an already-trained range resume at its branch point. Driven by the simulator, which
runs the real stage tree and scheduler."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.config import Config
from stagetree.core.sequences import Constant, Piecewise
from stagetree.core.simulator import Ask, Simulator
from stagetree.core.slots import Slot, keeps_snapshots_on


class LateGrid:
    """A grid whose trials arrive one by one: ``first`` at the start, then one more per result (as a
    sampler proposes the next trial when a slot's result comes back)."""

    def __init__(self, configs: list[Config], steps: list[int], first: int) -> None:
        self.asks = [Ask(i, c, s) for i, (c, s) in enumerate(zip(configs, steps, strict=True))]
        self.first = first
        self.next = 0

    def _take(self, n: int) -> list[Ask]:
        out = self.asks[self.next : self.next + n]
        self.next += len(out)
        return out

    def start(self) -> list[Ask]:
        return self._take(self.first)

    def on_result(self, tag: Any, step: int, metrics: dict[str, float]) -> list[Ask]:
        return self._take(1)


VALUES = (0.1, 0.05, 0.02)


@st.composite
def late_grids(draw: st.DrawFn) -> tuple[list[Config], list[int], int, int]:
    max_step = draw(st.integers(4, 16))
    n = draw(st.integers(2, 10))
    configs, steps = [], []
    for _ in range(n):
        cuts = sorted(draw(st.sets(st.integers(1, max_step - 1), max_size=3)))
        values = [draw(st.sampled_from(VALUES)) for _ in range(len(cuts) + 1)]
        lr = Piecewise([Constant(v) for v in values], cuts) if cuts else Constant(values[0])
        configs.append(Config.of({"lr": lr}))
        steps.append(draw(st.integers(1, max_step)))
    return configs, steps, draw(st.integers(1, 3)), draw(st.integers(1, 3))


def _sim(grid: tuple[list[Config], list[int], int, int], snapshots: bool) -> Any:
    configs, steps, first, workers = grid
    return Simulator(LateGrid(configs, steps, first), workers, snapshots=snapshots, boundaries=False).run()


@settings(max_examples=400, deadline=None)
@given(late_grids())
def test_with_snapshots_executed_steps_equal_unique_steps(grid: tuple[list[Config], list[int], int, int]) -> None:
    report = _sim(grid, snapshots=True)
    assert report.served == report.requests
    assert report.executed_steps == report.unique_steps
    assert report.duplicate_steps == 0


@settings(max_examples=300, deadline=None)
@given(late_grids())
def test_a_grid_with_fewer_values_than_the_probation_keeps_them_and_trains_each_step_once(
    grid: tuple[list[Config], list[int], int, int],
) -> None:
    configs, steps, first, workers = grid
    # three values per hyper-parameter: no four roots can all start with values of their own
    sim = Simulator(
        LateGrid(configs, steps, first), workers, snapshots=True, snapshot_probation_roots=4, boundaries=False
    )
    report = sim.run()
    assert report.executed_steps == report.unique_steps


def test_without_snapshots_a_late_branch_inside_a_trained_range_trains_its_prefix_again() -> None:
    a = Config.of({"lr": Constant(0.1)})
    b = Config.of({"lr": Piecewise([Constant(0.1), Constant(0.05)], [6])})  # branches off a at step 6
    grid = ([a, b], [10, 10], 1, 1)  # b arrives once a has trained to 10
    assert _sim(grid, snapshots=False).executed_steps == 10 + 10  # b starts from a fresh model
    with_snaps = _sim(grid, snapshots=True)
    assert with_snaps.executed_steps == with_snaps.unique_steps == 10 + 4  # b resumes at (a, 6)


def test_with_a_probation_a_plan_whose_trials_start_apart_keeps_none_until_one_branches() -> None:
    a, c = Config.of({"lr": Constant(0.1)}), Config.of({"lr": Constant(0.2)})
    b = Config.of({"lr": Piecewise([Constant(0.2), Constant(0.05)], [6])})  # branches off c at step 6
    d = Config.of({"lr": Piecewise([Constant(0.2), Constant(0.05), Constant(0.01)], [6, 8])})  # off b at 8

    def executed(probation: int) -> int:
        sim = Simulator(
            LateGrid([a, c, b, d], [10] * 4, 1), 1, snapshots=True, snapshot_probation_roots=probation, boundaries=False
        )
        return sim.run().executed_steps

    assert executed(0) == 10 + 10 + 4 + 2  # every batch keeps them: b resumes at (c, 6), d at (b, 8)
    assert executed(3) == 10 + 10 + 4 + 2  # fewer roots than the probation: the same
    # two roots that started apart: c keeps none, so b trains c's first 6 steps again; from b on the plan
    # has branched, so b keeps them and d resumes at (b, 8)
    assert executed(2) == 10 + 10 + (6 + 4) + 2


def test_with_a_probation_a_plan_whose_starting_values_repeat_keeps_them() -> None:
    # three roots, none alike, but neither hyper-parameter tells them all apart (a grid's values repeat)
    roots = [
        Config.of({"lr": Constant(0.1), "m": Constant(0.9)}),
        Config.of({"lr": Constant(0.2), "m": Constant(0.9)}),
        Config.of({"lr": Constant(0.1), "m": Constant(0.8)}),
    ]
    late = Config.of({"lr": Piecewise([Constant(0.1), Constant(0.05)], [6]), "m": Constant(0.8)})  # off the third
    grid = LateGrid([*roots, late], [10] * 4, 1)
    sim = Simulator(grid, 1, snapshots=True, snapshot_probation_roots=2, boundaries=False)
    assert sim.run().executed_steps == 3 * 10 + 4  # the late trial resumes at step 6 of the third root


def test_a_batch_keeps_snapshots_on_one_cpu_slot_only() -> None:
    assert keeps_snapshots_on([Slot("w0")])
    assert not keeps_snapshots_on([Slot("g0", gpu_type="A100")])  # a copy per step waits for the device
    assert not keeps_snapshots_on([Slot("w0"), Slot("w1")])  # several ranks: rank 0 saves alone
    a = Config.of({"lr": Constant(0.1)})
    b = Config.of({"lr": Piecewise([Constant(0.1), Constant(0.05)], [6])})  # branches off a at step 6
    gpus = [Slot("g0", gpu_type="A100")]
    sim = Simulator(LateGrid([a, b], [10, 10], 1), gpus, snapshots=True, boundaries=False)
    assert sim.run().executed_steps == 10 + 10  # on a GPU, b trains a's first 6 steps again
