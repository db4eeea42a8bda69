"""What sharing bought: unique steps of a plan tree and trial-by-trial steps, against brute force."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.sharing import SharingStats, trial_by_trial_steps, unique_steps


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
