"""Trial configurations: the fixed part (which search plan) and the tuned sequences (where in it).

A trial config is the fixed part that must be equal for any sharing (trainer entry point, dataset,
model, seed, fixed hyper-parameter values) plus one sequence per tuned hyper-parameter. Its canonical
form, ``Config``, holds canonical segments sorted by name: hashable, JSON round-trip safe, and the
unit the search plan compares.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stagetree.core.errors import InvalidArgument, SequenceError
from stagetree.core.sequences import (
    Segments,
    Sequence,
    Value,
    as_sequence,
    first_divergence,
    segments_from_json,
    segments_to_json,
    value_at,
)

MAX_NAME_LEN = 128


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise InvalidArgument(f"{what}: must be a non-empty string of at most {MAX_NAME_LEN} characters, got {name!r}")
    return name


def _check_scalar(value: Any, what: str) -> Any:
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(f"{what}: must be finite, got {value!r}")
        return value
    raise InvalidArgument(f"{what}: must be a number, string, bool or null, got {type(value).__name__}")


@dataclass(frozen=True)
class FixedPart:
    """What must be equal for two trials to share anything: it names the search plan.

    ``code_version`` names the trainer's code (the SDK defaults it to a digest of the trainer's source):
    a change of it is a new plan, so no metric or checkpoint outlives the code that produced it.
    """

    trainer: str
    dataset: str = ""
    model: str = ""
    seed: int = 0
    values: Mapping[str, Any] = field(default_factory=dict)
    code_version: str = ""

    def __post_init__(self) -> None:
        _check_name(self.trainer, "fixed.trainer")
        if not isinstance(self.dataset, str) or not isinstance(self.model, str):
            raise InvalidArgument("fixed.dataset and fixed.model must be strings")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidArgument(f"fixed.seed: must be an int, got {self.seed!r}")
        if not isinstance(self.code_version, str) or len(self.code_version) > MAX_NAME_LEN:
            raise InvalidArgument(
                f"fixed.code_version: must be a string of at most {MAX_NAME_LEN} characters, got {self.code_version!r}"
            )
        vals = {}
        for k, v in dict(self.values).items():
            vals[_check_name(k, "fixed.values key")] = _check_scalar(v, f"fixed.values[{k!r}]")
        object.__setattr__(self, "values", dict(sorted(vals.items())))

    def to_json(self) -> dict[str, Any]:
        out = {
            "trainer": self.trainer,
            "dataset": self.dataset,
            "model": self.model,
            "seed": self.seed,
            "values": dict(self.values),
        }
        if self.code_version:  # absent when unversioned: the plan keys of earlier releases stay the same
            out["code_version"] = self.code_version
        return out

    @classmethod
    def from_json(cls, obj: Any) -> FixedPart:
        if not isinstance(obj, Mapping):
            raise InvalidArgument("fixed: must be an object with trainer, dataset, model, seed, values, code_version")
        unknown = set(obj) - _FIXED_FIELDS
        if unknown:
            raise InvalidArgument(f"fixed: unknown fields {sorted(unknown)}; known: {sorted(_FIXED_FIELDS)}")
        values = obj.get("values", {})
        if not isinstance(values, Mapping):
            raise InvalidArgument("fixed.values: must be an object")
        seed = obj.get("seed", 0)
        if isinstance(seed, float) and seed.is_integer():  # JSON's 5.0 is the integer 5
            seed = int(seed)
        return cls(
            trainer=obj.get("trainer"),  # type: ignore[arg-type]
            dataset=obj.get("dataset", ""),
            model=obj.get("model", ""),
            seed=seed,
            values=values,
            code_version=obj.get("code_version", ""),
        )

    def key(self, scope: str = "") -> str:
        """The plan key: equal fixed parts in one scope (an owner, or a team), and only they, share a
        search plan."""
        obj = self.to_json()
        if scope:
            obj["scope"] = scope
        blob = json.dumps(obj, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]


_FIXED_FIELDS = frozenset({"trainer", "dataset", "model", "seed", "values", "code_version"})


@dataclass(frozen=True)
class Config:
    """Canonical tuned part of a trial: ``((name, segments), ...)`` sorted by name."""

    items: tuple[tuple[str, Segments], ...]

    @classmethod
    def of(cls, hps: Mapping[str, Any]) -> Config:
        """From sequences, plain values or their JSON forms (a family object, or the canonical segment
        list ``[[start, end, kind, params], ...]`` that ``to_json`` and plan views give)."""
        if not isinstance(hps, Mapping) or not hps:
            raise InvalidArgument("config: must be a non-empty mapping of hyper-parameter name to sequence")
        items = []
        for name in sorted(hps):
            _check_name(name, "config key")
            value = hps[name]
            try:
                if isinstance(value, list):
                    items.append((name, segments_from_json(value)))
                    continue
                seq = as_sequence(value, field=name)
            except SequenceError as e:
                raise SequenceError(name, e.field, e.message.split(": ", 2)[-1]) from None
            items.append((name, seq.segments()))
        return cls(tuple(items))

    @classmethod
    def from_json(cls, obj: Any) -> Config:
        """From the canonical JSON form ``{"lr": [[start, end, kind, params], ...], ...}``."""
        if not isinstance(obj, Mapping) or not obj:
            raise InvalidArgument("config: must be a non-empty object")
        items = []
        for name in sorted(obj):
            _check_name(name, "config key")
            try:
                items.append((name, segments_from_json(obj[name])))
            except SequenceError as e:
                raise SequenceError(name, e.field, e.message.split(": ", 2)[-1]) from None
        return cls(tuple(items))

    def to_json(self) -> dict[str, Any]:
        return {name: segments_to_json(segs) for name, segs in self.items}

    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.items)

    def digest(self) -> str:
        blob = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def values_at(self, step: int) -> dict[str, Value]:
        return {name: value_at(segs, step) for name, segs in self.items}

    def changes_at(self, step: int) -> dict[str, Value]:
        """The hyper-parameters whose value at ``step`` differs from ``step - 1`` (all of them at 0)."""
        now = self.values_at(step)
        if step == 0:
            return now
        before = self.values_at(step - 1)
        return {k: v for k, v in now.items() if before[k] != v or type(before[k]) is not type(v)}

    def sequence(self, name: str) -> Sequence:
        """The hyper-parameter's schedule as the family that builds it (``seqforms.family_of``)."""
        from stagetree.core.seqforms import family_of  # it imports sequences, as this module does

        for n, segs in self.items:
            if n == name:
                return family_of(segs)
        raise InvalidArgument(f"config has no hyper-parameter {name!r}; it has {list(self.names())}")


def divergence(a: Config, b: Config, start: int, limit: int) -> int:
    """First step in [start, limit) where the two configs may differ, ``limit`` if none; assumes
    they agree on [0, start). Configs over different hyper-parameter names never agree."""
    if a is b or a.items is b.items:
        return limit
    if len(a.items) != len(b.items):
        return start
    first = limit
    for (na, sa), (nb, sb) in zip(a.items, b.items, strict=True):
        if na != nb:
            return start
        if sa is sb:
            continue
        first = first_divergence(sa, sb, start, first)
        if first == start:
            return start
    return first
