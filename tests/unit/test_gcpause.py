"""``gcpause.gc_paused``: no automatic cyclic collection inside, the collector's previous state after."""

from __future__ import annotations

import gc

import pytest

from stagetree.gcpause import gc_paused


def _collections_while(make_garbage: bool) -> int:
    seen: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(count)
    try:
        with gc_paused():
            for _ in range(50_000 if make_garbage else 0):
                a: list[object] = []
                a.append(a)  # a cycle: only the collector frees it
            inside = len(seen)
    finally:
        gc.callbacks.remove(count)
    return inside


def test_no_collection_runs_inside_and_the_collector_is_back_after() -> None:
    assert gc.isenabled()
    assert _collections_while(make_garbage=True) == 0
    assert gc.isenabled()
    gc.collect()


def test_a_disabled_collector_stays_disabled_and_an_error_restores_the_state() -> None:
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
