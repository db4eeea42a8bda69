"""Floats in policy snapshots as strict JSON: the non-finite ones (a diverged loss, ``-inf`` before a
trial's first value) as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, which ``float()``
reads back, the others as they are (``json`` writes a float so that it reads back exactly)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def enc(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def dec(x: Any) -> float:
    return float(x)


def encs(xs: Iterable[float]) -> list[float | str]:
    return [enc(x) for x in xs]


def decs(xs: Iterable[Any]) -> list[float]:
    return [float(x) for x in xs]
