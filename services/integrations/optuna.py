"""Optuna's samplers as stagetree tuners, and a study's trials exported to an Optuna study (extra ``optuna``).

This module owns:

* ``OptunaSpace``: a search space written with stagetree's distributions (``Choice``, ``Uniform``,
  ``LogUniform``, ``IntUniform``, ``Family``) that an Optuna trial fills in (define-by-run): a ``Choice`` is
  a categorical parameter (its options may be sequence families, so the decay *family* is a choice), a
  ``Family`` parameter is named ``<hp>.<param>``, and with ``grid=k`` every float is one of k points
  (evenly spaced, or geometric for ``LogUniform``; Optuna keeps the proposed value, the trial trains
  with the nearest point), so proposals repeat and their prefixes are shared.
* ``OptunaTuner``: any ``optuna.samplers.BaseSampler`` proposes new trials through ask/tell; promotions
  are stagetree's (``"asha"``, ``"hyperband"``: BOHB-style), or Optuna's pruner decides after each rung
  (``"pruner"``), or every trial runs to ``max_step`` (``"none"``, the only mode with several metrics,
  e.g. NSGA-II). Intermediate values are reported at every evaluated step, so pruners and the dashboard
  see the curves. A trial paused at a rung is told PRUNED (the sampler learns from it at once); if ASHA
  promotes it later, its continuation is a new Optuna trial with the same parameters and the whole curve.
  The tuner stays an events-in, actions-out state machine (``client/tuners/base.py``); the sampler's own
  storage is the Optuna study's (in memory unless ``study`` says otherwise).
* ``export_to_optuna(trials, storage=..., study_name=...)``: stored trials (``records.study_trials``) as
  finished Optuna trials, for optuna-dashboard and ``optuna.visualization``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Literal

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

from stagetree.client.spaces import (
    Choice,
    Distribution,
    Family,
    IntUniform,
    LogUniform,
    Shared,
    TrialConfig,
    Uniform,
    check_shared,
)
from stagetree.client.tuners.asha import ASHA
from stagetree.client.tuners.base import (
    Action,
    Failed,
    Finish,
    Result,
    Stop,
    Submit,
    Trial,
    Tuner,
    check_int,
    check_mode,
    score,
)
from stagetree.client.tuners.halving import Hyperband, rung_steps
from stagetree.core.errors import InvalidArgument
from stagetree.core.sequences import as_sequence
from stagetree.integrations.records import TrialRecord

Promotions = Literal["asha", "hyperband", "pruner", "none"]
PROMOTIONS: tuple[str, ...] = ("asha", "hyperband", "pruner", "none")


# user attributes of each Optuna trial the tuner asks: the values that trained (a grid point, not the
# proposal), and the stagetree trial it became (``trial-<id>``, the label of its requests)
TRAINED_PARAMS = "stagetree.params"
STAGETREE_TRIAL = "stagetree.trial"
LABEL_CHARS = 40  # an option's text longer than this is shortened in its label (and in parameter names)


def _labels(choice: Choice) -> list[str]:
    """Categorical choices for Optuna: the ``Choice``'s own labels when it has them (a mapping), else a
    family's class name when that tells the options apart, else each option's text; a text longer than
    ``LABEL_CHARS`` is cut and numbered (``#2 Warmup(0.01, 5, then=Cos…``) so parameter names stay short."""
    if choice.labels is not None:
        return list(choice.labels)
    opts = list(choice.options)
    short = [o.cls.__name__ if isinstance(o, Family) else repr(o) for o in opts]
    texts = short if len(set(short)) == len(short) else [repr(o) for o in opts]
    if all(len(s) <= LABEL_CHARS for s in texts):
        return texts
    return [s if len(s) <= LABEL_CHARS else f"#{i} {s[: LABEL_CHARS - 4]}…" for i, s in enumerate(texts)]


class OptunaSpace:
    """Hyper-parameter name -> distribution (or a fixed value / sequence); see the module doc."""

    def __init__(self, params: Mapping[str, Any], *, grid: int | None = None) -> None:
        if not isinstance(params, Mapping) or not params:
            raise InvalidArgument("OptunaSpace: params must be a non-empty mapping of name to distribution")
        if grid is not None:
            check_int("OptunaSpace", "grid", grid, 2)
        self.grid = grid
        self.params: dict[str, Any] = {}
        for name in sorted(params):
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"OptunaSpace: names must be non-empty strings, got {name!r}")
            spec = params[name]
            if isinstance(spec, list | tuple):
                raise InvalidArgument(f"OptunaSpace: {name}: a list is ambiguous; write Choice([...])")
            self.params[name] = spec if isinstance(spec, Distribution) else as_sequence(spec, field=name)
        check_shared("OptunaSpace", self.params.values())
        for c in _choices(self.params.values()):
            labels = _labels(c)
            if len(set(labels)) != len(labels):
                raise InvalidArgument(f"OptunaSpace: Choice {labels}: options must differ")

    def suggest(self, trial: optuna.Trial) -> TrialConfig:
        """The configuration ``trial`` proposes (each distribution becomes a ``suggest_*`` call). With a
        grid, what trains is each float's grid point, not the proposal Optuna keeps in ``trial.params``:
        the trial's user attribute ``TRAINED_PARAMS`` holds the values that trained, by parameter name."""
        out: TrialConfig = {}
        trained: dict[str, Any] = {}
        for name, spec in self.params.items():
            value = self._draw(trial, name, spec, trained)
            out[name] = as_sequence(value, field=name)
        trial.set_user_attr(TRAINED_PARAMS, trained)
        return out

    def _draw(self, trial: optuna.Trial, name: str, spec: Any, trained: dict[str, Any]) -> Any:
        if not isinstance(spec, Distribution):
            return spec
        if isinstance(spec, Choice):
            labels = _labels(spec)
            label = trained[name] = str(trial.suggest_categorical(name, labels))
            picked = spec.options[labels.index(label)]
            if isinstance(picked, Distribution):
                return self._draw(trial, f"{name}[{label}]", picked, trained)
            return list(picked) if isinstance(picked, list) else picked
        if isinstance(spec, Shared):  # one Optuna parameter, whichever option or family it appears in
            return self._draw(trial, spec.name, spec.dist, trained)
        if isinstance(spec, Family):
            drawn = {p: self._draw(trial, f"{name}.{p}", v, trained) for p, v in spec.params.items()}
            try:
                return spec.cls(**drawn)
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"OptunaSpace: {name}: {e} (drawn parameters {drawn})") from e
        if isinstance(spec, IntUniform):
            trained[name] = trial.suggest_int(name, spec.lo, spec.hi)
            return trained[name]
        if isinstance(spec, Uniform | LogUniform):
            log = isinstance(spec, LogUniform)
            x = trial.suggest_float(name, spec.lo, spec.hi, log=log)
            trained[name] = x if self.grid is None else _snap(x, spec.lo, spec.hi, self.grid, log=log)
            return trained[name]
        raise InvalidArgument(f"OptunaSpace: {name}: {type(spec).__name__} has no Optuna counterpart")


def _snap(x: float, lo: float, hi: float, k: int, *, log: bool) -> float:
    """The nearest of k points from lo to hi (evenly spaced, or geometric with ``log``), rounded to 4
    significant digits. The sampler keeps the value it proposed; the trial trains with the point."""
    f = math.log if log else float
    a, b = f(lo), f(hi)
    i = min(k - 1, max(0, round((f(x) - a) / (b - a) * (k - 1))))
    point = a + (b - a) * i / (k - 1)
    return float(f"{(math.exp(point) if log else point):.4g}")


def _choices(specs: Iterable[Any]) -> Iterable[Choice]:
    for s in specs:
        if isinstance(s, Choice):
            yield s
            yield from _choices(s.options)
        elif isinstance(s, Family):
            yield from _choices(s.params.values())
        elif isinstance(s, Shared):
            yield from _choices([s.dist])


def _direction(mode: str) -> Literal["maximize", "minimize"]:
    return "maximize" if mode == "max" else "minimize"


class _SamplerSpace:
    """The ``SearchSpace`` an inner tuner draws from: configuration i is a new ``study.ask()``."""

    def __init__(self, study: optuna.Study, space: OptunaSpace, size: int | None) -> None:
        self.study, self.space, self._size = study, space, size
        self.asked: dict[int, optuna.Trial] = {}  # id(config) -> the Optuna trial that proposed it
        self._keep: list[TrialConfig] = []  # keeps the ids above unique

    def size(self) -> int | None:
        return self._size

    def config(self, index: int) -> TrialConfig:
        trial = self.study.ask()
        config = self.space.suggest(trial)
        self.asked[id(config)] = trial
        self._keep.append(config)
        return config


@dataclass
class _Record:
    """The Optuna side of one stagetree trial: its current Optuna trial and what it was told."""

    trial: optuna.Trial
    reported: dict[int, float] = field(default_factory=dict)
    told: bool = False


class _Stepwise(Tuner):
    """``n_trials`` trials, ``max_concurrent`` at a time, each evaluated at ``steps`` in turn until the
    outer tuner's ``keep_going`` says no (Optuna's pruner) or the last step is reached."""

    def __init__(
        self, space: _SamplerSpace, steps: list[int], n_trials: int, max_concurrent: int, metric: str, mode: str
    ) -> None:
        super().__init__(metric, mode)
        self.space, self.steps, self.n_trials, self.max_concurrent = space, steps, n_trials, max_concurrent
        self.keep_going: dict[int, bool] = {}

    def _fill(self) -> list[Action]:
        actions: list[Action] = []
        while len(self.trials) < self.n_trials and len(self.pending()) < self.max_concurrent:
            actions.append(self._submit(self._new_trial(self.space.config(len(self.trials))), self.steps[0]))
        return actions

    def _on_start(self) -> list[Action]:
        return self._fill()

    def _on_result(self, trial: Trial, step: int) -> list[Action]:
        k = self.steps.index(step)
        if k + 1 < len(self.steps) and self.keep_going.pop(trial.trial_id, True):
            return [self._submit(trial, self.steps[k + 1])]
        trial.status = "done"
        return self._fill()

    def _on_failure(self, trial: Trial) -> list[Action]:
        return self._fill()


class OptunaTuner(Tuner):
    """An Optuna sampler proposing stagetree trials; see the module doc for ``promotions``.

    ``metric`` is a name, or a list of names for several objectives (then ``mode`` is a list too and
    ``promotions="none"``). Rungs are at ``min_step * eta**k`` up to ``max_step``.
    """

    def __init__(
        self,
        space: OptunaSpace,
        sampler: optuna.samplers.BaseSampler | None = None,
        *,
        metric: str | Seq[str],
        mode: str | Seq[str] = "max",
        n_trials: int,
        max_step: int,
        min_step: int | None = None,
        eta: int = 3,
        promotions: Promotions = "asha",
        pruner: optuna.pruners.BasePruner | None = None,
        max_concurrent: int = 1,
        study: optuna.Study | None = None,
    ) -> None:
        metrics = [metric] if isinstance(metric, str) else list(metric)
        modes = [mode] * len(metrics) if isinstance(mode, str) else list(mode)
        if not metrics or len(modes) != len(metrics):
            raise InvalidArgument(f"OptunaTuner: mode: give one per metric {metrics}, got {mode!r}")
        super().__init__(metrics[0], modes[0])
        self.metrics, self.modes = metrics, [check_mode(m) for m in modes]
        if promotions not in PROMOTIONS:
            raise InvalidArgument(f"OptunaTuner: promotions: must be one of {list(PROMOTIONS)}, got {promotions!r}")
        if len(metrics) > 1 and promotions != "none":
            raise InvalidArgument(
                f"OptunaTuner: several metrics rank trials only at the end: use promotions='none' (got {promotions!r})"
            )
        check_int("OptunaTuner", "n_trials", n_trials, 1)
        check_int("OptunaTuner", "max_concurrent", max_concurrent, 1)
        self.max_step = check_int("OptunaTuner", "max_step", max_step, 1)
        self.steps = rung_steps("OptunaTuner", min_step or max_step, max_step, eta)
        if self.steps[-1] != max_step and promotions != "none":
            top = self.steps[-1]
            raise InvalidArgument(
                f"OptunaTuner: max_step={max_step} is not a rung of min_step={self.steps[0]}, eta={eta} "
                f"(rungs {self.steps}): no trial would train past {top} and each would be COMPLETE there; "
                f"use max_step={top} or {top * eta}, or a min_step that reaches {max_step} by factors of {eta}"
            )
        self.promotions = promotions
        directions = [_direction(m) for m in self.modes]
        if study is None:
            study = optuna.create_study(sampler=sampler, pruner=pruner, directions=directions)
        elif [d.name.lower() for d in study.directions] != directions:
            raise InvalidArgument(f"OptunaTuner: study: its directions must be {directions}")
        self.study = study
        self.space = space
        self._source = _SamplerSpace(study, space, None if promotions == "hyperband" else n_trials)
        common: dict[str, Any] = {"metric": self.metric, "mode": self.mode}
        self.inner: Tuner
        if promotions == "asha":
            self.inner = ASHA(
                self._source, eta=eta, min_step=self.steps[0], max_step=max_step,
                max_concurrent=max_concurrent, max_trials=n_trials, **common,
            )  # fmt: skip
        elif promotions == "hyperband":
            self.inner = Hyperband(self._source, eta=eta, min_step=self.steps[0], max_step=max_step, **common)
        else:
            steps = self.steps if promotions == "pruner" else [max_step]
            self.inner = _Stepwise(self._source, steps, n_trials, max_concurrent, self.metric, self.mode)
        self._outer: dict[int, Trial] = {}  # inner trial id -> this tuner's trial
        self._inner: dict[int, int] = {}  # this tuner's trial id -> inner trial id
        self.records: dict[int, _Record] = {}  # this tuner's trial id -> its Optuna side

    def best_params(self) -> dict[str, Any]:
        """The values the Optuna study's best trial trained with. ``study.best_trial.params`` holds the
        sampler's proposals, which a grid moves to its points; these are the points."""
        best = self.study.best_trial
        return dict(best.user_attrs.get(TRAINED_PARAMS, best.params))

    # -- events in -------------------------------------------------------------------------------

    def _on_start(self) -> list[Action]:
        return self._translate(self.inner.start())

    def _on_result(self, trial: Trial, step: int) -> list[Action]:
        metrics = trial.results[step]
        missing = [m for m in self.metrics if m not in metrics]
        if missing:
            raise InvalidArgument(f"result for trial {trial.trial_id} at step {step} lacks metrics {missing}")
        rec = self.records[trial.trial_id]
        inner_id = self._inner[trial.trial_id]
        if len(self.metrics) == 1 and not rec.told:
            rec.reported[step] = metrics[self.metric]
            rec.trial.report(metrics[self.metric], step)
            if self.promotions == "pruner" and isinstance(self.inner, _Stepwise):
                self.inner.keep_going[inner_id] = not rec.trial.should_prune()
        actions = self.inner.on_result(Result(inner_id, step, metrics))
        if not any(isinstance(a, Submit) and a.trial_id == inner_id for a in actions):
            self._tell_paused(trial, step)
        return self._translate(actions)

    def _on_failure(self, trial: Trial) -> list[Action]:
        rec = self.records[trial.trial_id]
        if not rec.told:
            self.study.tell(rec.trial, state=TrialState.FAIL)
            rec.told = True
        return self._translate(self.inner.on_failure(Failed(self._inner[trial.trial_id], trial.error or "")))

    def close(self) -> list[Action]:
        for t in self.trials.values():
            if t.pending is not None and not self.records[t.trial_id].told:
                self._tell_paused(t, t.last_step())
        return super().close()

    # -- the Optuna side -------------------------------------------------------------------------

    def _tell_paused(self, trial: Trial, step: int | None) -> None:
        """The trial stops moving at ``step``: COMPLETE at the top, PRUNED below it (single metric)."""
        rec = self.records[trial.trial_id]
        if rec.told:
            return
        rec.told = True
        if step is None:
            self.study.tell(rec.trial, state=TrialState.FAIL)
            return
        metrics = trial.results[step]
        if step >= self.steps[-1] or len(self.metrics) > 1:
            trial.status = "done" if step >= self.steps[-1] else trial.status
            values = [metrics[m] for m in self.metrics]
            self.study.tell(rec.trial, values[0] if len(values) == 1 else values)
        else:
            self.study.tell(rec.trial, state=TrialState.PRUNED)

    def _resume_record(self, outer: Trial, rec: _Record) -> _Record:
        """A promoted trial whose Optuna trial was told: the same parameters as a new Optuna trial, with
        the intermediate values so far."""
        self.study.enqueue_trial(dict(rec.trial.params), skip_if_exists=False)
        again = self.study.ask()
        config = self.space.suggest(again)
        if config != outer.config:
            raise AssertionError(f"re-asked trial proposed {config}, expected {outer.config}")
        for s, v in rec.reported.items():
            again.report(v, s)
        return _Record(again, dict(rec.reported))

    # -- actions out -----------------------------------------------------------------------------

    def _translate(self, actions: list[Action]) -> list[Action]:
        out: list[Action] = []
        for a in actions:
            if isinstance(a, Submit):
                outer = self._outer.get(a.trial_id)
                if outer is None:
                    outer = self._new_trial(a.config)
                    self._outer[a.trial_id], self._inner[outer.trial_id] = outer, a.trial_id
                    self.records[outer.trial_id] = _Record(self._source.asked[id(a.config)])
                    self.records[outer.trial_id].trial.set_user_attr(STAGETREE_TRIAL, f"trial-{outer.trial_id}")
                elif self.records[outer.trial_id].told:
                    self.records[outer.trial_id] = self._resume_record(outer, self.records[outer.trial_id])
                    self.records[outer.trial_id].trial.set_user_attr(STAGETREE_TRIAL, f"trial-{outer.trial_id}")
                if outer.pending is None:
                    out.append(self._submit(outer, a.step))
            elif isinstance(a, Stop):
                outer = self._outer.get(a.trial_id)
                if outer is not None:
                    self._tell_paused(outer, outer.last_step())
                    out.extend(self._stop(outer))
            elif isinstance(a, Finish):
                continue  # the base class emits this tuner's own Finish
        return out


# ---------------------------------------------------------------------------------------------
# Export


def _distributions(records: Seq[TrialRecord]) -> dict[str, BaseDistribution]:
    """One distribution per parameter over all trials (Optuna wants the same one in every trial): a
    number's range, or the categorical set of a schedule's texts."""
    values: dict[str, list[Any]] = {}
    for rec in records:
        for name, v in rec.flat_config().items():
            values.setdefault(name, []).append(v)
    dists: dict[str, BaseDistribution] = {}
    for name, vs in values.items():
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in vs):
            dists[name] = FloatDistribution(float(min(vs)), float(max(vs)))
        else:
            dists[name] = CategoricalDistribution(sorted({str(v) for v in vs}))
    return dists


def _params(rec: TrialRecord, dists: Mapping[str, BaseDistribution]) -> dict[str, Any]:
    return {n: float(v) if isinstance(dists[n], FloatDistribution) else str(v) for n, v in rec.flat_config().items()}


def export_to_optuna(
    trials: Iterable[TrialRecord],
    *,
    storage: str | optuna.storages.BaseStorage | None = None,
    study_name: str,
    metric: str | Seq[str],
    mode: str | Seq[str] = "max",
    max_step: int | None = None,
) -> optuna.Study:
    """Write ``trials`` (``records.study_trials``) into an Optuna study in ``storage`` (an RDB URL such as
    ``sqlite:///optuna.db``, a ``JournalStorage``, or None for memory) and return it.

    Each trial becomes one finished Optuna trial: its configuration as parameters (a schedule as its text,
    a constant as its number), its curve of ``metric`` as intermediate values, COMPLETE with its last value
    when it reached ``max_step`` (default: the furthest step of any trial), PRUNED below it, FAIL when it
    has no value. A study of that name that exists is appended to."""
    metrics = [metric] if isinstance(metric, str) else list(metric)
    modes = [mode] * len(metrics) if isinstance(mode, str) else list(mode)
    directions = [_direction(check_mode(m)) for m in modes]
    records = list(trials)
    top = max_step if max_step is not None else max((t.last_step() or 0 for t in records), default=0)
    study = optuna.create_study(storage=storage, study_name=study_name, directions=directions, load_if_exists=True)
    all_dists = _distributions(records)
    batch: list[optuna.trial.FrozenTrial] = []
    for rec in records:
        params = _params(rec, all_dists)
        dists = {n: all_dists[n] for n in params}
        values = [rec.value(m) for m in metrics]
        inter = {s: m[metrics[0]] for s, m in rec.points.items() if metrics[0] in m} if len(metrics) == 1 else {}
        last = rec.last_step()
        if any(v is None for v in values) or last is None:
            state, vals = TrialState.FAIL, None
        elif last >= top or len(metrics) > 1:
            state, vals = TrialState.COMPLETE, [float(v) for v in values if v is not None]
        else:
            state, vals = TrialState.PRUNED, None
        batch.append(
            optuna.trial.create_trial(
                state=state, values=vals, params=params, distributions=dists, intermediate_values=inter,
                user_attrs={"stagetree_label": rec.label, "stagetree_code_version": rec.code_version,
                            "steps": sorted(rec.points)},
            )
        )  # fmt: skip
    study.add_trials(batch)
    return study


def best_of(trials: Iterable[TrialRecord], metric: str, mode: str = "max") -> TrialRecord | None:
    """The trial with the best last value of ``metric`` (a helper for scripts and the benchmark)."""
    m = check_mode(mode)
    found: TrialRecord | None = None
    key = -math.inf
    for t in trials:
        v = t.value(metric)
        if v is not None and (found is None or score(v, m) > key):
            found, key = t, score(v, m)
    return found
