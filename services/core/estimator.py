"""Cost estimator (TreeML §5.2, HyperSack's Sampler): time per step, peak memory and GPUs per stage.

``CostModel`` keeps, per (plan key, GPU type), the observed runs: the hyper-parameters that change cost
(``features``, by default the batch size as ``bs`` or ``batch_size``), seconds per step and peak memory.
It fits a linear regression of time per step, and of peak memory, on those features: least squares by
small normal equations with a tiny ridge term (so collinear features such as ``bs`` and ``batch_size``
both present stay solvable), falling back to the mean when the features do not vary, and to the cold
start (1.0 s/step, 1 GPU) when there is no data. Profiles are per GPU type (HyperSack samples each
architecture apart); a type never seen starts cold.

Until a size-like feature (``proportional``: by default the batch size) has been seen at two values,
a line through the data cannot say how the cost grows with it; the time per step is then taken as
proportional to it (a step at batch size 128 does four times the work of one at 32), scaled from the
value seen. The scheduler needs that to rank a branch that will train at a larger batch size than any
batch so far (a batch-size schedule that grows late) above the others.

A batch may train on ``n`` slots (data parallel: ``n`` ranks share each step's work). Time per step
is fitted as a function of ``n`` as well, through the feature ``inv_slots = 1 / n`` (``INV_SLOTS``):
``t = a + b / n + ...`` is a data-parallel step (``b / n``: the work split over the ranks; ``a``: what
does not shrink, communication included). Until two values of ``n`` have been seen, ``inv_slots`` is
proportional like the batch size: a plan seen on 1 slot is predicted at half its step time on 2
(the ideal speedup, which the first measured run on 2 corrects).

A profiling run's first step is set-up (HyperSack discards it), so :meth:`CostModel.observe_run`
drops it. An out-of-memory failure retries with twice the slots of the attempt before (TreeML §5.2),
up to a cap (``record_oom``); a plan that needed more slots once starts there next time. The cap
that matters is the most slots one node manager has (a batch's slots are on one node manager):
``slots_for`` says how many a plan's batch takes, and raises ``ResourceExhausted`` saying why when
that is more than the largest node manager has.

Pure: the master feeds observations in, persists ``to_json()`` and reloads it with ``from_json``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stagetree.core.config import Config
from stagetree.core.errors import InvalidArgument, ResourceExhausted
from stagetree.core.scheduler import StageCost
from stagetree.core.stagetree import Stage

DEFAULT_FEATURES: tuple[str, ...] = ("bs", "batch_size")
COLD_SECONDS_PER_STEP = 1.0
COLD_GPUS = 1
DEFAULT_MAX_GPUS = 8
DEFAULT_RIDGE = 1e-12
DEFAULT_MAX_OBSERVATIONS = 1000
JSON_VERSION = 1
INV_SLOTS = "inv_slots"  # 1 / the batch's slots (a feature of every observation; absent = 1 slot)


@dataclass(frozen=True)
class Observation:
    """One profiled run: its cost-relevant hyper-parameter values and what it measured."""

    features: Mapping[str, float]
    seconds_per_step: float
    peak_memory_bytes: float


@dataclass(frozen=True)
class LinearFit:
    """``y = intercept + sum(coef * (x - center))`` over ``names``; a feature missing from a query is
    taken at its center (the mean seen in training)."""

    names: tuple[str, ...]
    centers: tuple[float, ...]
    coefs: tuple[float, ...]
    intercept: float

    def predict(self, features: Mapping[str, float]) -> float:
        y = self.intercept
        for name, center, coef in zip(self.names, self.centers, self.coefs, strict=True):
            y += coef * (float(features.get(name, center)) - center)
        return y


def fit_linear(xs: Sequence[Mapping[str, float]], ys: Sequence[float], names: Iterable[str], ridge: float) -> LinearFit:
    """Least squares of ``ys`` on the named features that every sample has and that vary; the mean
    when none do. Features are centered (so the intercept is the mean and not shrunk) and the ridge
    term is scaled to the data, so it only matters when the system is singular."""
    if len(xs) != len(ys) or not ys:
        raise InvalidArgument(f"fit_linear: need as many samples as targets and at least one, got {len(xs)}/{len(ys)}")
    n = len(ys)
    ybar = sum(ys) / n
    used: list[str] = []
    centers: list[float] = []
    for name in dict.fromkeys(names):
        if not all(name in x for x in xs):
            continue
        col = [float(x[name]) for x in xs]
        if max(col) - min(col) <= 1e-12 * max(1.0, abs(max(col))):
            continue
        used.append(name)
        centers.append(sum(col) / n)
    if not used:
        return LinearFit((), (), (), ybar)
    k = len(used)
    rows = [[float(x[name]) - c for name, c in zip(used, centers, strict=True)] for x in xs]
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * (y - ybar) for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    lam = ridge * max(a[i][i] for i in range(k))
    for i in range(k):
        a[i][i] += lam
    coefs = _solve(a, b)
    return LinearFit(tuple(used), tuple(centers), tuple(coefs), ybar)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a and b are modified. The ridge keeps ``a``
    positive definite, so a zero pivot means the caller passed garbage."""
    k = len(b)
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if a[piv][col] == 0.0:
            raise InvalidArgument("fit_linear: singular system; pass a ridge > 0")
        a[col], a[piv] = a[piv], a[col]
        b[col], b[piv] = b[piv], b[col]
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, k):
                    a[r][c] -= f * a[col][c]
                b[r] -= f * b[col]
    out = [0.0] * k
    for r in range(k - 1, -1, -1):
        s = b[r] - sum(a[r][c] * out[c] for c in range(r + 1, k))
        out[r] = s / a[r][r]
    return out


def run_seconds_per_step(step_times: Sequence[float]) -> float:
    """Mean step time of a profiling run without its first step (pipeline set-up, HyperSack)."""
    if len(step_times) < 2:
        raise InvalidArgument(
            f"step_times: a profiling run needs at least 2 steps (the first is dropped), got {len(step_times)}"
        )
    rest = [_positive(t, "step_times[i]") for t in step_times[1:]]
    return sum(rest) / len(rest)


def features_of(config: Config, step: int, names: Iterable[str] = DEFAULT_FEATURES) -> dict[str, float]:
    """The numeric values of the named hyper-parameters at ``step`` (others are left out)."""
    values = config.values_at(step)
    out: dict[str, float] = {}
    for name in names:
        v = values.get(name)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[name] = float(v)
    return out


class CostModel:
    """Per (plan key, GPU type) profiles, linear fits over them, and the OOM retry rule."""

    def __init__(
        self,
        feature_names: Iterable[str] = DEFAULT_FEATURES,
        *,
        proportional: Iterable[str] = DEFAULT_FEATURES,
        ridge: float = DEFAULT_RIDGE,
        max_gpus: int = DEFAULT_MAX_GPUS,
        max_observations: int = DEFAULT_MAX_OBSERVATIONS,
    ) -> None:
        names = tuple(feature_names)
        if not all(isinstance(n, str) and n for n in names):
            raise InvalidArgument(f"feature_names: must be non-empty strings, got {names!r}")
        if not _finite(ridge) or ridge <= 0:
            raise InvalidArgument(f"ridge: must be a finite number > 0, got {ridge!r}")
        if isinstance(max_gpus, bool) or not isinstance(max_gpus, int) or max_gpus < 1:
            raise InvalidArgument(f"max_gpus: must be an integer >= 1, got {max_gpus!r}")
        if isinstance(max_observations, bool) or not isinstance(max_observations, int) or max_observations < 1:
            raise InvalidArgument(f"max_observations: must be an integer >= 1, got {max_observations!r}")
        self.feature_names = names
        self.proportional = (*(n for n in proportional if n in names), INV_SLOTS)
        self._fit_names = (*names, INV_SLOTS)
        self.ridge = float(ridge)
        self.max_gpus = max_gpus
        self.max_observations = max_observations
        self._obs: dict[tuple[str, str], deque[Observation]] = {}
        self._fits: dict[tuple[str, str], tuple[LinearFit, LinearFit]] = {}
        self._single: dict[tuple[str, str], dict[str, float]] = {}  # proportional features seen at one value
        self._min_gpus: dict[str, int] = {}

    # -- observations ---------------------------------------------------------------------------

    def observe(
        self,
        plan_key: str,
        gpu_type: str,
        features: Mapping[str, float],
        seconds_per_step: float,
        peak_memory_bytes: float,
        slots: int = 1,
    ) -> None:
        """Record one run's measured time per step and peak memory (oldest dropped past the cap), on
        ``slots`` slots (unless ``features`` already says, as ``inv_slots``)."""
        key = (_key(plan_key, "plan_key"), _key(gpu_type, "gpu_type"))
        feats = _features(features)
        if INV_SLOTS not in feats and _slots(slots) != 1:
            feats[INV_SLOTS] = 1.0 / slots
        obs = Observation(
            feats,
            _positive(seconds_per_step, "seconds_per_step"),
            _nonneg(peak_memory_bytes, "peak_memory_bytes"),
        )
        self._obs.setdefault(key, deque(maxlen=self.max_observations)).append(obs)
        self._fits.pop(key, None)

    def observe_run(
        self,
        plan_key: str,
        gpu_type: str,
        features: Mapping[str, float],
        step_times: Sequence[float],
        peak_memory_bytes: float,
    ) -> float:
        """Record a profiling run from its per-step times, the first one dropped; returns the
        seconds per step recorded."""
        sps = run_seconds_per_step(step_times)
        self.observe(plan_key, gpu_type, features, sps, peak_memory_bytes)
        return sps

    def observations(self, plan_key: str, gpu_type: str) -> list[Observation]:
        return list(self._obs.get((plan_key, gpu_type), ()))

    # -- predictions ------------------------------------------------------------------------------

    def _fit(self, plan_key: str, gpu_type: str) -> tuple[LinearFit, LinearFit] | None:
        key = (plan_key, gpu_type)
        fit = self._fits.get(key)
        if fit is None:
            obs = self._obs.get(key)
            if not obs:
                return None
            xs = [{INV_SLOTS: 1.0, **o.features} for o in obs]
            time_fit = fit_linear(xs, [o.seconds_per_step for o in obs], self._fit_names, self.ridge)
            mem_fit = fit_linear(xs, [o.peak_memory_bytes for o in obs], self._fit_names, self.ridge)
            fit = self._fits[key] = (time_fit, mem_fit)
            single: dict[str, float] = {}
            for name in self.proportional:
                seen = {x[name] for x in xs if name in x}
                if len(seen) == 1 and (v := seen.pop()) > 0:
                    single[name] = v
            self._single[key] = single
        return fit

    def seconds_per_step(self, plan_key: str, gpu_type: str, features: Mapping[str, float], slots: int = 1) -> float:
        """Predicted seconds per step on ``slots`` slots; 1.0 with no data. Extrapolating a fit below zero
        gives 0. A proportional feature seen at one value only scales the prediction by ``value / seen``."""
        fit = self._fit(plan_key, gpu_type)
        if fit is None:
            return COLD_SECONDS_PER_STEP
        feats = _features(features)
        feats.setdefault(INV_SLOTS, 1.0 / _slots(slots))
        y = max(0.0, fit[0].predict(feats))
        for name, seen in self._single[(plan_key, gpu_type)].items():
            if name in feats and feats[name] >= 0:
                y *= feats[name] / seen
        return y

    def peak_memory(self, plan_key: str, gpu_type: str, features: Mapping[str, float], slots: int = 1) -> float | None:
        """Predicted peak memory in bytes (per rank on ``slots`` slots); None with no data."""
        fit = self._fit(plan_key, gpu_type)
        if fit is None:
            return None
        feats = _features(features)
        feats.setdefault(INV_SLOTS, 1.0 / _slots(slots))
        return max(0.0, fit[1].predict(feats))

    def stage_cost(
        self, config_of_node: Callable[[int], Config], plan_key: str, gpu_type: str, slots: int = 1
    ) -> StageCost:
        """The scheduler's cost callable: a stage's steps times the predicted time per step under its
        node's configuration at the stage's midpoint, on ``slots`` slots."""
        names = self.feature_names

        def cost(stage: Stage) -> float:
            if stage.steps <= 0:
                return 0.0
            mid = (stage.start + stage.end) // 2
            feats = features_of(config_of_node(stage.node), mid, names)
            return stage.steps * self.seconds_per_step(plan_key, gpu_type, feats, slots)

        return cost

    # -- out of memory --------------------------------------------------------------------------

    def gpus_for(self, plan_key: str, oom_failures: int = 0) -> int:
        """GPUs for a stage of this plan after ``oom_failures`` out-of-memory failures: the plan's
        starting count (1 unless it needed more before), doubled per failure, capped at ``max_gpus``."""
        if isinstance(oom_failures, bool) or not isinstance(oom_failures, int) or oom_failures < 0:
            raise InvalidArgument(f"oom_failures: must be an integer >= 0, got {oom_failures!r}")
        start = self._min_gpus.get(plan_key, COLD_GPUS)
        # Past log2(max_gpus) doublings the cap wins; don't build huge integers.
        doublings = min(oom_failures, self.max_gpus.bit_length())
        return min(self.max_gpus, start << doublings)

    def record_oom(self, plan_key: str, gpus: int) -> int:
        """A stage of this plan ran out of memory on ``gpus`` GPUs: later stages start with twice as
        many (capped). Returns the new starting count."""
        key = _key(plan_key, "plan_key")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise InvalidArgument(f"gpus: must be an integer >= 1, got {gpus!r}")
        new = min(self.max_gpus, max(self._min_gpus.get(key, COLD_GPUS), 2 * gpus))
        self._min_gpus[key] = new
        return new

    def slots_for(self, plan_key: str, asked: int, most: int) -> int:
        """The slots a batch of this plan takes: what its study ``asked`` for, or more when the plan ran
        out of memory before (``record_oom``). ``most``: the most slots one node manager has; asking for
        more raises ``ResourceExhausted`` with what happened and what to do (``batch_slots``)."""
        return batch_slots(asked, self._min_gpus.get(plan_key, COLD_GPUS), most)

    def min_slots(self, plan_key: str) -> int:
        """The slots a batch of this plan starts with (1 unless it ran out of memory before)."""
        return self._min_gpus.get(plan_key, COLD_GPUS)

    def any_ran_out_of_memory(self) -> bool:
        """Whether some plan's batches take more than one slot after running out of memory."""
        return any(n > COLD_GPUS for n in self._min_gpus.values())

    # -- persistence ----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "version": JSON_VERSION,
            "feature_names": list(self.feature_names),
            "ridge": self.ridge,
            "max_gpus": self.max_gpus,
            "max_observations": self.max_observations,
            "profiles": [
                {
                    "plan_key": plan,
                    "gpu_type": gpu,
                    "observations": [
                        {
                            "features": dict(o.features),
                            "seconds_per_step": o.seconds_per_step,
                            "peak_memory_bytes": o.peak_memory_bytes,
                        }
                        for o in obs
                    ],
                }
                for (plan, gpu), obs in sorted(self._obs.items())
            ],
            "min_gpus": dict(sorted(self._min_gpus.items())),
        }

    @classmethod
    def from_json(cls, obj: Any) -> CostModel:
        if not isinstance(obj, Mapping):
            raise InvalidArgument("cost model: must be an object as written by CostModel.to_json()")
        if obj.get("version") != JSON_VERSION:
            raise InvalidArgument(f"cost model: version {obj.get('version')!r} is not {JSON_VERSION}; re-profile")
        try:
            model = cls(
                obj["feature_names"],
                ridge=obj["ridge"],
                max_gpus=obj["max_gpus"],
                max_observations=obj["max_observations"],
            )
            for prof in obj["profiles"]:
                for o in prof["observations"]:
                    model.observe(
                        prof["plan_key"], prof["gpu_type"], o["features"], o["seconds_per_step"], o["peak_memory_bytes"]
                    )
            min_gpus = obj.get("min_gpus", {})
            if not isinstance(min_gpus, Mapping):
                raise InvalidArgument("cost model: min_gpus must be an object")
            for plan, n in min_gpus.items():
                if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= model.max_gpus:
                    raise InvalidArgument(f"cost model: min_gpus[{plan!r}] must be in [1, {model.max_gpus}], got {n!r}")
                model._min_gpus[_key(plan, "plan_key")] = n
        except (KeyError, TypeError, AttributeError) as e:
            raise InvalidArgument(f"cost model: malformed ({e!r}); expected CostModel.to_json() output") from None
        return model


# ---------------------------------------------------------------------------------------------
# Validation


def _finite(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x)


def _number(x: object, what: str, *, minimum: float, strict: bool) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise InvalidArgument(f"{what}: must be a finite number, got {x!r}")
    if x < minimum or (strict and x == minimum):
        raise InvalidArgument(f"{what}: must be {'>' if strict else '>='} {minimum:g}, got {x!r}")
    return float(x)


def _positive(x: object, what: str) -> float:
    return _number(x, what, minimum=0.0, strict=True)


def _nonneg(x: object, what: str) -> float:
    return _number(x, what, minimum=0.0, strict=False)


def _slots(x: object) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise InvalidArgument(f"slots: must be an integer >= 1, got {x!r}")
    return x


def _key(x: object, what: str) -> str:
    if not isinstance(x, str):
        raise InvalidArgument(f"{what}: must be a string, got {x!r}")
    return x


def _features(features: Mapping[str, float]) -> dict[str, float]:
    if not isinstance(features, Mapping):
        raise InvalidArgument(f"features: must be a mapping of name to number, got {type(features).__name__}")
    out: dict[str, float] = {}
    for k, v in features.items():
        if not isinstance(k, str) or not k:
            raise InvalidArgument(f"features: names must be non-empty strings, got {k!r}")
        if not _finite(v):
            raise InvalidArgument(f"features[{k!r}]: must be a finite number, got {v!r}")
        out[k] = float(v)
    return out


def batch_slots(asked: int, floor: int, most: int) -> int:
    """The slots a batch takes: what its study ``asked`` for, at least ``floor`` (twice what ran out of
    memory), when one node manager has that many (``most``); else ``ResourceExhausted`` saying why and
    what to do."""
    asked, most = _slots(asked), _slots(most)
    need = max(asked, floor)
    if need <= most:
        return need
    if need > asked:
        raise ResourceExhausted(
            f"out of memory on {need // 2} slot(s): the retry would take {need} slots and the largest node "
            f"manager has {most}; lower the batch size or the model size, or add a node manager with "
            f"{need} slots"
        )
    raise ResourceExhausted(
        f"the study asks for {asked} slots per batch and the largest node manager has {most}; ask for at "
        f"most {most} (a batch's slots are on one node manager)"
    )
