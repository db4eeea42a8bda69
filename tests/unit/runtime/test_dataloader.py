"""The resumable loader: save + restore mid-run yields exactly the batches of a straight run."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.errors import InvalidArgument
from stagetree.nodemanager.runtime.dataloader import ResumableLoader

N = 53


def _loader(bs: int = 7, seed: int = 3, drop_last: bool = False) -> ResumableLoader:
    x = torch.arange(N, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(N)
    return ResumableLoader(x, y, batch_size=bs, seed=seed, drop_last=drop_last)


def _take(loader: ResumableLoader, n: int, bs_at: dict[int, int], offset: int = 0) -> list[list[int]]:
    out = []
    for i in range(offset, offset + n):
        if i in bs_at:
            loader.set_batch_size(bs_at[i])
        x, y = next(loader)
        assert torch.equal(x.squeeze(1).long(), y)  # rows stay aligned across tensors
        out.append(y.tolist())
    return out


def _roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_ten_plus_restore_plus_twenty_equals_thirty_across_batch_size_change() -> None:
    bs_at = {0: 7, 4: 11, 15: 5, 22: 16}  # changes before and after the save point
    straight = _take(_loader(), 30, bs_at)
    first = _loader()
    head = _take(first, 10, bs_at)
    state = _roundtrip(first.state_dict())
    torch.manual_seed(1234)  # the global RNG must not matter
    resumed = _loader(bs=1, seed=999)  # every field comes from the state
    resumed.load_state_dict(state)
    tail = _take(resumed, 20, bs_at, offset=10)
    assert head + tail == straight


def test_epochs_are_permutations_and_differ() -> None:
    loader = _loader(bs=10)
    epoch0 = [i for b in _take(loader, 6, {}) for i in b]  # 5 full batches + 3 rows
    assert sorted(epoch0) == list(range(N))
    assert loader.epoch == 0
    epoch1 = [i for b in _take(loader, 6, {}) for i in b]
    assert loader.epoch == 1
    assert sorted(epoch1) == list(range(N)) and epoch1 != epoch0


def test_drop_last_skips_the_short_tail() -> None:
    loader = _loader(bs=10, drop_last=True)
    sizes = [len(b) for b in _take(loader, 7, {})]
    assert sizes == [10] * 7
    assert loader.epoch == 1


def test_seed_decides_the_order() -> None:
    assert _take(_loader(seed=1), 3, {}) == _take(_loader(seed=1), 3, {})
    assert _take(_loader(seed=1), 3, {}) != _take(_loader(seed=2), 3, {})


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_batch_size_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        _loader().set_batch_size(bad)  # type: ignore[arg-type]


def test_state_for_another_dataset_is_refused() -> None:
    state = _loader().state_dict()
    other = ResumableLoader(torch.zeros(N + 1, 1), batch_size=4, seed=0)
    with pytest.raises(InvalidArgument, match="rows"):
        other.load_state_dict(state)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 20), min_size=1, max_size=8),
    change_every=st.integers(1, 9),
    save_at=st.integers(0, 40),
    total=st.integers(1, 40),
)
def test_resume_anywhere_is_exact(sizes: list[int], change_every: int, save_at: int, total: int) -> None:
    save_at = min(save_at, total)
    bs_at = {i * change_every: b for i, b in enumerate(sizes)}
    bs_at.setdefault(0, 4)
    straight = _take(_loader(), total, bs_at)
    first = _loader()
    head = _take(first, save_at, bs_at)
    resumed = _loader()
    resumed.load_state_dict(_roundtrip(first.state_dict()))
    assert head + _take(resumed, total - save_at, bs_at, offset=save_at) == straight
