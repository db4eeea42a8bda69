"""How much of a metric's spread each tuned choice accounts for: a simple, assumption-light estimator.

For each feature the trials are grouped (a categorical feature by its value; a numeric one by its value
when it takes few, else into equal-count bins by rank, so only the order of its values matters), and
the share of the metric's variance between the groups is estimated with epsilon squared, the
correlation ratio corrected for the number of groups (a feature with a group per trial explains
nothing by construction, not everything). Negative estimates are 0; the importances are then scaled
to sum to 1, as Optuna's importance plots show them. A feature alone (no interactions), which is what
an ANOVA of one factor can say; fANOVA's random forest would need a model fitted per page load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

Feature = float | int | str | bool
DEFAULT_BINS = 8


def _groups(xs: Sequence[Feature], bins: int) -> list[list[int]]:
    """Indices of ``xs`` grouped as the module doc says."""
    by_value: dict[Feature, list[int]] = {}
    for i, x in enumerate(xs):
        by_value.setdefault(x, []).append(i)
    numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x in xs)
    if not numeric or len(by_value) <= bins:
        return list(by_value.values())
    ordered = sorted(by_value.items(), key=lambda kv: float(kv[0]))
    size = len(xs) / bins
    out: list[list[int]] = [[]]
    for _, idx in ordered:  # equal values stay in one bin
        if len(out[-1]) >= size and len(out) < bins:
            out.append([])
        out[-1].extend(idx)
    return [g for g in out if g]


def epsilon_squared(xs: Sequence[Feature], ys: Sequence[float], bins: int = DEFAULT_BINS) -> float:
    """The share of the variance of ``ys`` between the groups of ``xs``, in [0, 1]."""
    n = len(ys)
    if n < 3:
        return 0.0
    mean = sum(ys) / n
    total = sum((y - mean) ** 2 for y in ys)
    groups = _groups(xs, bins)
    k = len(groups)
    if total <= 0 or k < 2 or n <= k:
        return 0.0
    between = sum(len(g) * (sum(ys[i] for i in g) / len(g) - mean) ** 2 for g in groups)
    within_ms = (total - between) / (n - k)
    est = (between - (k - 1) * within_ms) / (total + within_ms)
    return min(1.0, max(0.0, est))


def importance(
    rows: Sequence[Mapping[str, Feature]], ys: Sequence[float], bins: int = DEFAULT_BINS
) -> dict[str, float]:
    """Each feature's share of the importance (summing to 1, or all 0 when none explains anything),
    from the rows that have the feature and a finite metric."""
    if len(rows) != len(ys):
        raise ValueError(f"{len(rows)} rows but {len(ys)} metric values")
    names = sorted({f for r in rows for f in r})
    raw: dict[str, float] = {}
    for f in names:
        pairs = [(r[f], y) for r, y in zip(rows, ys, strict=True) if f in r and math.isfinite(y)]
        raw[f] = epsilon_squared([p[0] for p in pairs], [p[1] for p in pairs], bins)
    total = sum(raw.values())
    return {f: (v / total if total > 0 else 0.0) for f, v in raw.items()}
