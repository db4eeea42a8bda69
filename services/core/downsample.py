"""Thinning a learning curve for display: pure, no I/O.

``downsample`` keeps at most ``max_points`` of a curve's points, evenly spaced by index, always with
the first and the last (where a curve starts and where it has got to), in step order. A curve drawn
from the kept points looks like the whole one at screen resolution; the dashboard asks for as many
points per curve as it has pixels for, so a study of thousands of trials stays light to draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from stagetree.core.errors import InvalidArgument

T = TypeVar("T")


def downsample(points: Sequence[T], max_points: int) -> list[T]:
    """At most ``max_points`` of ``points`` (0: all of them), evenly spaced, first and last kept."""
    if max_points < 0:
        raise InvalidArgument(f"max_points must be >= 0 (0: no limit), got {max_points}")
    n = len(points)
    if max_points == 0 or n <= max_points:
        return list(points)
    if max_points == 1:
        return [points[-1]]
    last = n - 1
    picks = sorted({round(i * last / (max_points - 1)) for i in range(max_points)})
    return [points[i] for i in picks]


def share_budget(total: int, lengths: Sequence[int]) -> list[int]:
    """Per-curve ``max_points`` so that curves of ``lengths`` points keep about ``total`` in all (0: no
    limit): short curves keep all their points, the rest share what is left evenly (at least 2 each)."""
    if total < 0:
        raise InvalidArgument(f"total must be >= 0 (0: no limit), got {total}")
    if total == 0 or sum(lengths) <= total:
        return [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out = [0] * len(lengths)
    left, remaining = total, len(lengths)
    for i in order:
        fair = max(2, left // remaining)
        out[i] = 0 if lengths[i] <= fair else fair
        left -= min(lengths[i], fair)
        remaining -= 1
    return out
