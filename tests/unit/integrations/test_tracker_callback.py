"""``TrackerCallback`` turns a driver's events into tracker calls: a run per trial opened at its first
result with its config, one point per result, ended FINISHED / FAILED / KILLED, the study closed at Finish."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stagetree.client.tuners.base import Failed, Finish, Result, Start, Stop, Submit
from stagetree.core.sequences import Constant, MultiStep
from stagetree.integrations.trackers import Tracker, TrackerCallback, TrialEnd


class Recorder(Tracker):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def start_study(self, name: str, params: Mapping[str, Any]) -> None:
        self.calls.append(("study", name, dict(params)))

    def log_point(self, trial: str, config: Mapping[str, Any], step: int, metrics: Mapping[str, float]) -> None:
        self.calls.append(("point", trial, dict(config), step, dict(metrics)))

    def end_trial(self, trial: str, status: TrialEnd) -> None:
        self.calls.append(("end", trial, status))

    def close(self) -> None:
        self.calls.append(("close",))


def test_events_become_runs_points_and_ends() -> None:
    rec = Recorder()
    cb = TrackerCallback(rec, "sweep", {"tuner": "asha"})
    a = {"lr": MultiStep(0.1, [5], 0.5), "bs": Constant(32)}
    b = {"lr": Constant(0.2), "bs": Constant(64)}
    c = {"lr": Constant(0.3), "bs": Constant(64)}
    cb(Start(), [Submit(0, a, 3), Submit(1, b, 3), Submit(2, c, 3)])
    cb(Result(0, 3, {"acc": 0.5}), [Submit(0, a, 9), Stop(1)])
    cb(Failed(2, "diverged"), [])
    cb(Result(0, 9, {"acc": 0.7}), [Finish()])
    assert rec.calls == [
        ("study", "sweep", {"tuner": "asha"}),
        ("point", "trial-0", {"bs": 32, "lr": repr(a["lr"])}, 3, {"acc": 0.5}),
        ("end", "trial-1", "KILLED"),
        ("end", "trial-2", "FAILED"),
        ("point", "trial-0", {"bs": 32, "lr": repr(a["lr"])}, 9, {"acc": 0.7}),
        ("end", "trial-0", "FINISHED"),
        ("close",),
    ]
