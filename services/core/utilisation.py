"""How busy the slots were over time, from the intervals batch attempts ran on them.

``busy_history`` turns ``(slot, started, finished)`` intervals into the mean number of busy slots in
each of ``buckets`` equal spans of ``[t0, t1)``. A slot's intervals are merged first, so a batch sent
to a slot ahead of time (the lookahead: it starts the moment the slot frees) never counts the slot
twice; an interval still open (``finished`` None) runs to ``t1``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as disjoint, sorted intervals (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def busy_history(
    intervals: Iterable[tuple[Hashable, float, float | None]], t0: float, t1: float, buckets: int
) -> list[float]:
    """Mean busy slots per bucket of ``[t0, t1)`` (``buckets`` >= 1, ``t1`` > ``t0``)."""
    if buckets < 1 or not t1 > t0:
        raise ValueError(f"need buckets >= 1 and t1 > t0, got {buckets}, [{t0}, {t1})")
    per_slot: dict[Hashable, list[tuple[float, float]]] = {}
    for slot, a, b in intervals:
        end = t1 if b is None else b
        lo, hi = max(a, t0), min(end, t1)
        if hi > lo:
            per_slot.setdefault(slot, []).append((lo, hi))
    width = (t1 - t0) / buckets
    out = [0.0] * buckets
    for spans in per_slot.values():
        for a, b in merged(spans):
            first, last = int((a - t0) // width), min(buckets - 1, int((b - t0) // width))
            for k in range(first, last + 1):
                lo, hi = t0 + k * width, t0 + (k + 1) * width
                out[k] += max(0.0, min(b, hi) - max(a, lo)) / width
    return out
