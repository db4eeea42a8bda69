"""Search spaces: where trial configurations come from.

This module owns the two search spaces of the client SDK and the distributions a random space samples
from. A trial configuration is a ``dict[str, Sequence]``: one hyper-parameter sequence per name (plain
values become ``Constant``).

* ``GridSearchSpace({"lr": [Constant(0.1), Exponential(0.1, 0.95)], "bs": [128, MultiStep(128, [40], 2)]})``
  is the cartesian product of the lists (TreeML Fig. 5.2), names in sorted order, the last name varying
  fastest, values in list order. ``filter`` keeps only the combinations it accepts (conditional spaces);
  it sees the values as written (``{"lr": Constant(0.1), "bs": 128}``).
* ``RandomSearchSpace({"lr": Family(MultiStep, init=LogUniform(1e-3, 1e-1), milestones=Choice([[20], [30]]),
  gamma=0.1)}, seed=0)`` samples independent configurations. Configuration ``i`` depends only on
  ``(seed, i)``, so a space is reproducible and a tuner can ask for any index in any order.

Both implement ``SearchSpace``: ``size()`` (``None`` when unbounded) and ``config(index)``. Bad specs raise
``InvalidArgument`` (``SequenceError`` for sequence parameters) naming the hyper-parameter and the field.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import itertools
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from stagetree.core.errors import InvalidArgument, SequenceError
from stagetree.core.sequences import Sequence, as_sequence

TrialConfig: TypeAlias = dict[str, Sequence]
GridFilter: TypeAlias = Callable[[dict[str, Any]], bool]


class SearchSpace(Protocol):
    """Where a tuner draws trial configurations from."""

    def size(self) -> int | None:
        """How many distinct configurations there are; ``None`` when unbounded."""
        ...

    def config(self, index: int) -> TrialConfig:
        """Configuration number ``index`` (0-based); the same index gives the same configuration."""
        ...


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"search space: hyper-parameter names must be non-empty strings, got {name!r}")
    return name


def _check_index(index: Any, size: int | None) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise InvalidArgument(f"search space: index must be an int >= 0, got {index!r}")
    if size is not None and index >= size:
        raise InvalidArgument(f"search space: index {index} out of range; the space has {size} configurations")
    return index


def _to_sequence(name: str, value: Any) -> Sequence:
    try:
        return as_sequence(value, field=name)
    except SequenceError as e:
        raise SequenceError(name, e.field, e.message.split(": ", 2)[-1]) from None


# ---------------------------------------------------------------------------------------------
# Grid


class GridSearchSpace:
    """The cartesian product of per-name lists, optionally filtered; a finite, ordered space."""

    def __init__(self, values: Mapping[str, list[Any]], filter: GridFilter | None = None) -> None:
        if not isinstance(values, Mapping) or not values:
            raise InvalidArgument("GridSearchSpace: values must be a non-empty mapping of name to list of values")
        if filter is not None and not callable(filter):
            raise InvalidArgument(f"GridSearchSpace: filter must be callable or None, got {filter!r}")
        names = sorted(_check_name(n) for n in values)
        raw: list[list[Any]] = []
        seqs: list[list[Sequence]] = []
        for name in names:
            options = values[name]
            if not isinstance(options, list | tuple):
                raise InvalidArgument(
                    f"GridSearchSpace: {name}: must be a list of values or sequences, got {options!r}"
                )
            if not options:
                raise InvalidArgument(f"GridSearchSpace: {name}: must not be empty")
            converted = [_to_sequence(f"{name}[{i}]", v) for i, v in enumerate(options)]
            seen: dict[Sequence, int] = {}
            for i, s in enumerate(converted):
                if s in seen:
                    raise InvalidArgument(
                        f"GridSearchSpace: {name}[{i}]: duplicates {name}[{seen[s]}]; remove one of them"
                    )
                seen[s] = i
            raw.append(list(options))
            seqs.append(converted)
        self.names: tuple[str, ...] = tuple(names)
        self._configs: list[TrialConfig] = []
        for idx in itertools.product(*(range(len(r)) for r in raw)):
            if filter is not None:
                written = {n: raw[j][i] for j, (n, i) in enumerate(zip(names, idx, strict=True))}
                try:
                    keep = filter(written)
                except Exception as e:
                    raise InvalidArgument(f"GridSearchSpace: filter raised {e!r} on {written}") from e
                if not keep:
                    continue
            self._configs.append({n: seqs[j][i] for j, (n, i) in enumerate(zip(names, idx, strict=True))})
        if not self._configs:
            raise InvalidArgument("GridSearchSpace: the filter rejected every combination; relax it")

    def size(self) -> int:
        return len(self._configs)

    def config(self, index: int) -> TrialConfig:
        return dict(self._configs[_check_index(index, len(self._configs))])

    def __len__(self) -> int:
        return len(self._configs)

    def __iter__(self) -> Iterator[TrialConfig]:
        return (dict(c) for c in self._configs)


# ---------------------------------------------------------------------------------------------
# Distributions


class Distribution(ABC):
    """Something a random search space samples a value (or a sequence) from."""

    @abstractmethod
    def sample(self, rng: random.Random) -> Any: ...


def _finite(owner: str, field: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise InvalidArgument(f"{owner}: {field}: must be a finite number, got {x!r}")
    return float(x)


def _draw(value: Any, rng: random.Random) -> Any:
    return value.sample(rng) if isinstance(value, Distribution) else value


# what the ``Shared`` parameters of the configuration being drawn were drawn as (name -> value)
_SHARED: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("stagetree_shared", default=None)


@contextlib.contextmanager
def _one_configuration() -> Iterator[None]:
    """The draws inside are one configuration's: a ``Shared`` parameter is drawn once among them."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


@dataclass(frozen=True)
class Shared(Distribution):
    """One parameter drawn once per configuration wherever it appears: ``peak = Shared("peak",
    LogUniform(1e-3, 1e-1))`` used in several families (``Choice([Family(Cosine, init=peak, ...),
    Family(Exponential, init=peak, ...)])``) gives them the same value, and an Optuna study sees one
    parameter ``peak`` instead of one per family."""

    name: str
    dist: Any

    def __post_init__(self) -> None:
        _check_name(self.name)
        if isinstance(self.dist, Shared):
            raise InvalidArgument(f"Shared({self.name!r}): dist: a Shared parameter cannot wrap another")

    def sample(self, rng: random.Random) -> Any:
        drawn = _SHARED.get()
        if drawn is None:  # drawn alone, outside a configuration
            return _draw(self.dist, rng)
        if self.name not in drawn:
            drawn[self.name] = _draw(self.dist, rng)
        return drawn[self.name]


def check_shared(owner: str, specs: Iterable[Any]) -> None:
    """``Shared`` parameters of one name must draw from one distribution."""
    seen: dict[str, Any] = {}

    def walk(x: Any) -> None:
        if isinstance(x, Shared):
            if x.name in seen and seen[x.name] != x.dist:
                raise InvalidArgument(
                    f"{owner}: Shared({x.name!r}) draws from {seen[x.name]!r} in one place and {x.dist!r} in another"
                )
            seen[x.name] = x.dist
            walk(x.dist)
        elif isinstance(x, Choice):
            for o in x.options:
                walk(o)
        elif isinstance(x, Family):
            for v in x.params.values():
                walk(v)

    for spec in specs:
        walk(spec)


@dataclass(frozen=True)
class Choice(Distribution):
    """One of ``options``, uniformly; an option that is itself a distribution is sampled in turn.
    ``options`` may be a mapping of label to option (``Choice({"cosine": Family(Cosine, ...), ...})``):
    the labels name the options where a tool shows them (Optuna's categorical values and parameter names)."""

    options: tuple[Any, ...]
    labels: tuple[str, ...] | None = None

    def __init__(self, options: list[Any] | tuple[Any, ...] | Mapping[str, Any]) -> None:
        labels: tuple[str, ...] | None = None
        if isinstance(options, Mapping):
            labels = tuple(options)
            bad = [k for k in labels if not isinstance(k, str) or not k.strip()]
            if bad:
                raise InvalidArgument(f"Choice: labels: must be non-empty strings, got {bad!r}")
            options = tuple(options.values())
        if not isinstance(options, list | tuple) or not options:
            raise InvalidArgument(
                f"Choice: options: must be a non-empty list (or a mapping of label to option), got {options!r}"
            )
        object.__setattr__(self, "options", tuple(options))
        object.__setattr__(self, "labels", labels)

    def sample(self, rng: random.Random) -> Any:
        picked = self.options[rng.randrange(len(self.options))]
        if isinstance(picked, list):
            return list(picked)
        return _draw(picked, rng)


@dataclass(frozen=True)
class Uniform(Distribution):
    """A float uniform on [lo, hi)."""

    lo: float
    hi: float

    def __post_init__(self) -> None:
        lo = _finite("Uniform", "lo", self.lo)
        if _finite("Uniform", "hi", self.hi) <= lo:
            raise InvalidArgument(f"Uniform: hi: must be greater than lo={self.lo!r}, got {self.hi!r}")

    def sample(self, rng: random.Random) -> float:
        return self.lo + (self.hi - self.lo) * rng.random()


@dataclass(frozen=True)
class LogUniform(Distribution):
    """A float whose logarithm is uniform on [log lo, log hi); ``0 < lo < hi``."""

    lo: float
    hi: float

    def __post_init__(self) -> None:
        if _finite("LogUniform", "lo", self.lo) <= 0:
            raise InvalidArgument(f"LogUniform: lo: must be > 0, got {self.lo!r}")
        if _finite("LogUniform", "hi", self.hi) <= self.lo:
            raise InvalidArgument(f"LogUniform: hi: must be greater than lo={self.lo!r}, got {self.hi!r}")

    def sample(self, rng: random.Random) -> float:
        a, b = math.log(self.lo), math.log(self.hi)
        return math.exp(a + (b - a) * rng.random())


@dataclass(frozen=True)
class IntUniform(Distribution):
    """An int uniform on [lo, hi], both ends included."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        for field in ("lo", "hi"):
            x = getattr(self, field)
            if isinstance(x, bool) or not isinstance(x, int):
                raise InvalidArgument(f"IntUniform: {field}: must be an int, got {x!r}")
        if self.hi < self.lo:
            raise InvalidArgument(f"IntUniform: hi: must be >= lo={self.lo}, got {self.hi}")

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


class Family(Distribution):
    """A sequence of family ``cls`` whose parameters are sampled (distributions) or fixed (values).

    ``Family(Warmup, init=0.0, period=Choice([5, 10]), then=Family(Cosine, init=LogUniform(1e-3, 1e-1),
    min_value=0.0, period=100))`` samples a warm-up into a cosine schedule. Parameters are drawn in sorted
    name order, so the order they are written in does not change what a seed gives.
    """

    def __init__(self, cls: type[Sequence], /, **params: Any) -> None:
        if not isinstance(cls, type) or not issubclass(cls, Sequence) or inspect.isabstract(cls):
            raise InvalidArgument(f"Family: cls: must be a sequence family such as MultiStep, got {cls!r}")
        sig = inspect.signature(cls)
        accepted = [
            p.name
            for p in sig.parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        for name in params:
            if name not in accepted:
                raise InvalidArgument(f"Family({cls.__name__}): {name}: unknown parameter; it takes {accepted}")
        for p in sig.parameters.values():
            if p.name in accepted and p.default is inspect.Parameter.empty and p.name not in params:
                raise InvalidArgument(f"Family({cls.__name__}): {p.name}: is required")
        self.cls = cls
        self.params: dict[str, Any] = dict(sorted(params.items()))

    def sample(self, rng: random.Random) -> Sequence:
        drawn = {name: _draw(v, rng) for name, v in self.params.items()}
        try:
            return self.cls(**drawn)
        except SequenceError:
            raise
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"Family({self.cls.__name__}): {e} (drawn parameters {drawn})") from e

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Family({self.cls.__name__}, {args})"


# ---------------------------------------------------------------------------------------------
# Random


class RandomSearchSpace:
    """Independent random configurations; configuration ``i`` is a function of ``(seed, i)`` alone."""

    def __init__(self, params: Mapping[str, Any], seed: int = 0) -> None:
        if not isinstance(params, Mapping) or not params:
            raise InvalidArgument("RandomSearchSpace: params must be a non-empty mapping of name to distribution")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgument(f"RandomSearchSpace: seed: must be an int, got {seed!r}")
        self.seed = seed
        self._params: dict[str, Any] = {}
        for name in sorted(_check_name(n) for n in params):
            spec = params[name]
            if isinstance(spec, list | tuple):
                raise InvalidArgument(
                    f"RandomSearchSpace: {name}: a list is ambiguous; write Choice([...]) to pick one of them"
                )
            if not isinstance(spec, Distribution):
                spec = _to_sequence(name, spec)
            self._params[name] = spec
        self.names: tuple[str, ...] = tuple(self._params)
        check_shared("RandomSearchSpace", self._params.values())
        # One draw with a throw-away generator catches bad fixed parameters now, not mid-study.
        probe = random.Random("stagetree-validate")
        for name in self.names:
            self.sample_param(name, probe)

    def size(self) -> None:
        return None

    def config(self, index: int) -> TrialConfig:
        rng = random.Random(f"stagetree:{self.seed}:{_check_index(index, None)}")
        with _one_configuration():
            return {name: self.sample_param(name, rng) for name in self.names}

    def sample(self, n: int) -> list[TrialConfig]:
        """Configurations 0 .. n-1."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgument(f"RandomSearchSpace.sample: n: must be an int >= 0, got {n!r}")
        return [self.config(i) for i in range(n)]

    def sample_param(self, name: str, rng: random.Random) -> Sequence:
        """A fresh sequence for one hyper-parameter (PBT's resample step uses it)."""
        if name not in self._params:
            raise InvalidArgument(f"RandomSearchSpace: no hyper-parameter {name!r}; it has {list(self.names)}")
        spec = self._params[name]
        if isinstance(spec, Sequence):
            return spec
        try:
            if _SHARED.get() is None:  # one parameter alone (PBT's resampling): its own draws
                with _one_configuration():
                    return as_sequence(spec.sample(rng), field=name)
            return as_sequence(spec.sample(rng), field=name)
        except SequenceError as e:
            raise SequenceError(name, e.field, e.message.split(": ", 2)[-1]) from None
