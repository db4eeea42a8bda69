"""The tuned choices a schedule stands for, as plain features a plot or an estimator can take.

A tuner picks a schedule's family, its peak and its warmup; the search plan keeps only canonical
segments (``core.sequences``). ``features(segments, until)`` reads those choices back off the segments
a trial ran on ``[0, until)``: a constant is its value; anything else is its ``family`` (the kinds of
its pieces after a warmup: ``warmup+cosine``, ``step``, ``exponential``), its ``init``, ``peak`` and
``final`` values and its ``warmup`` length in steps (a rising linear first piece; 0 without one).
``study_features`` does it for every trial of a study over the study's horizon and keeps only what
varies between trials, so parallel coordinates, importance and slice plots show what was tuned, not
what was fixed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

from stagetree.core.sequences import Segment, Segments, segment_value

Feature = float | int | str | bool
_FAMILY_OF_KIND = {
    "const": "step",  # several constant pieces: a step schedule (MultiStep, Step with a few drops)
    "linear": "linear",
    "exp": "exponential",
    "step": "step",
    "cosine": "cosine",
    "cyclic": "cyclic",
}


def _in_range(segments: Segments, until: int) -> list[Segment]:
    return [s for s in segments if s.start < until]


def _last(seg: Segment, until: int) -> int:
    """The last step of ``seg`` before ``until``."""
    end = until if seg.end is None else min(seg.end, until)
    return max(seg.start, end - 1)


def _extremes(seg: Segment, until: int) -> list[Feature]:
    """Values at which ``seg`` reaches its extremes on ``[start, until)``: every kind is monotone between
    its start and its last step, except a cosine (highest at each restart, its start) and a cyclic one
    (highest at the top of its first rise)."""
    last = _last(seg, until)
    steps = {seg.start, last}
    if seg.kind == "cyclic":
        steps.add(min(last, seg.start + int(seg.params[3])))
    return [segment_value(seg, s) for s in sorted(steps)]


def _warmup(segs: list[Segment]) -> int:
    first = segs[0]
    if first.kind == "linear" and float(first.params[2]) > 0 and first.end is not None and len(segs) > 1:
        return first.end - first.start
    return 0


def _family(segs: list[Segment], warmup: int) -> str:
    body = segs[1:] if warmup else segs
    kinds: list[str] = []
    for s in body:
        name = _FAMILY_OF_KIND[s.kind]
        if not kinds or kinds[-1] != name:
            kinds.append(name)
    if all(b.kind == "const" for b in body) and len(body) == 1:
        kinds = ["constant"]
    return "+".join((["warmup"] if warmup else []) + kinds)


@functools.lru_cache(maxsize=65_536)
def is_constant(segments: Segments, until: int) -> bool:
    segs = _in_range(segments, max(1, until))
    return len(segs) == 1 and segs[0].kind == "const"


def features(segments: Segments, until: int, *, as_schedule: bool = False) -> dict[str, Feature]:
    """See ``_features``; a study's trials repeat each hyper-parameter's few schedules, each read once."""
    return dict(_features(segments, until, as_schedule))


@functools.lru_cache(maxsize=65_536)
def _features(segments: Segments, until: int, as_schedule: bool) -> dict[str, Feature]:
    """The choices the schedule ``segments`` stands for on ``[0, until)`` (``until`` >= 1): ``{"": v}`` for a
    constant (unless ``as_schedule``: then a numeric constant is a schedule of the family ``constant``,
    to compare with schedules that are not), else ``family``, ``init``, ``peak``, ``final`` and
    ``warmup``. Categorical values (strings, booleans) only ever form constants."""
    until = max(1, until)
    segs = _in_range(segments, until)
    if len(segs) == 1 and segs[0].kind == "const" and (not as_schedule or segs[0].params[0] in ("str", "bool")):
        return {"": segment_value(segs[0], 0)}
    values = [v for s in segs for v in _extremes(s, until)]
    numeric = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    warmup = _warmup(segs)
    out: dict[str, Feature] = {"family": _family(segs, warmup), "init": segment_value(segs[0], 0)}
    if numeric:
        last = segs[-1]
        out.update(peak=max(numeric), final=segment_value(last, _last(last, until)), warmup=warmup)
    return out


def study_features(
    trials: Mapping[str, Sequence[tuple[str, Segments]]], until: int
) -> tuple[list[str], dict[str, dict[str, Feature]]]:
    """``trials``: trial key -> its config's ``(name, segments)`` items; ``until``: the study's horizon
    (the furthest step it asked of any trial), so every trial is described over the same steps: what
    its tuner chose, not how far it got. A hyper-parameter constant in every trial is its value
    (``bs``); one that is a schedule in some is described as a schedule in all (``lr.peak``). Returns
    the features that vary between the trials, in name order, and each trial's values of them."""
    constant: dict[str, bool] = {}
    for items in trials.values():
        for name, segs in items:
            constant[name] = constant.get(name, True) and is_constant(segs, until)
    per: dict[str, dict[str, Feature]] = {}
    for key, items in trials.items():
        row: dict[str, Feature] = {}
        for name, segs in items:
            for f, v in features(segs, until, as_schedule=not constant[name]).items():
                row[f"{name}.{f}" if f else name] = v
        per[key] = row
    seen: dict[str, set[Feature]] = {}
    present: dict[str, int] = {}
    for row in per.values():
        for f, v in row.items():
            seen.setdefault(f, set()).add(v)
            present[f] = present.get(f, 0) + 1
    varying = sorted(f for f, vs in seen.items() if len(vs) > 1 or present[f] < len(per))
    keep = set(varying)
    return varying, {k: {f: v for f, v in row.items() if f in keep} for k, row in per.items()}
