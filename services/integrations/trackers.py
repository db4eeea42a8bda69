"""Experiment trackers: a study's trials logged to MLflow or TensorBoard (extras ``mlflow``, ``tensorboard``).

This module owns ``Tracker`` (the role: one study, one run per trial, a point per evaluated step),
its adapters ``MlflowTracker`` (a study run with one nested run per trial: config as params, metrics at
their steps) and ``TensorBoardTracker`` (one event directory per trial under the study's: scalars at
their steps, the config as HParams), and the two ways to feed them:

* ``log_study(study, tracker)`` after (or during) a study: every trial as the platform stored it
  (``records.study_trials``), nothing trained again;
* ``TrackerCallback(tracker)`` as ``drive(..., on_event=...)``: each result as the driver receives it
  (the metrics the master stored for that request), the runs closed at the tuner's ``Finish``.

Each adapter imports its library when it is built, so the extras stay optional.
"""

from __future__ import annotations

import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeAlias

from stagetree.client.sdk import Study
from stagetree.client.tuners.base import Action, Event, Failed, Finish, Result, Stop, Submit
from stagetree.core.sequences import Sequence
from stagetree.integrations.records import TrialRecord, study_trials

log = logging.getLogger(__name__)

TrialEnd: TypeAlias = Literal["FINISHED", "FAILED", "KILLED"]


STEP_PREFIX = "step/"  # a learning curve's metrics (what train() returned), logged beside the evaluations'


class Tracker(ABC):
    """Where a study's trials are logged: one study, a run per trial, a point per evaluated step."""

    @abstractmethod
    def start_study(self, name: str, params: Mapping[str, Any]) -> None: ...

    @abstractmethod
    def log_point(self, trial: str, config: Mapping[str, Any], step: int, metrics: Mapping[str, float]) -> None:
        """``metrics`` of ``trial`` at ``step``; the first point of a trial opens its run with ``config``."""

    @abstractmethod
    def end_trial(self, trial: str, status: TrialEnd) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """End the study's run (and any trial's still open)."""

    def log_trial(self, rec: TrialRecord) -> None:
        """A stored trial at once: its learning curve (step metrics as ``step/<name>``, apart from the
        evaluations' metrics of the same name), every evaluated point, then its end."""
        config = rec.flat_config()
        for step, metrics in rec.curve:
            self.log_point(rec.label, config, step, {f"{STEP_PREFIX}{k}": v for k, v in metrics.items()})
        for step, metrics in rec.points.items():
            self.log_point(rec.label, config, step, metrics)
        if not rec.points and rec.failed:
            self.log_point(rec.label, config, 0, {})
        self.end_trial(rec.label, "FAILED" if rec.failed and not rec.points else "FINISHED")


async def log_study(
    study: Study,
    tracker: Tracker,
    *,
    configs: Mapping[str, dict[str, Sequence]] | None = None,
    params: Mapping[str, Any] | None = None,
    curves: bool = True,
) -> int:
    """Log every trial of ``study`` from the platform's stored metrics; returns how many trials.
    ``configs``: the tuner's configurations by trial label (``records.tuner_configs``), see ``records``;
    ``curves``: each trial's learning curve too (``step/<name>``, one read per trial)."""
    trials = await study_trials(study, configs, curves=curves)
    fixed = study.fixed
    study_params: dict[str, Any] = {"study_id": study.id}
    if fixed is not None:
        study_params.update({"trainer": fixed.trainer, "dataset": fixed.dataset, "seed": fixed.seed})
        study_params.update({f"fixed.{k}": v for k, v in fixed.values.items()})
    study_params.update(params or {})
    tracker.start_study(study.name, study_params)
    try:
        for rec in trials:
            tracker.log_trial(rec)
    finally:
        tracker.close()
    return len(trials)


class TrackerCallback:
    """``drive(study, tuner, on_event=TrackerCallback(tracker, "sweep"))``: logs each result as it comes."""

    def __init__(self, tracker: Tracker, study_name: str, params: Mapping[str, Any] | None = None) -> None:
        self.tracker = tracker
        self.configs: dict[int, dict[str, Any]] = {}
        self._open: set[int] = set()
        tracker.start_study(study_name, dict(params or {}))

    def __call__(self, event: Event, actions: list[Action]) -> None:
        if isinstance(event, Result):
            self.tracker.log_point(self._label(event.trial_id), self._config(event.trial_id), event.step, event.metrics)
        elif isinstance(event, Failed) and event.trial_id in self._open:
            self._end(event.trial_id, "FAILED")
        for a in actions:
            if isinstance(a, Submit):
                self.configs[a.trial_id] = TrialRecord("", dict(a.config)).flat_config()
                self._open.add(a.trial_id)
            elif isinstance(a, Stop):
                self._end(a.trial_id, "KILLED")
            elif isinstance(a, Finish):
                for t in sorted(self._open):
                    self._end(t, "FINISHED")
                self.tracker.close()

    def _end(self, trial_id: int, status: TrialEnd) -> None:
        if trial_id in self._open:
            self._open.discard(trial_id)
            self.tracker.end_trial(self._label(trial_id), status)

    def _config(self, trial_id: int) -> dict[str, Any]:
        return self.configs.get(trial_id, {})

    @staticmethod
    def _label(trial_id: int) -> str:
        return f"trial-{trial_id}"  # the label the driver gives the trial's requests


# ---------------------------------------------------------------------------------------------
# MLflow


class MlflowTracker(Tracker):
    """A study run in ``experiment`` with one nested run per trial (tag ``mlflow.parentRunId``).

    ``tracking_uri``: any MLflow tracking URI (``sqlite:///mlflow.db``, ``http://mlflow:5000``, a local
    ``file:`` store where MLflow allows it); None uses MLflow's own default."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = "stagetree") -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id: str = (
            found.experiment_id if found is not None else self.client.create_experiment(experiment)
        )
        self.study_run_id = ""
        self.runs: dict[str, str] = {}  # trial label -> run id
        self._ended: set[str] = set()

    def start_study(self, name: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        run = self.client.create_run(self.experiment_id, run_name=name, tags={"stagetree.study": name})
        self.study_run_id = run.info.run_id
        self.client.log_batch(self.study_run_id, params=[Param(k, _text(v)) for k, v in params.items()])

    def log_point(self, trial: str, config: Mapping[str, Any], step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric, Param

        run_id = self.runs.get(trial)
        if run_id is None:
            tags = {"mlflow.parentRunId": self.study_run_id, "stagetree.trial": trial}
            run_id = self.client.create_run(self.experiment_id, run_name=trial, tags=tags).info.run_id
            self.runs[trial] = run_id
            self.client.log_batch(run_id, params=[Param(k, _text(v)) for k, v in config.items()])
        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(_key(k), float(v), now, step) for k, v in metrics.items()])

    def end_trial(self, trial: str, status: TrialEnd) -> None:
        run_id = self.runs.get(trial)
        if run_id is not None and trial not in self._ended:
            self._ended.add(trial)
            self.client.set_terminated(run_id, status)

    def close(self) -> None:
        for trial in list(self.runs):
            self.end_trial(trial, "FINISHED")
        if self.study_run_id:
            self.client.set_terminated(self.study_run_id, "FINISHED")


def _text(v: Any) -> str:
    return str(v)[:6000]  # MLflow's limit on a param value


def _key(name: str) -> str:
    return re.sub(r"[^\w\-. /]", "_", name)  # the characters MLflow accepts in a metric key


# ---------------------------------------------------------------------------------------------
# TensorBoard


class TensorBoardTracker(Tracker):
    """``<logdir>/<study>/<trial>/``: one event directory per trial (scalars at their steps, the config as
    HParams with the trial's last metrics), readable by ``tensorboard --logdir <logdir>``."""

    def __init__(self, logdir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer_cls = SummaryWriter
        self.logdir = Path(logdir)
        self.study_dir = self.logdir
        self.writers: dict[str, Any] = {}
        self.configs: dict[str, dict[str, Any]] = {}
        self.last: dict[str, dict[str, float]] = {}

    def start_study(self, name: str, params: Mapping[str, Any]) -> None:
        self.study_dir = self.logdir / re.sub(r"[^\w\-.]", "_", name)
        w = self._writer_cls(str(self.study_dir))
        w.add_text("study", "\n".join(f"{k}: {v}" for k, v in params.items()) or name, 0)
        w.close()

    def log_point(self, trial: str, config: Mapping[str, Any], step: int, metrics: Mapping[str, float]) -> None:
        w = self.writers.get(trial)
        if w is None:
            w = self.writers[trial] = self._writer_cls(str(self.study_dir / trial))
            self.configs[trial] = dict(config)
        for k, v in metrics.items():
            w.add_scalar(k, float(v), step)
        self.last.setdefault(trial, {}).update({k: float(v) for k, v in metrics.items()})

    def end_trial(self, trial: str, status: TrialEnd) -> None:
        from torch.utils.tensorboard.summary import hparams

        w = self.writers.pop(trial, None)
        if w is None:
            return
        hp = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in self.configs[trial].items()}
        # the metric names are the scalars the HParams dashboard reads from this run
        exp, ssi, sei = hparams({**hp, "status": status}, dict(self.last.get(trial, {})))  # type: ignore[no-untyped-call]
        for summary in (exp, ssi, sei):
            w.file_writer.add_summary(summary)
        w.close()

    def close(self) -> None:
        for trial in list(self.writers):
            self.end_trial(trial, "FINISHED")
