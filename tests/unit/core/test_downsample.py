"""Thinning curves for display: at most the budget, first and last kept, order kept, evenly spread."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagetree.core.downsample import downsample, share_budget
from stagetree.core.errors import InvalidArgument


@given(st.lists(st.integers(), max_size=300), st.integers(0, 400))
def test_downsample_keeps_ends_order_and_budget(points: list[int], k: int) -> None:
    out = downsample(list(enumerate(points)), k)
    if k == 0 or len(points) <= k:
        assert out == list(enumerate(points))
        return
    assert 0 < len(out) <= k
    idx = [i for i, _ in out]
    assert idx == sorted(set(idx)) and idx[-1] == len(points) - 1
    if k > 1:
        assert idx[0] == 0 and len(out) == k


def test_downsample_is_even() -> None:
    assert downsample(list(range(1, 17)), 4) == [1, 6, 11, 16]
    with pytest.raises(InvalidArgument):
        downsample([1], -1)


@given(st.lists(st.integers(0, 500), max_size=50), st.integers(0, 3000))
def test_share_budget_keeps_short_curves_whole_and_the_total_near_the_budget(lengths: list[int], total: int) -> None:
    budgets = share_budget(total, lengths)
    kept = [n if b == 0 else min(n, b) for n, b in zip(lengths, budgets, strict=True)]
    if total == 0 or sum(lengths) <= total:
        assert kept == lengths
    else:
        assert sum(kept) <= max(total, 2 * len(lengths))
        assert all(b == 0 or b >= 2 for b in budgets)
