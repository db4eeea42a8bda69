"""Hyper-parameter sequences: a value as a function of the training step.

A sequence (``Constant``, ``Linear``, ``Exponential``, ``Step``, ``MultiStep``, ``Cosine``, ``CyclicLR``,
``Warmup``, ``Piecewise``) lowers to its *canonical segments*: a tuple of ``Segment(start, end, kind,
params)`` in absolute steps, the last one open-ended (``end is None``). Each segment is an elementary
function of the local step ``u = step - start`` (parameters are re-based at every segment start), so

* two sequences that are the same function have the same segments (degenerate cases collapse to
  ``const``, continuations merge, floats keep 12 significant digits), hence hash equal;
* two sequences agree on steps [0, k) exactly when their segments covering [0, k) agree in
  ``(start, kind, params)``: ``MultiStep(0.1, [100], 0.5)`` and ``Constant(0.1)`` share [0, 100).

Every value and parameter is a finite number (or a string or bool): a schedule whose canonical form or a
value the master computes while placing it (a one-step piece, ``MultiStep``'s ``init * gamma**i``, a
warm-up's slope) would be past a float's range is refused with a ``SequenceError`` whose message holds
``OVERFLOW``; a value read at a step past that range is refused the same way.

``params[0]`` is the value type: ``"float"``, ``"int"`` (values rounded to the nearest int),
``"str"`` or ``"bool"`` (categorical, constants only).

Segment kinds (u = step - start):

==========  ================================  ==============================================
kind        params after the type             value at u
==========  ================================  ==============================================
const       v                                 v
linear      a, b                              a + b*u
exp         a, g                              a * g**u
step        a, size, g                        a * g**(u // size)
cosine      hi, lo, period, mult              cosine from hi to lo over each period; the
                                              period is multiplied by ``mult`` at each restart
cyclic      lo, hi, up, down                  triangle: lo -> hi in ``up`` steps, back in ``down``
==========  ================================  ==============================================
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

from stagetree.core.errors import SequenceError

Value: TypeAlias = float | int | str | bool
Params: TypeAlias = tuple[Any, ...]

SIGNIFICANT_DIGITS = 12
_PERIODIC_KINDS = frozenset({"cosine", "cyclic", "step"})
KINDS = frozenset({"const", "linear", "exp", "step", "cosine", "cyclic"})
DTYPES = frozenset({"float", "int", "str", "bool"})
# in the message of every refusal of a value past a float's range (the REST fuzz counts these apart)
OVERFLOW = "is past a float's range"
_FLOAT_MAX_EXP = 1024  # 2**1024 is past the largest float


class Segment(NamedTuple):
    """One elementary piece of a sequence, valid on [start, end) (``end=None``: forever)."""

    start: int
    end: int | None
    kind: str
    params: Params

    def to_json(self) -> list[Any]:
        return [self.start, self.end, self.kind, list(self.params)]


Segments: TypeAlias = tuple[Segment, ...]


def canon_float(x: float) -> float:
    """Round to a fixed number of significant digits so equal schedules compare and hash equal."""
    y = float(f"{x:.{SIGNIFICANT_DIGITS}g}")
    return 0.0 if y == 0.0 else y


# ---------------------------------------------------------------------------------------------
# Evaluation of one segment


def _pow(g: float | int, n: int) -> float | int:
    """``g ** n``; an int ``g`` (exact) whose power is past a float's range is an ``OverflowError``, as a
    float's is, rather than a number of ``n`` bits (``10 ** 2**62`` would never finish)."""
    if isinstance(g, int) and abs(g) > 1 and n * (abs(g).bit_length() - 1) > _FLOAT_MAX_EXP:
        raise OverflowError(f"{g} ** {n}")
    return g**n


# warm restarts walked one by one to place a step (0.1 s on a loaded machine): T_mult 1.001 reaches 10**18 in 35,000
MAX_RESTARTS = 100_000


def _cosine_place(u: int, period: float, mult: float) -> tuple[int, int]:
    """``(u within its cycle, the cycle's length)``: each restart multiplies the period by ``mult``. Once
    every later cycle has the same length (``mult`` 1, or length 1 with nothing to grow it) the rest is a
    remainder, so a step far out costs nothing; otherwise past ``MAX_RESTARTS`` restarts it is a
    ``SequenceError`` (a ``mult`` a hair from 1 over 10**12 steps would walk for hours)."""
    length = int(period)  # a whole number of steps (a segment's JSON may write it 5.0)
    restarts = 0
    while u >= length:
        u -= length
        period = period * mult
        length = max(1, round(period))
        if mult == 1 or (length == 1 and abs(mult) <= 1 and abs(period) < 1.5):
            return u % length, length
        restarts += 1
        if restarts > MAX_RESTARTS:
            raise SequenceError(
                "cosine",
                "gamma",
                f"{mult!r} needs more than {MAX_RESTARTS} warm restarts to place this step; "
                "use 1, or a gamma further from 1",
            )
    return u, length


def _raw(kind: str, p: Params, u: int) -> Any:
    if kind == "const":
        return p[1]
    if kind == "linear":
        return p[1] + p[2] * u
    if kind == "exp":
        return p[1] * _pow(p[2], u)
    if kind == "step":
        return p[1] * _pow(p[3], u // p[2])
    if kind == "cosine":
        hi, lo, period, mult = p[1], p[2], p[3], p[4]
        u, length = _cosine_place(u, period, mult)
        return lo + (hi - lo) * (1.0 + math.cos(math.pi * u / length)) / 2.0
    if kind == "cyclic":
        lo, hi, up, down = p[1], p[2], p[3], p[4]
        v = u % (up + down)
        if v < up:
            return lo + (hi - lo) * v / up
        return hi - (hi - lo) * (v - up) / down
    raise SequenceError("segment", "kind", f"unknown kind {kind!r}; known: {sorted(KINDS)}")


def segment_value(seg: Segment, step: int) -> Value:
    """The segment's value at ``step``; ``SequenceError`` (``OVERFLOW``) where it is past a float's range."""
    dtype = seg.params[0]
    try:
        v = _raw(seg.kind, seg.params, step - seg.start)
        if dtype == "int":
            return int(round(v))  # noqa: RUF046 - v may be a float
        if dtype == "float":
            out = float(v)
            if not math.isfinite(out):  # float arithmetic overflows to inf (or nan: inf - inf) silently
                raise OverflowError(out)
            return out
    except (OverflowError, ValueError):  # int(round(nan)) is a ValueError
        raise SequenceError(
            seg.kind, f"value at step {step}", f"{OVERFLOW}: keep the schedule's values finite"
        ) from None
    raw: Value = v
    return raw


def value_at(segments: Segments, step: int) -> Value:
    """The value of a canonical sequence at ``step`` (>= 0)."""
    if step < 0:
        raise SequenceError("sequence", "step", f"must be >= 0, got {step}")
    i = bisect.bisect_right([s.start for s in segments], step) - 1
    return segment_value(segments[i], step)


# ---------------------------------------------------------------------------------------------
# Validation helpers


def _num(family: str, field: str, x: Any, *, positive: bool = False, nonneg: bool = False) -> float | int:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise SequenceError(family, field, f"must be a number, got {x!r}")
    if isinstance(x, float) and not math.isfinite(x):
        raise SequenceError(family, field, f"must be finite, got {x!r}")
    if positive and x <= 0:
        raise SequenceError(family, field, f"must be > 0, got {x!r}")
    if nonneg and x < 0:
        raise SequenceError(family, field, f"must be >= 0, got {x!r}")
    return x


def _steps(family: str, field: str, x: Any, *, minimum: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        if isinstance(x, float) and x.is_integer():
            x = int(x)
        else:
            raise SequenceError(family, field, f"must be a whole number of steps, got {x!r}")
    n: int = x
    if n < minimum:
        raise SequenceError(family, field, f"must be >= {minimum}, got {n}")
    return n


def _dtype_of(x: Any) -> str:
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int"
    if isinstance(x, float):
        return "float"
    return "str"


def _cf(dtype: str, x: float | int) -> float | int:
    """Canonical numeric parameter; int-typed sequences keep exact ints where they are ints."""
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    y = canon_float(float(x))
    return y


# ---------------------------------------------------------------------------------------------
# Normal form


def _degenerate(seg: Segment) -> Segment:
    """Collapse constant-valued elementary functions to ``const``."""
    k, p = seg.kind, seg.params
    d = p[0]
    if k == "linear" and p[2] == 0:
        return seg._replace(kind="const", params=(d, _const_val(d, p[1])))
    if k == "exp" and (p[2] == 1 or p[1] == 0):
        return seg._replace(kind="const", params=(d, _const_val(d, p[1])))
    if k == "step" and (p[3] == 1 or p[1] == 0):
        return seg._replace(kind="const", params=(d, _const_val(d, p[1])))
    if k in ("cosine", "cyclic") and p[1] == p[2]:
        return seg._replace(kind="const", params=(d, _const_val(d, p[1])))
    if seg.end is not None and seg.end - seg.start == 1 and k != "const":
        # A one-step piece is a constant: same values, and a unique normal form.
        return seg._replace(kind="const", params=(d, _const_val(d, segment_value(seg, seg.start))))
    return seg


def _const_val(dtype: str, v: Any) -> Any:
    if dtype == "int":
        return round(v)
    if dtype == "float":
        return canon_float(float(v))
    return v


def _continues(a: Segment, b: Segment) -> bool:
    """True when ``b`` is the same elementary function as ``a``, carried on past ``a.end``."""
    if a.kind != b.kind or a.params[0] != b.params[0] or a.end is None:
        return False
    try:
        return _carries_on(a, b)
    except OverflowError:  # a's value at its end is past a float's range: no finite b starts there
        return False


def _carries_on(a: Segment, b: Segment) -> bool:
    assert a.end is not None
    n = a.end - a.start
    pa, pb = a.params, b.params
    if a.kind == "const":
        return bool(pa == pb)
    if a.kind == "linear":
        return pa[2] == pb[2] and canon_float(pa[1] + pa[2] * n) == canon_float(pb[1])
    if a.kind == "exp":
        return pa[2] == pb[2] and canon_float(pa[1] * _pow(pa[2], n)) == canon_float(pb[1])
    if a.kind == "step":
        return (
            pa[2:] == pb[2:] and n % pa[2] == 0 and canon_float(pa[1] * _pow(pa[3], n // pa[2])) == canon_float(pb[1])
        )
    return False


def normalize(segments: Iterable[Segment]) -> Segments:
    """The unique normal form: no empty pieces, degenerate pieces as const, continuations merged."""
    out: list[Segment] = []
    for seg in segments:
        if seg.end is not None and seg.end <= seg.start:
            continue
        seg = _degenerate(seg)
        if out and _continues(out[-1], seg):
            prev = out.pop()
            seg = prev._replace(end=seg.end)
        out.append(seg)
    if not out or out[0].start != 0 or out[-1].end is not None:
        raise SequenceError("sequence", "segments", "must cover [0, forever) without gaps")
    for a, b in itertools.pairwise(out):
        if a.end != b.start:
            raise SequenceError("sequence", "segments", f"gap or overlap at step {a.end}")
    for seg in out:
        for x in seg.params[1:]:
            if isinstance(x, float) and not math.isfinite(x):  # an inf or nan computed from finite input
                raise SequenceError(
                    "sequence", f"segment at step {seg.start}", f"a {seg.kind} parameter {OVERFLOW}: keep it finite"
                )
    return tuple(out)


def shift(segments: Segments, offset: int, until: int | None = None) -> list[Segment]:
    """Move a sequence to start at ``offset`` (its local step 0), cut at ``until``."""
    out: list[Segment] = []
    for s in segments:
        start = s.start + offset
        end = None if s.end is None else s.end + offset
        if until is not None:
            if start >= until:
                break
            end = until if end is None else min(end, until)
        out.append(Segment(start, end, s.kind, s.params))
    return out


# ---------------------------------------------------------------------------------------------
# Families


class Sequence(ABC):
    """A hyper-parameter value per step. Equality and hashing follow the canonical segments."""

    family: str = "sequence"

    @abstractmethod
    def _raw_segments(self) -> list[Segment]: ...

    @abstractmethod
    def to_json(self) -> dict[str, Any]: ...

    def segments(self) -> Segments:
        cached = self.__dict__.get("_segments")
        if cached is None:
            try:
                raw = self._raw_segments()
            except OverflowError:  # MultiStep's init * gamma**i, a warm-up's slope from an int past a float
                raise SequenceError(self.family, "value", f"{OVERFLOW}: keep the schedule's values finite") from None
            cached = normalize(raw)
            object.__setattr__(self, "_segments", cached)
        return cached  # type: ignore[no-any-return]

    def value(self, step: int) -> Value:
        return value_at(self.segments(), step)

    def values(self, start: int, stop: int) -> list[Value]:
        return [self.value(t) for t in range(start, stop)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return self.segments() == other.segments()

    def __hash__(self) -> int:
        return hash(self.segments())

    def __repr__(self) -> str:
        """The printed form (``stagetree.core.seqforms``): the call of the family that builds it, e.g.
        ``Warmup(0.02, 5, then=Exponential(0.2, 0.98))``, a constant as its value; equal schedules print
        the same, however they were written."""
        from stagetree.core.seqforms import to_text  # it builds families from this module

        return to_text(self)

    __str__ = __repr__


@dataclass(frozen=True, eq=False, repr=False)
class Constant(Sequence):
    value_: Value

    family = "constant"

    def __init__(self, value: Value) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise SequenceError("Constant", "value", f"must be finite, got {value!r}")
        if not isinstance(value, int | float | str | bool):
            raise SequenceError("Constant", "value", f"must be a number, string or bool, got {value!r}")
        object.__setattr__(self, "value_", value)

    def _raw_segments(self) -> list[Segment]:
        d = _dtype_of(self.value_)
        return [Segment(0, None, "const", (d, _const_val(d, self.value_)))]

    def to_json(self) -> dict[str, Any]:
        return {"kind": "constant", "value": self.value_}


@dataclass(frozen=True, eq=False, repr=False)
class Linear(Sequence):
    """``init + slope * step``."""

    init: float | int
    slope: float

    family = "linear"

    def __post_init__(self) -> None:
        _num("Linear", "init", self.init)
        _num("Linear", "slope", self.slope)

    def _raw_segments(self) -> list[Segment]:
        d = _dtype_of(self.init)
        return [Segment(0, None, "linear", (d, _cf(d, self.init), canon_float(self.slope)))]

    def to_json(self) -> dict[str, Any]:
        return {"kind": "linear", "init": self.init, "slope": self.slope}


@dataclass(frozen=True, eq=False, repr=False)
class Exponential(Sequence):
    """``init * gamma ** step``."""

    init: float | int
    gamma: float

    family = "exponential"

    def __post_init__(self) -> None:
        _num("Exponential", "init", self.init)
        _num("Exponential", "gamma", self.gamma, positive=True)

    def _raw_segments(self) -> list[Segment]:
        d = _dtype_of(self.init)
        return [Segment(0, None, "exp", (d, _cf(d, self.init), canon_float(self.gamma)))]

    def to_json(self) -> dict[str, Any]:
        return {"kind": "exponential", "init": self.init, "gamma": self.gamma}


@dataclass(frozen=True, eq=False, repr=False)
class Step(Sequence):
    """``init * gamma ** (step // step_size)`` (PyTorch's StepLR)."""

    init: float | int
    step_size: int
    gamma: float

    family = "step"

    def __post_init__(self) -> None:
        _num("Step", "init", self.init)
        object.__setattr__(self, "step_size", _steps("Step", "step_size", self.step_size))
        _num("Step", "gamma", self.gamma, positive=True)

    def _raw_segments(self) -> list[Segment]:
        d = _dtype_of(self.init)
        p = (d, _cf(d, self.init), self.step_size, canon_float(self.gamma))
        return [Segment(0, None, "step", p)]

    def to_json(self) -> dict[str, Any]:
        return {"kind": "step", "init": self.init, "step_size": self.step_size, "gamma": self.gamma}


@dataclass(frozen=True, eq=False, repr=False)
class MultiStep(Sequence):
    """``init``, multiplied by ``gamma`` at each milestone (PyTorch's MultiStepLR)."""

    init: float | int
    milestones: tuple[int, ...]
    gamma: float

    family = "multistep"

    def __init__(self, init: float | int, milestones: Iterable[int], gamma: float) -> None:
        _num("MultiStep", "init", init)
        _num("MultiStep", "gamma", gamma, positive=True)
        ms = list(milestones) if not isinstance(milestones, str) else None
        if ms is None:
            raise SequenceError("MultiStep", "milestones", "must be a list of steps")
        checked = tuple(_steps("MultiStep", f"milestones[{i}]", m) for i, m in enumerate(ms))
        for i in range(1, len(checked)):
            if checked[i] <= checked[i - 1]:
                raise SequenceError(
                    "MultiStep", f"milestones[{i}]", f"must be strictly increasing, got {list(checked)}"
                )
        object.__setattr__(self, "init", init)
        object.__setattr__(self, "milestones", checked)
        object.__setattr__(self, "gamma", gamma)

    def _raw_segments(self) -> list[Segment]:
        d = _dtype_of(self.init)
        bounds = [0, *self.milestones]
        out = []
        for i, start in enumerate(bounds):
            end = bounds[i + 1] if i + 1 < len(bounds) else None
            out.append(Segment(start, end, "const", (d, _const_val(d, self.init * self.gamma**i))))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "multistep",
            "init": self.init,
            "milestones": list(self.milestones),
            "gamma": self.gamma,
        }


@dataclass(frozen=True, eq=False, repr=False)
class Cosine(Sequence):
    """Cosine annealing from ``init`` to ``min_value`` over ``period`` steps, then a warm restart;
    each restart multiplies the period by ``gamma`` (SGDR's T_mult)."""

    init: float
    min_value: float
    period: int
    gamma: float = 1.0

    family = "cosine"

    def __post_init__(self) -> None:
        _num("Cosine", "init", self.init)
        _num("Cosine", "min_value", self.min_value)
        object.__setattr__(self, "period", _steps("Cosine", "period", self.period))
        _num("Cosine", "gamma", self.gamma, positive=True)

    def _raw_segments(self) -> list[Segment]:
        p = (
            "float",
            canon_float(self.init),
            canon_float(self.min_value),
            self.period,
            canon_float(self.gamma),
        )
        return [Segment(0, None, "cosine", p)]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "cosine",
            "init": self.init,
            "min_value": self.min_value,
            "period": self.period,
            "gamma": self.gamma,
        }


@dataclass(frozen=True, eq=False, repr=False)
class CyclicLR(Sequence):
    """Triangular cycles: ``init`` up to ``max_value`` in ``period_up`` steps, back in ``period_down``."""

    init: float
    max_value: float
    period_up: int
    period_down: int

    family = "cyclic"

    def __post_init__(self) -> None:
        _num("CyclicLR", "init", self.init)
        _num("CyclicLR", "max_value", self.max_value)
        object.__setattr__(self, "period_up", _steps("CyclicLR", "period_up", self.period_up))
        object.__setattr__(self, "period_down", _steps("CyclicLR", "period_down", self.period_down))

    def _raw_segments(self) -> list[Segment]:
        p = ("float", canon_float(self.init), canon_float(self.max_value), self.period_up, self.period_down)
        return [Segment(0, None, "cyclic", p)]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "cyclic",
            "init": self.init,
            "max_value": self.max_value,
            "period_up": self.period_up,
            "period_down": self.period_down,
        }


@dataclass(frozen=True, eq=False, repr=False)
class Warmup(Sequence):
    """Linear from ``init`` to ``then``'s first value over ``period`` steps, then ``then`` (which starts
    its own step 0 at step ``period``). ``period=0`` is no warm-up: the schedule is ``then`` itself (the
    same segments, so such a trial shares its whole path with ``then``'s), which lets a search space draw
    the warm-up's length from a range that includes none."""

    init: float | int
    period: int
    then: Sequence

    family = "warmup"

    def __post_init__(self) -> None:
        _num("Warmup", "init", self.init)
        object.__setattr__(self, "period", _steps("Warmup", "period", self.period, minimum=0))
        object.__setattr__(self, "then", as_sequence(self.then, field="Warmup.then"))
        if _dtype_of(self.then.value(0)) in ("str", "bool"):
            raise SequenceError("Warmup", "then", "must be numeric")

    def _raw_segments(self) -> list[Segment]:
        if self.period == 0:
            return list(self.then.segments())
        target = self.then.value(0)
        d = "int" if _dtype_of(self.init) == "int" and _dtype_of(target) == "int" else "float"
        slope = canon_float((float(target) - float(self.init)) / self.period)
        ramp = Segment(0, self.period, "linear", (d, _cf(d, self.init), slope))
        return [ramp, *shift(self.then.segments(), self.period)]

    def to_json(self) -> dict[str, Any]:
        return {"kind": "warmup", "init": self.init, "period": self.period, "then": self.then.to_json()}


@dataclass(frozen=True, eq=False, repr=False)
class Piecewise(Sequence):
    """Concatenation: ``pieces[0]`` on [0, boundaries[0]), ``pieces[1]`` from ``boundaries[0]`` (starting
    its own step 0 there), ...; the last piece runs forever."""

    pieces: tuple[Sequence, ...]
    boundaries: tuple[int, ...]

    family = "piecewise"

    def __init__(self, pieces: Iterable[Any], boundaries: Iterable[int]) -> None:
        ps = tuple(as_sequence(p, field=f"Piecewise.pieces[{i}]") for i, p in enumerate(pieces))
        bs = tuple(_steps("Piecewise", f"boundaries[{i}]", b) for i, b in enumerate(boundaries))
        if len(ps) != len(bs) + 1:
            raise SequenceError(
                "Piecewise",
                "boundaries",
                f"need one boundary fewer than pieces ({len(ps)} pieces, {len(bs)})",
            )
        for i in range(1, len(bs)):
            if bs[i] <= bs[i - 1]:
                raise SequenceError("Piecewise", f"boundaries[{i}]", f"must be strictly increasing, got {list(bs)}")
        object.__setattr__(self, "pieces", ps)
        object.__setattr__(self, "boundaries", bs)

    def _raw_segments(self) -> list[Segment]:
        starts = [0, *self.boundaries]
        out: list[Segment] = []
        for i, piece in enumerate(self.pieces):
            until = starts[i + 1] if i + 1 < len(starts) else None
            out.extend(shift(piece.segments(), starts[i], until))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "piecewise",
            "pieces": [p.to_json() for p in self.pieces],
            "boundaries": list(self.boundaries),
        }


class _FromSegments(Sequence):
    """A sequence given directly by canonical segments (what the search plan stores)."""

    family = "segments"

    def __init__(self, segments: Segments) -> None:
        object.__setattr__(self, "_segments", normalize(segments))

    def _raw_segments(self) -> list[Segment]:  # pragma: no cover - segments are given
        return list(self.segments())

    def to_json(self) -> dict[str, Any]:
        return {"kind": "segments", "segments": [s.to_json() for s in self.segments()]}


# ---------------------------------------------------------------------------------------------
# JSON


_FAMILIES: dict[str, Any] = {
    "constant": lambda o: Constant(_req(o, "constant", "value")),
    "linear": lambda o: Linear(_req(o, "linear", "init"), _req(o, "linear", "slope")),
    "exponential": lambda o: Exponential(_req(o, "exponential", "init"), _req(o, "exponential", "gamma")),
    "step": lambda o: Step(_req(o, "step", "init"), _req(o, "step", "step_size"), _req(o, "step", "gamma")),
    "multistep": lambda o: MultiStep(
        _req(o, "multistep", "init"), _list(o, "multistep", "milestones"), _req(o, "multistep", "gamma")
    ),
    "cosine": lambda o: Cosine(
        _req(o, "cosine", "init"),
        _req(o, "cosine", "min_value"),
        _req(o, "cosine", "period"),
        o.get("gamma", 1.0),
    ),
    "cyclic": lambda o: CyclicLR(
        _req(o, "cyclic", "init"),
        _req(o, "cyclic", "max_value"),
        _req(o, "cyclic", "period_up"),
        _req(o, "cyclic", "period_down"),
    ),
    "warmup": lambda o: Warmup(
        _req(o, "warmup", "init"), _req(o, "warmup", "period"), from_json(_req(o, "warmup", "then"))
    ),
    "piecewise": lambda o: Piecewise(
        [from_json(p) for p in _list(o, "piecewise", "pieces")], _list(o, "piecewise", "boundaries")
    ),
    "segments": lambda o: _FromSegments(segments_from_json(_list(o, "segments", "segments"))),
}


# the fields each family's JSON object may have besides "kind" (what its to_json writes)
_FIELDS: dict[str, frozenset[str]] = {
    "constant": frozenset({"value"}),
    "linear": frozenset({"init", "slope"}),
    "exponential": frozenset({"init", "gamma"}),
    "step": frozenset({"init", "step_size", "gamma"}),
    "multistep": frozenset({"init", "milestones", "gamma"}),
    "cosine": frozenset({"init", "min_value", "period", "gamma"}),
    "cyclic": frozenset({"init", "max_value", "period_up", "period_down"}),
    "warmup": frozenset({"init", "period", "then"}),
    "piecewise": frozenset({"pieces", "boundaries"}),
    "segments": frozenset({"segments"}),
}


def _req(o: Mapping[str, Any], family: str, field: str) -> Any:
    if field not in o:
        raise SequenceError(family, field, "is required")
    return o[field]


def _list(o: Mapping[str, Any], family: str, field: str) -> list[Any]:
    v = _req(o, family, field)
    if not isinstance(v, list | tuple):
        raise SequenceError(family, field, f"must be a list, got {v!r}")
    return list(v)


def from_json(obj: Any) -> Sequence:
    """A sequence from its JSON form (``{"kind": "multistep", ...}``); a plain value is a Constant."""
    if isinstance(obj, Mapping):
        kind = obj.get("kind")
        if not isinstance(kind, str) or kind not in _FAMILIES:
            raise SequenceError("sequence", "kind", f"unknown kind {kind!r}; known: {sorted(_FAMILIES)}")
        factory = _FAMILIES[kind]
        unknown = sorted(str(k) for k in obj if k != "kind" and k not in _FIELDS[kind])
        if unknown:  # a misspelt field would otherwise be dropped silently ("gama": the default gamma)
            raise SequenceError(
                kind, unknown[0], f"is not a field of {kind}; its fields: {', '.join(sorted(_FIELDS[kind]))}"
            )
        result: Sequence = factory(obj)
        return result
    if isinstance(obj, int | float | str | bool):
        return Constant(obj)
    raise SequenceError("sequence", "value", f"must be a value or a {{'kind': ...}} object, got {obj!r}")


def as_sequence(obj: Any, field: str = "value") -> Sequence:
    if isinstance(obj, Sequence):
        return obj
    try:
        return from_json(obj)
    except SequenceError as e:
        raise SequenceError(field, e.field, e.message.split(": ", 2)[-1]) from None


def segments_from_json(obj: Any) -> Segments:
    """Canonical segments from their JSON form, validated and normalized."""
    if not isinstance(obj, list | tuple) or not obj:
        raise SequenceError("segments", "segments", "must be a non-empty list")
    segs = []
    for i, item in enumerate(obj):
        f = f"segments[{i}]"
        if not isinstance(item, list | tuple) or len(item) != 4:
            raise SequenceError("segments", f, "must be [start, end, kind, params]")
        start, end, kind, params = item
        _steps("segments", f + ".start", start, minimum=0)
        if end is not None:
            _steps("segments", f + ".end", end, minimum=1)
        if not isinstance(kind, str) or kind not in KINDS:
            raise SequenceError("segments", f + ".kind", f"unknown kind {kind!r}; known: {sorted(KINDS)}")
        if (
            not isinstance(params, list | tuple)
            or not params
            or not isinstance(params[0], str)
            or params[0] not in DTYPES
        ):
            raise SequenceError("segments", f + ".params", f"must start with a type in {sorted(DTYPES)}")
        arity = {"const": 2, "linear": 3, "exp": 3, "step": 4, "cosine": 5, "cyclic": 5}[kind]
        if len(params) != arity:
            raise SequenceError("segments", f + ".params", f"{kind} takes {arity - 1} parameters")
        for j, x in enumerate(params[1:], 1):
            if kind == "const" and params[0] in ("str", "bool"):
                continue
            _num("segments", f"{f}.params[{j}]", x)
        if kind in _PERIODIC_KINDS and kind != "step":
            _steps("segments", f + ".params[3]", params[3])
        if kind == "cyclic":
            _steps("segments", f + ".params[4]", params[4])
        if kind == "step":
            _steps("segments", f + ".params[2]", params[2])
        # interned: a plan holds millions of these, and a parsed string is a new object each time
        typed = (sys.intern(params[0]), *params[1:])
        segs.append(Segment(int(start), None if end is None else int(end), sys.intern(str(kind)), typed))
    return normalize(segs)


def segments_to_json(segments: Segments) -> list[list[Any]]:
    return [s.to_json() for s in segments]


# ---------------------------------------------------------------------------------------------
# Comparing sequences


_START = operator.attrgetter("start")
LOOKAHEAD = 64  # steps compared value by value where two sequences' pieces differ


def first_divergence(a: Segments, b: Segments, start: int, limit: int) -> int:
    """The first step in [start, limit) where ``a`` and ``b`` may differ in value, or ``limit`` if none.

    Assumes they agree on [0, start). Equal pieces are skipped whole. Where the pieces differ (a cosine
    and an exponential that both start at 0.1), values are compared step by step, so the sequences
    diverge where their values first do, not where their pieces do; at most ``LOOKAHEAD`` steps are
    compared in all, and a search that runs out of them stops there (conservative: it can only cost
    sharing, never exactness). Values are equal when ``==`` and of the same type, as the runtime applies
    them (``1`` and ``1.0`` differ).
    """
    if a is b:
        return limit
    ia = _index(a, start)
    ib = _index(b, start)
    pos = start
    budget = LOOKAHEAD
    while pos < limit:
        sa, sb = a[ia], b[ib]
        ea, eb = sa.end, sb.end
        if ea is None:
            end = limit if eb is None else eb
        elif eb is None or ea < eb:
            end = ea
        else:
            end = eb
        if sa.start == sb.start and sa.kind == sb.kind and sa.params == sb.params:
            if ea is None and eb is None:
                return limit
            pos = end
        else:
            stop = min(end, limit, pos + budget)
            if sa.kind == "const" and sb.kind == "const":
                # a constant's value is the same at every step: one comparison stands for the range
                if pos < stop and _parted(sa, sb, pos):
                    return pos
            else:
                for s in range(pos, stop):
                    if _parted(sa, sb, s):
                        return s
            budget -= stop - pos
            pos = stop
            if pos < min(end, limit):  # out of look-ahead inside the differing pieces
                return pos
        if ea == pos:
            ia += 1
        if eb == pos:
            ib += 1
    return limit


def _parted(sa: Segment, sb: Segment, step: int) -> bool:
    """Whether the two pieces' values at ``step`` differ (in value or type; a value past a float's range
    compares with nothing)."""
    try:
        va, vb = segment_value(sa, step), segment_value(sb, step)
    except SequenceError:
        return True
    return va != vb or type(va) is not type(vb)


def _index(segs: Segments, step: int) -> int:
    """The index of the piece in force at ``step`` (the first one before any starts)."""
    if len(segs) == 1 or step < segs[1].start:
        return 0
    return bisect.bisect_right(segs, step, key=_START) - 1  # >= 1: segs[1] starts at or before step


def boundaries(segments: Segments, limit: int) -> list[int]:
    """Steps in (0, limit) where a new elementary piece starts (where setup() sees a change)."""
    return [s.start for s in segments if 0 < s.start < limit]
