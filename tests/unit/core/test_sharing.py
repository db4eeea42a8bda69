"""What sharing bought: unique steps of a plan tree and trial-by-trial steps, against brute force; the steps
and seconds of ended attempts, queueing kept apart from compute."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.lifecycle import AttemptTiming, BatchState
from stagetree.core.sharing import (
    EndedAttempt,
    SharingStats,
    WorkTotals,
    trial_by_trial_steps,
    unique_steps,
    work_of,
)


@st.composite
def trees_and_points(draw: st.DrawFn) -> tuple[dict[int, tuple[int | None, int]], list[tuple[int, int]]]:
    """A random plan tree (children start after their parent's start) and canonical points on it."""
    nodes: dict[int, tuple[int | None, int]] = {1: (None, 0)}
    for nid in range(2, draw(st.integers(1, 12)) + 1):
        parent = draw(st.integers(1, nid - 1))
        nodes[nid] = (parent, nodes[parent][1] + draw(st.integers(1, 20)))
    points = [
        (n, nodes[n][1] + draw(st.integers(0 if nodes[n][0] is None else 1, 30)))
        for n in draw(st.lists(st.sampled_from(sorted(nodes)), max_size=15))
    ]
    return nodes, points


def _brute(nodes: dict[int, tuple[int | None, int]], points: list[tuple[int, int]]) -> int:
    steps: set[tuple[int, int]] = set()  # (node, step index) trained
    for node, step in points:
        cur: int | None = node
        end = step
        while cur is not None:
            parent, start = nodes[cur]
            steps.update((cur, s) for s in range(start, end))
            cur, end = parent, start
    return len(steps)


@settings(max_examples=300, deadline=None)
@given(trees_and_points())
def test_unique_steps_counts_each_step_of_the_tree_once(case: tuple[dict[int, tuple[int | None, int]], list]) -> None:
    nodes, points = case
    assert unique_steps(nodes, points) == _brute(nodes, points)


def test_trial_by_trial_counts_a_trial_to_its_last_step() -> None:
    assert trial_by_trial_steps([("a", 10), ("a", 30), ("b", 10), ("", 5), ("", 5)]) == 30 + 10 + 5 + 5


def test_rates_and_savings() -> None:
    s = SharingStats({"DONE": 4}, steps_executed=20, unique_steps=20, trial_by_trial_steps=30, compute_seconds=10.0)
    assert s.merge_rate == 1.5 and s.saved_steps == 10 and s.saved_seconds == 5.0
    assert SharingStats({}, 0, 0, 0, 0.0).to_json()["merge_rate"] == 0.0


def _attempt(state: BatchState = BatchState.DONE, reached: int | None = None, **kw: object) -> EndedAttempt:
    fields: dict[str, object] = {
        "start": 10,
        "steps": 30,
        "dispatched_at": 100.0,
        "started_at": 140.0,
        "finished_at": 170.0,
    }
    fields.update(kw)
    return EndedAttempt(state, reached=reached, **fields)  # type: ignore[arg-type]


def test_an_attempt_trained_all_its_steps_when_done_else_up_to_the_furthest_step_reported() -> None:
    assert _attempt().trained == 30
    assert _attempt(BatchState.LOST, reached=25).trained == 15  # resumed later from a checkpoint at <= 25
    assert _attempt(BatchState.PREEMPTED, reached=99).trained == 30  # never past its end
    assert _attempt(BatchState.FAILED, reached=5).trained == 0  # nor before its start
    assert _attempt(BatchState.ABORTED).trained == 0  # nothing heard: nothing counted


def test_time_waiting_for_a_slot_is_queueing_never_compute() -> None:
    # dispatched at 100, handed to a worker at 130 (it waited for its slot), 4 s of start-up and 1 s of
    # checkpoint I/O, 20 s training: 30 s queued, 20 s compute, whatever the ends' clocks say
    timed = _attempt(timing=AttemptTiming(130.0, 4.0, 1.0, 20.0))
    assert work_of([timed]) == WorkTotals(30, 20.0, 30.0, 4.0, 1.0)
    # without the worker's measure: compute from its start to its end, queue from the dispatch to its start
    assert work_of([_attempt()]) == WorkTotals(30, 30.0, 40.0, 0.0, 0.0)
    # lost: its steps count, no seconds of compute (its end is when the master noticed); never started:
    # its whole life is queueing
    lost = _attempt(BatchState.LOST, reached=20)
    waited = _attempt(BatchState.ABORTED, started_at=None)
    assert work_of([timed, lost, waited]) == WorkTotals(40, 20.0, 30.0 + 40.0 + 70.0, 4.0, 1.0)
    # a node manager's clock behind the master's gives a negative wait: none
    assert work_of([_attempt(timing=AttemptTiming(90.0, 1.0, 0.0, 5.0))]).queue_seconds == 0.0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 1000),  # waited for its slot
            st.floats(0, 10),  # start-up
            st.floats(0, 10),  # checkpoint I/O
            st.floats(0, 100),  # training
        ),
        max_size=20,
    )
)
def test_compute_is_the_training_the_workers_measured_however_long_the_batches_queued(
    runs: list[tuple[float, float, float, float]],
) -> None:
    attempts = [
        _attempt(
            dispatched_at=0.0,
            started_at=wait,
            finished_at=wait + up + io + train,
            timing=AttemptTiming(wait, up, io, train),
        )
        for wait, up, io, train in runs
    ]
    got = work_of(attempts)
    assert abs(got.compute_seconds - sum(r[3] for r in runs)) < 1e-6
    assert abs(got.queue_seconds - sum(r[0] for r in runs)) < 1e-6
    total = sum(a.finished_at - a.dispatched_at for a in attempts)
    parts = got.compute_seconds + got.queue_seconds + got.startup_seconds + got.checkpoint_seconds
    assert abs(parts - total) < 1e-6  # every second of each attempt's life in exactly one part
