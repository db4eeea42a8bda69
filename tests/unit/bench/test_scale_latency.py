"""The scale bench's definition of a freed slot's wait: which waits count, and where they went."""

from __future__ import annotations

from tests.bench.scale import (
    Sample,
    WorkForSlots,
    ahead_split,
    latency_stages,
    occupancy_while_pending,
    pending_then,
    request_waits,
    wave_split,
)

T0 = 1000.0


def _wave() -> tuple[list[tuple[object, ...]], list[tuple[object, ...]], list[tuple[float, float | None]]]:
    """Two slots end their first batch together at t0+10 with one request queued (submitted at t0+5); it
    goes to slot a 0.2 s later. Slot b gets work only when a tuner submits again, at t0+13."""
    # (node manager, slot, start, end, batch, attempt)
    intervals: list[tuple[object, ...]] = [
        ("nm", "a", T0 + 0.1, T0 + 10.0, 1, 1),
        ("nm", "b", T0 + 0.1, T0 + 10.0, 2, 1),
        ("nm", "a", T0 + 10.3, T0 + 20.0, 3, 1),
        ("nm", "b", T0 + 13.2, T0 + 23.0, 4, 1),
    ]
    # (batch, attempt, dispatched, sent, finished)
    attempts: list[tuple[object, ...]] = [
        (1, 1, T0 + 0.0, T0 + 0.05, T0 + 10.05),
        (2, 1, T0 + 0.0, T0 + 0.05, T0 + 10.05),
        (3, 1, T0 + 10.2, T0 + 10.25, T0 + 20.05),
        (4, 1, T0 + 13.1, T0 + 13.15, T0 + 23.05),
    ]
    # (submitted, batch) -> (submitted, first started): the first two, the queued one, the tuner's late one
    waits = request_waits([(T0, 1), (T0, 2), (T0 + 5, 3), (T0 + 13, 4)], intervals)
    assert waits == [(T0, T0 + 0.1), (T0, T0 + 0.1), (T0 + 5, T0 + 10.3), (T0 + 13, T0 + 13.2)]
    return intervals, attempts, waits


def test_a_slot_freed_with_no_request_left_for_it_waits_for_the_tuner_not_the_scheduler() -> None:
    intervals, attempts, waits = _wave()
    had_work = WorkForSlots(waits, intervals, slots=2, t0=T0)
    assert not had_work(T0 + 10.0)  # two slots idle, one request queued
    assert had_work(T0 + 5.5) is False  # nothing idle: no wait to count
    stages = latency_stages(intervals, attempts, had_work, t_end=T0 + 30)
    assert stages["total"] == []

    # with two requests queued, both freed slots had work: both waits count, split by stage
    waits.append((T0 + 6, T0 + 13.2))
    had_work = WorkForSlots(waits, intervals, slots=2, t0=T0)
    assert had_work(T0 + 10.0)
    stages = latency_stages(intervals, attempts, had_work, t_end=T0 + 30)
    assert sorted(round(x) for x in stages["total"]) == [300, 3200]
    assert sorted(round(x) for x in stages["round"]) == [150, 3050]


def test_a_batch_sent_ahead_waits_for_its_slot_and_counts_as_waiting_until_it_starts() -> None:
    # batch 2 is dispatched to slot a at t0+8, while batch 1 still runs there; it starts when 1 ends
    intervals: list[tuple[object, ...]] = [("nm", "a", T0, T0 + 10.0, 1, 1), ("nm", "a", T0 + 10.01, T0 + 20, 2, 1)]
    attempts: list[tuple[object, ...]] = [(1, 1, T0, T0 + 0.05, T0 + 10.3), (2, 1, T0 + 8, T0 + 8.05, T0 + 20.3)]
    waits = request_waits([(T0, 1), (T0 + 7, 2)], intervals)
    had_work = WorkForSlots(waits, intervals, slots=1, t0=T0)
    assert had_work.waiting(T0 + 9) == 1  # dispatched, not started: still waiting
    assert had_work(T0 + 10.0)
    stages = latency_stages(intervals, attempts, had_work, t_end=T0 + 30)
    assert [round(x) for x in stages["total"]] == [10]
    assert [round(x) for x in stages["round"]] == [-2300]  # sent before the slot freed
    assert [round(x) for x in stages["start"]] == [1960]  # its wait for the slot
    assert stages["ahead"] == [1.0]
    assert "sent ahead n=1 p50=10 p99=10, sent after n=0" in ahead_split(stages["total"], stages["ahead"])
    # occupancy, sampled each second: the slot is idle only at t0+10 (for 10 ms), while batch 2 waits
    assert occupancy_while_pending(intervals, had_work.waiting, 1, T0, T0 + 20) == {"occupancy": 19 / 20}


def test_occupancy_counts_an_idle_slot_while_a_request_waits_anywhere() -> None:
    # slot b idles from t0+5 while a request sent ahead to slot a waits there until t0+10
    intervals: list[tuple[object, ...]] = [
        ("nm", "a", T0, T0 + 10.0, 1, 1),
        ("nm", "b", T0, T0 + 5.0, 2, 1),
        ("nm", "a", T0 + 10.0, T0 + 20.0, 3, 1),
    ]
    waits = request_waits([(T0, 1), (T0, 2), (T0 + 4, 3)], intervals)
    had_work = WorkForSlots(waits, intervals, slots=2, t0=T0)
    got = occupancy_while_pending(intervals, had_work.waiting, 2, T0, T0 + 10)["occupancy"]
    assert got == (5 * 2 + 5 * 1) / (10 * 2)


def test_the_looser_criterion_counts_every_slot_freed_while_anything_was_pending() -> None:
    intervals, attempts, _ = _wave()
    samples = [Sample(T0 + t, pending, 0, 0, 0.0) for t, pending in ((0, 0), (6, 1), (11, 0), (12, 1), (14, 0))]
    stages = latency_stages(intervals, attempts, pending_then(samples), t_end=T0 + 30)
    assert sorted(round(x) for x in stages["total"]) == [300, 3200]  # the tuner's 3 s counted against the scheduler


def test_a_slot_that_never_ran_is_idle_from_the_start() -> None:
    intervals: list[tuple[object, ...]] = [("nm", "a", T0 + 0.1, T0 + 5.0, 1, 1), ("nm", "a", T0 + 5.2, T0 + 9.0, 2, 1)]
    waits = request_waits([(T0, 1), (T0 + 4, 2)], intervals)
    # 3 slots, 2 never used: at t0+5 three are idle for one queued request
    assert not WorkForSlots(waits, intervals, slots=3, t0=T0)(T0 + 5.0)
    assert WorkForSlots(waits, intervals, slots=1, t0=T0)(T0 + 5.0)


def test_waits_are_split_at_the_end_of_the_start_wave() -> None:
    intervals, attempts, waits = _wave()
    waits.append((T0 + 6, T0 + 13.2))
    had_work = WorkForSlots(waits, intervals, slots=2, t0=T0)
    stages = latency_stages(intervals, attempts, had_work, t_end=T0 + 30)
    assert stages["ended"] == [T0 + 10.0, T0 + 10.0]  # one end time per counted wait
    line = wave_split(stages["ended"], stages["total"], until=T0 + 10.0)
    assert "start wave n=0" in line and "after n=2 p50=1750 p99=3200" in line
    line = wave_split(stages["ended"], stages["total"], until=T0 + 10.5)
    assert "start wave n=2" in line and "after n=0" in line
