"""Stage batches: the unit of work the master hands to a node manager, as plain data.

A batch loads the model at ``source`` (or initializes it when ``source.uri`` is None and the step is
0), then trains its stages back to back with no reload between them. It saves a checkpoint at every
point in ``saves`` (central checkpoints at branch points and at its end) and evaluates at every point
in ``evals`` (where requests wait). It samples the step metrics its trainer reports (the learning
curve) every ``curve_every_steps`` steps and at most ``curve_max_per_s`` points a second once its first
``CURVE_BURST`` points are kept (0: no limit; ``curve_every_steps`` 0: no curve), as its studies'
``CurveSampling`` asks. ``slots`` is how
many slots of one node manager the batch trains on, one worker process each, as one
``torch.distributed`` group (data parallel; 1: a plain worker). With ``snapshot_budget_bytes`` > 0 the
worker also keeps an in-memory snapshot of the model at every step it trains (of a trainer that can be
snapshotted, on one CPU rank), at most that many bytes (beyond it, every k-th step), and writes them as one
pack when the batch ends, so a trial that arrives later and branches inside this range resumes at its
branch point instead of training the prefix again. The JSON form is what travels in the assignment
stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stagetree.core.config import Config, FixedPart
from stagetree.core.errors import InvalidArgument


class Point(NamedTuple):
    """The model after ``step`` training steps along search-plan node ``node``'s path."""

    node: int
    step: int


MAX_CURVE_EVERY_STEPS = 10_000_000
MAX_CURVE_RATE = 1_000_000.0
# Curve points a batch keeps before ``curve_max_per_s`` applies: a short request keeps every step it asked
# for, however fast its steps; a long batch of fast steps settles to the rate.
CURVE_BURST = 200


class CurveRate:
    """A token bucket over a batch's curve points: up to ``burst`` at once, refilled at ``per_s`` points a
    second (``per_s`` 0: no limit). ``take(now)`` says whether a point ending at ``now`` is kept."""

    __slots__ = ("_at", "_burst", "_per_s", "_tokens")

    def __init__(self, per_s: float, burst: int | None = None) -> None:
        self._per_s = per_s
        self._burst = float(CURVE_BURST if burst is None else burst)
        self._tokens, self._at = self._burst, float("nan")

    def take(self, now: float) -> bool:
        if self._per_s <= 0:
            return True
        if now > self._at:  # False while _at is nan: the first point finds the bucket full
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._per_s)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


@dataclass(frozen=True)
class CurveSampling:
    """How a study wants its learning curves sampled: a point every ``every_steps`` steps (0: no curve)
    and at most ``max_per_s`` points a second per batch (0: no limit)."""

    every_steps: int = 1
    max_per_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.every_steps, bool) or not isinstance(self.every_steps, int):
            raise InvalidArgument(f"curve_every_steps: must be an integer, got {self.every_steps!r}")
        if not 0 <= self.every_steps <= MAX_CURVE_EVERY_STEPS:
            raise InvalidArgument(
                f"curve_every_steps: must be in [0, {MAX_CURVE_EVERY_STEPS}] (0: no curve), got {self.every_steps}"
            )
        rate = self.max_per_s
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= MAX_CURVE_RATE:
            raise InvalidArgument(
                f"curve_max_per_s: must be a number in [0, {MAX_CURVE_RATE:g}] (0: no limit), got {rate!r}"
            )

    @staticmethod
    def finest(samplings: Iterable[CurveSampling]) -> CurveSampling:
        """One sampling that keeps every point each of ``samplings`` asks for (a batch can serve several
        studies): steps at the gcd of the positive ``every_steps`` (none positive: no curve), and the
        highest rate (any 0: no limit). None given: the default."""
        got = list(samplings)
        if not got:
            return CurveSampling()
        every = 0
        for c in got:
            every = math.gcd(every, c.every_steps)
        rates = [c.max_per_s for c in got if c.every_steps > 0]
        rate = 0.0 if not rates or 0 in rates else max(rates)
        return CurveSampling(every, float(rate))


@dataclass(frozen=True)
class StageSpec:
    node: int
    start: int
    end: int
    config: Config

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "start": self.start, "end": self.end, "config": self.config.to_json()}

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> StageSpec:
        return cls(int(o["node"]), int(o["start"]), int(o["end"]), Config.from_json(o["config"]))


@dataclass(frozen=True)
class Source:
    """Where a batch starts: a checkpoint (uri) at a point, or a fresh model (uri None, step 0)."""

    point: Point
    uri: str | None = None


@dataclass(frozen=True)
class BatchSpec:
    batch_id: int
    attempt: int
    plan_key: str
    fixed: FixedPart
    source: Source
    stages: tuple[StageSpec, ...]
    saves: frozenset[Point] = frozenset()
    evals: frozenset[Point] = frozenset()
    gpus: int = 1
    peripheral_every_steps: int = 0
    peripheral_every_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    curve_every_steps: int = 1
    curve_max_per_s: float = 0.0
    slots: int = 1
    snapshot_budget_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.stages:
            raise InvalidArgument("a batch needs at least one stage")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise InvalidArgument(f"batch {self.batch_id}: slots must be an integer >= 1, got {self.slots!r}")
        prev_end = self.source.point.step
        for s in self.stages:
            if s.start != prev_end or s.end < s.start:
                raise InvalidArgument(f"batch {self.batch_id}: stages must be consecutive, got {s.start}..{s.end}")
            prev_end = s.end
        if self.curve_every_steps < 0 or not self.curve_max_per_s >= 0:
            raise InvalidArgument(
                f"batch {self.batch_id}: curve_every_steps and curve_max_per_s must be >= 0, got "
                f"{self.curve_every_steps}, {self.curve_max_per_s}"
            )

    @property
    def start_step(self) -> int:
        return self.stages[0].start

    @property
    def end(self) -> Point:
        last = self.stages[-1]
        return Point(last.node, last.end)

    @property
    def steps(self) -> int:
        return sum(s.end - s.start for s in self.stages)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batch_id": self.batch_id,
            "attempt": self.attempt,
            "plan_key": self.plan_key,
            "fixed": self.fixed.to_json(),
            "source": {
                "node": self.source.point.node,
                "step": self.source.point.step,
                "uri": self.source.uri,
            },
            "stages": [s.to_json() for s in self.stages],
            "saves": sorted([list(p) for p in self.saves]),
            "evals": sorted([list(p) for p in self.evals]),
            "gpus": self.gpus,
            "peripheral_every_steps": self.peripheral_every_steps,
            "peripheral_every_s": self.peripheral_every_s,
            "extra": self.extra,
            "curve_every_steps": self.curve_every_steps,
            "curve_max_per_s": self.curve_max_per_s,
        }
        if self.slots != 1:  # absent for a one-slot batch: its spec reads as before
            out["slots"] = self.slots
        if self.snapshot_budget_bytes:
            out["snapshot_budget_bytes"] = self.snapshot_budget_bytes
        return out

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> BatchSpec:
        try:
            src = o["source"]
            return cls(
                batch_id=int(o["batch_id"]),
                attempt=int(o["attempt"]),
                plan_key=str(o["plan_key"]),
                fixed=FixedPart.from_json(o["fixed"]),
                source=Source(Point(int(src["node"]), int(src["step"])), src.get("uri")),
                stages=tuple(StageSpec.from_json(s) for s in o["stages"]),
                saves=frozenset(Point(int(a), int(b)) for a, b in o.get("saves", [])),
                evals=frozenset(Point(int(a), int(b)) for a, b in o.get("evals", [])),
                gpus=int(o.get("gpus", 1)),
                peripheral_every_steps=int(o.get("peripheral_every_steps", 0)),
                peripheral_every_s=float(o.get("peripheral_every_s", 0.0)),
                extra=dict(o.get("extra", {})),
                curve_every_steps=int(o.get("curve_every_steps", 1)),
                curve_max_per_s=float(o.get("curve_max_per_s", 0.0)),
                slots=int(o.get("slots", 1)),
                snapshot_budget_bytes=int(o.get("snapshot_budget_bytes", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"malformed batch spec: {e!r}") from None
