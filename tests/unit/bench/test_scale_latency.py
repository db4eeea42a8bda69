"""The scale bench's definition of a freed slot's wait: which waits count, and where they went."""

from __future__ import annotations

from tests.bench.scale import Sample, WorkForSlots, latency_stages, pending_then, wave_split

T0 = 1000.0


def _wave() -> tuple[list[tuple[object, ...]], list[tuple[object, ...]], list[tuple[float, float | None]]]:
    """Two slots end their first batch together at t0+10 with one request queued (submitted at t0+5); it
    goes to slot a 0.2 s later. Slot b gets work only when a tuner submits again, at t0+13."""
    intervals: list[tuple[object, ...]] = [
        ("nm", "a", T0 + 0.1, T0 + 10.0),
        ("nm", "b", T0 + 0.1, T0 + 10.0),
        ("nm", "a", T0 + 10.3, T0 + 20.0),
        ("nm", "b", T0 + 13.2, T0 + 23.0),
    ]
    # (node manager, slot, dispatched, sent, finished)
    attempts: list[tuple[object, ...]] = [
        ("nm", "a", T0 + 0.0, T0 + 0.05, T0 + 10.05),
        ("nm", "b", T0 + 0.0, T0 + 0.05, T0 + 10.05),
        ("nm", "a", T0 + 10.2, T0 + 10.25, T0 + 20.05),
        ("nm", "b", T0 + 13.1, T0 + 13.15, T0 + 23.05),
    ]
    # (submitted, first dispatched): the first two, the queued one, the tuner's late one
    waits: list[tuple[float, float | None]] = [(T0, T0), (T0, T0), (T0 + 5, T0 + 10.2), (T0 + 13, T0 + 13.1)]
    return intervals, attempts, waits


def test_a_slot_freed_with_no_request_left_for_it_waits_for_the_tuner_not_the_scheduler() -> None:
    intervals, attempts, waits = _wave()
    had_work = WorkForSlots(waits, intervals, attempts, slots=2, t0=T0)
    assert not had_work(T0 + 10.0)  # two slots idle, one request queued
    assert had_work(T0 + 5.5) is False  # nothing idle: no wait to count
    stages = latency_stages(intervals, attempts, had_work, t_end=T0 + 30)
    assert stages["total"] == []

    # with two requests queued, both freed slots had work: both waits count, split by stage
    waits.append((T0 + 6, T0 + 13.1))
    had_work = WorkForSlots(waits, intervals, attempts, slots=2, t0=T0)
    assert had_work(T0 + 10.0)
    stages = latency_stages(intervals, attempts, had_work, t_end=T0 + 30)
    assert sorted(round(x) for x in stages["total"]) == [300, 3200]
    assert sorted(round(x) for x in stages["round"]) == [150, 3050]


def test_the_looser_criterion_counts_every_slot_freed_while_anything_was_pending() -> None:
    intervals, attempts, _ = _wave()
    samples = [Sample(T0 + t, pending, 0, 0, 0.0) for t, pending in ((0, 0), (6, 1), (11, 0), (12, 1), (14, 0))]
    stages = latency_stages(intervals, attempts, pending_then(samples), t_end=T0 + 30)
    assert sorted(round(x) for x in stages["total"]) == [300, 3200]  # the tuner's 3 s counted against the scheduler


def test_a_slot_that_never_ran_is_idle_from_the_start() -> None:
    intervals: list[tuple[object, ...]] = [("nm", "a", T0 + 0.1, T0 + 5.0), ("nm", "a", T0 + 5.2, T0 + 9.0)]
    attempts: list[tuple[object, ...]] = [("nm", "a", T0, T0, T0 + 5.0), ("nm", "a", T0 + 5.1, T0 + 5.1, T0 + 9.0)]
    waits: list[tuple[float, float | None]] = [(T0, T0), (T0 + 4, T0 + 5.1)]
    # 3 slots, 2 never used: at t0+5 three are idle for one queued request
    assert not WorkForSlots(waits, intervals, attempts, slots=3, t0=T0)(T0 + 5.0)
    assert WorkForSlots(waits, intervals, attempts, slots=1, t0=T0)(T0 + 5.0)


def test_waits_are_split_at_the_end_of_the_start_wave() -> None:
    intervals, attempts, waits = _wave()
    waits.append((T0 + 6, T0 + 13.1))
    had_work = WorkForSlots(waits, intervals, attempts, slots=2, t0=T0)
    stages = latency_stages(intervals, attempts, had_work, t_end=T0 + 30)
    assert stages["ended"] == [T0 + 10.0, T0 + 10.0]  # one end time per counted wait
    line = wave_split(stages["ended"], stages["total"], until=T0 + 10.0)
    assert "start wave n=0" in line and "after n=2 p50=1750 p99=3200" in line
    line = wave_split(stages["ended"], stages["total"], until=T0 + 10.5)
    assert "start wave n=2" in line and "after n=0" in line
