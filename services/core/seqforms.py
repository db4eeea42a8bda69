"""The one printed form and the one JSON form of a schedule, wherever it is shown.

A schedule is stored as canonical segments (``sequences``); people read it as the family call that builds
it. This module owns the way between the two, so that a schedule reads the same in the SDK (fresh or
loaded from the master), the CLI, REST, the dashboard and an Optuna export:

* ``family_of(segments)``: the family that builds these segments (``Warmup(0.01, 5, then=Cosine(...))``,
  ``MultiStep``, ``Piecewise`` of families, ...), recovered from the segments alone and checked to give
  them back exactly. Equal schedules give the same family, whichever family they were written with:
  ``Piecewise([Linear(0.01, 0.018), Cosine(0.1, 0.001, 40)], [5])`` reads as the ``Warmup`` it equals.
* ``to_text(seq)``: that family as a call, a constant as its number (``0.05``, ``16``, ``'adam'``), also
  inside another family (``Warmup(0.01, 5, then=0.05)``); ``repr`` of every sequence is this text.
* ``parse_text(text)``: the sequence a printed form names (calls of the families and literals only;
  nothing is evaluated).
* ``to_family_json(seq)``: the ``{"kind": ...}`` form of that family, a constant as its number; what REST
  returns for a config.

Recovery tries, in order: one elementary piece as its family; a linear ramp into the rest as ``Warmup``;
constants in a geometric progression as ``MultiStep``; otherwise ``Piecewise`` of such pieces.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from stagetree.core.errors import SequenceError
from stagetree.core.sequences import (
    Constant,
    Cosine,
    CyclicLR,
    Exponential,
    Linear,
    MultiStep,
    Piecewise,
    Segment,
    Segments,
    Sequence,
    Step,
    Warmup,
    canon_float,
    from_json,
    segments_from_json,
    shift,
)

FAMILIES: dict[str, type[Sequence]] = {
    cls.__name__: cls for cls in (Constant, Linear, Exponential, Step, MultiStep, Cosine, CyclicLR, Warmup, Piecewise)
}
MAX_TEXT = 64 * 1024  # a printed schedule longer than this is not one a person wrote


# ---------------------------------------------------------------------------------------------
# Recovery


def _num(dtype: str, x: Any) -> Any:
    """A segment parameter as the family argument that reproduces it (float-typed pieces take floats)."""
    return float(x) if dtype == "float" and isinstance(x, int | float) and not isinstance(x, bool) else x


def _single(seg: Segment) -> Sequence | None:
    """The family of one elementary piece (its own step 0 at the piece's start)."""
    try:
        return _single_family(seg)
    except SequenceError:
        return None


def _single_family(seg: Segment) -> Sequence | None:
    d, p = seg.params[0], seg.params[1:]
    if seg.kind == "const":
        return Constant(_num(d, p[0]))
    if seg.kind == "linear":
        return Linear(_num(d, p[0]), float(p[1]))
    if seg.kind == "exp":
        return Exponential(_num(d, p[0]), float(p[1]))
    if seg.kind == "step":
        return Step(_num(d, p[0]), int(p[1]), float(p[2]))
    if seg.kind == "cosine" and d == "float":
        return Cosine(float(p[0]), float(p[1]), int(p[2]), float(p[3]))
    if seg.kind == "cyclic" and d == "float":
        return CyclicLR(float(p[0]), float(p[1]), int(p[2]), int(p[3]))
    return None


def _from_zero(segs: Segments | list[Segment]) -> list[Segment]:
    """``segs`` moved to start at step 0, the last one open-ended (a piece of a longer schedule)."""
    start = segs[0].start
    out = shift(tuple(segs), -start)
    return [*out[:-1], out[-1]._replace(end=None)]


def _same(seq: Sequence | None, segs: list[Segment]) -> bool:
    if seq is None:
        return False
    try:
        return seq.segments() == tuple(segs)
    except SequenceError:
        return False


def _multistep(segs: list[Segment]) -> Sequence | None:
    """Constants on [0, m1), [m1, m2), ... in a geometric progression, as ``MultiStep``."""
    d = segs[0].params[0]
    if any(s.kind != "const" or s.params[0] != d for s in segs) or d not in ("float", "int"):
        return None
    v0, v1 = segs[0].params[1], segs[1].params[1]
    try:
        if v0 == 0 or v1 / v0 <= 0:
            return None
        cand = MultiStep(_num(d, v0), [s.start for s in segs[1:]], canon_float(v1 / v0))
    except (SequenceError, OverflowError):  # an int ratio past a float's range is no MultiStep's gamma
        return None
    return cand if _same(cand, segs) else None


def _warmup(segs: list[Segment]) -> Sequence | None:
    """A linear ramp on [0, p) into whatever follows, as ``Warmup(init, p, then=...)``."""
    ramp = segs[0]
    if ramp.kind != "linear" or ramp.end is None or len(segs) < 2:
        return None
    then = _recover(_from_zero(segs[1:]))
    if then is None:
        return None
    try:
        cand = Warmup(_num(ramp.params[0], ramp.params[1]), ramp.end, then)
    except SequenceError:
        return None
    return cand if _same(cand, segs) else None


def _recover(segs: list[Segment]) -> Sequence | None:
    if len(segs) == 1:
        return _single(segs[0])
    found = _warmup(segs) or _multistep(segs)
    if found is not None:
        return found
    pieces: list[Sequence] = []
    bounds: list[int] = []
    i = 0
    while i < len(segs):
        piece, j = _piece_at(segs, i)
        if piece is None:
            return None
        if i:
            bounds.append(segs[i].start)
        pieces.append(piece)
        i = j
    try:
        cand = Piecewise(pieces, bounds)
    except SequenceError:
        return None
    return cand if _same(cand, segs) else None


def _piece_at(segs: list[Segment], i: int) -> tuple[Sequence | None, int]:
    """The longest family that starts at piece ``i`` of a ``Piecewise``, and where the next one starts."""
    if segs[i].kind == "linear" and i + 1 < len(segs):
        w = _warmup(_from_zero(segs[i:]))
        if w is not None:
            return w, len(segs)
    if segs[i].kind == "const":
        j = i
        while j < len(segs) and segs[j].kind == "const":
            j += 1
        for end in range(j, i + 1, -1):  # the longest geometric run of constants from i
            m = _multistep(_from_zero(segs[i:end]))
            if m is not None:
                return m, end
    return _single(_from_zero(segs[i : i + 1])[0]), i + 1


def family_of(segments: Segments | Sequence) -> Sequence:
    """The family that builds ``segments`` (or a sequence's segments), checked to give them back exactly;
    a schedule no family describes stays as its segments (printed ``Segments([...])``)."""
    segs = segments.segments() if isinstance(segments, Sequence) else tuple(segments)
    found = _recover(list(segs))
    if found is not None:
        return found
    return from_json({"kind": "segments", "segments": [s.to_json() for s in segs]})


# ---------------------------------------------------------------------------------------------
# Text


def _arg(v: Any) -> str:
    if isinstance(v, Sequence):
        return _text(v)
    if isinstance(v, tuple | list):
        return "[" + ", ".join(_arg(x) for x in v) + "]"
    return repr(v)


def _text(f: Sequence) -> str:
    """A recovered family as its call: required parameters by position (a nested schedule by name),
    optional ones only when they differ from their default; a constant as its value."""
    if isinstance(f, Constant):
        return repr(f.value_)
    if type(f).__name__ not in FAMILIES:
        return f"Segments({[s.to_json() for s in f.segments()]!r})"
    args = []
    for fd in fields(f):  # type: ignore[arg-type]
        v = getattr(f, fd.name)
        if fd.default is MISSING and fd.default_factory is MISSING:
            args.append(f"{fd.name}={_arg(v)}" if isinstance(v, Sequence) else _arg(v))
        elif v != fd.default:
            args.append(f"{fd.name}={_arg(v)}")
    return f"{type(f).__name__}({', '.join(args)})"


def to_text(seq: Sequence | Segments) -> str:
    """The printed form: ``Warmup(0.01, 5, then=Cosine(0.1, 0.001, 40))``; a constant as its number."""
    return _text(family_of(seq))


def config_text(config: Mapping[str, Any]) -> str:
    """A trial's hyper-parameters (name -> sequence, value, family JSON or segment list) as
    ``lr=Warmup(0.01, 5, then=Cosine(0.1, 0.001, 40)) momentum=0.9``, names sorted."""
    return " ".join(f"{name}={to_text(_as_segments(config[name]))}" for name in sorted(config))


def _as_segments(v: Any) -> Segments:
    if isinstance(v, Sequence):
        return v.segments()
    if isinstance(v, list):
        return segments_from_json(v)
    return from_json(v).segments()


_LITERALS = (int, float, str, bool)


def _eval(node: ast.AST, text: str) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, _LITERALS)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand, text)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.List | ast.Tuple):
        return [_eval(x, text) for x in node.elts]
    if isinstance(node, ast.Name) and node.id in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        args = [_eval(a, text) for a in node.args]
        kwargs = {k.arg: _eval(k.value, text) for k in node.keywords if k.arg is not None}
        if len(kwargs) != len(node.keywords):
            raise SequenceError("schedule", "text", f"**arguments are not part of a printed schedule: {text!r}")
        if name == "Segments" and len(args) == 1 and not kwargs:
            return from_json({"kind": "segments", "segments": args[0]})
        cls = FAMILIES.get(name)
        if cls is None:
            raise SequenceError("schedule", "text", f"unknown family {name!r}; known: {sorted(FAMILIES)}")
        try:
            return cls(*args, **kwargs)
        except TypeError as e:
            raise SequenceError("schedule", name, str(e)) from None
    raise SequenceError("schedule", "text", f"only family calls and literals can be read, not {ast.dump(node)[:80]}")


def parse_text(text: str) -> Sequence:
    """The sequence a printed form names: ``parse_text("Warmup(0.01, 5, then=Cosine(0.1, 0.001, 40))")``,
    ``parse_text("0.05")``. Reads family calls and literals; nothing else is run."""
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_TEXT:
        raise SequenceError("schedule", "text", f"must be a printed schedule of at most {MAX_TEXT} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise SequenceError("schedule", "text", f"not a printed schedule ({e.msg}): {text!r}") from None
    value = _eval(tree.body, text)
    if isinstance(value, Sequence):
        return value
    if isinstance(value, _LITERALS):
        return Constant(value)
    raise SequenceError("schedule", "text", f"not a schedule: {text!r}")


# ---------------------------------------------------------------------------------------------
# JSON


def _plain(obj: Any) -> Any:
    """A family's ``to_json`` with every nested constant as its value and defaults left out."""
    if isinstance(obj, dict):
        if obj.get("kind") == "constant":
            return obj["value"]
        out = {k: _plain(v) for k, v in obj.items()}
        if out.get("kind") == "cosine" and out.get("gamma") == 1.0:
            del out["gamma"]  # the default, left out as the printed form leaves it out
        return out
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def to_family_json(seq: Sequence | Segments) -> Any:
    """The ``{"kind": ...}`` form of the schedule's family (a constant as its number); ``from_json`` reads
    it back as an equal schedule."""
    return _plain(family_of(seq).to_json())


def config_family_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's hyper-parameters (as ``config_text`` takes them) in the family JSON form, by name."""
    return {name: to_family_json(_as_segments(config[name])) for name in sorted(config)}
