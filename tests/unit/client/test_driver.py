"""The driver runs pure tuners against a study (here an in-memory master): ASHA's decisions on the
live run match the reference implementation, Stop cancels outstanding work, failures become ``Failed``
events, and other errors stop the run."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from stagetree.client.driver import drive
from stagetree.client.sdk import Study
from stagetree.client.spaces import GridSearchSpace, LogUniform, RandomSearchSpace
from stagetree.client.tuners import ASHA, PBT, Failed, Result, Submit, Tuner
from stagetree.client.tuners.base import Action, Trial
from stagetree.core import errors as e
from stagetree.core.config import Config
from tests.sim.asha_check import check_asha_trace
from tests.unit.client.fakes import FakeMaster, FakeRpcError, fake_client


async def _study(master: FakeMaster) -> Study:
    return await Study.create(fake_client(master), "s", trainer="pkg.mod:Net", tuned=["lr"])


def _asha(max_trials: int = 30) -> ASHA:
    space = RandomSearchSpace({"lr": LogUniform(1e-3, 1.0)}, seed=3)
    return ASHA(space, metric="acc", eta=3, min_step=1, max_step=27, max_concurrent=6, max_trials=max_trials)


async def test_asha_on_a_live_study_matches_the_reference_and_batches_submits() -> None:
    master = FakeMaster()
    study = await _study(master)
    tuner = _asha()
    run = await drive(study, tuner)
    assert tuner.finished
    problems = check_asha_trace(
        run.trace, metric="acc", mode="max", eta=3, min_step=1, max_step=27, max_concurrent=6, max_trials=30
    )
    assert problems == []
    submits = [a for _, acts in run.trace for a in acts if isinstance(a, Submit)]
    assert len(run.jobs) == len(submits) and len(submits) > 30  # promotions happened
    assert study.client.rpcs["SubmitRequests"] < len(submits)  # the initial six went out together


async def test_failures_become_failed_events() -> None:
    master = FakeMaster()
    master.fail_if = lambda c, step: float(c.values_at(0)["lr"]) < 0.05 and step > 1  # type: ignore[arg-type]
    study = await _study(master)
    run = await drive(study, _asha())
    failed = [ev for ev, _ in run.trace if isinstance(ev, Failed)]
    assert failed and all("boom" in f.error for f in failed)
    problems = check_asha_trace(
        run.trace, metric="acc", mode="max", eta=3, min_step=1, max_step=27, max_concurrent=6, max_trials=30
    )
    assert problems == []


class _StopTheSlowOne(Tuner):
    """Trial 0 to step 1 and trial 1 to step 100; the first result stops trial 1."""

    def __init__(self) -> None:
        super().__init__("acc", "max")

    def _on_start(self) -> list[Action]:
        a = self._new_trial({"lr": Config.of({"lr": 0.01}).sequence("lr")})
        b = self._new_trial({"lr": Config.of({"lr": 0.02}).sequence("lr")})
        return [self._submit(a, 1), self._submit(b, 100)]

    def _on_result(self, trial: Trial, step: int) -> list[Action]:
        return self._stop(self.trials[1]) if trial.trial_id == 0 else []

    def _on_failure(self, trial: Trial) -> list[Action]:
        return []


async def test_stop_cancels_the_outstanding_eval() -> None:
    master = FakeMaster()
    master.stuck_if = lambda _c, step: step == 100
    study = await _study(master)
    run = await drive(study, _StopTheSlowOne())
    (cancel,) = master.calls["CancelRequest"]
    assert master._configs[cancel.request_id][1] == 100
    assert [(j.trial_id, j.cancelled) for j in run.jobs] == [(0, False), (1, True)]
    assert [type(ev) for ev, _ in run.trace][1:] == [Result]


async def test_pbt_exploits_continue_from_the_source_prefix() -> None:
    master = FakeMaster()
    study = await _study(master)
    space = GridSearchSpace({"lr": [0.001, 0.01, 0.03, 0.1]})
    tuner = PBT(space, metric="acc", population=4, interval=5, max_step=15, quantile=0.25, seed=1)
    await drive(study, tuner)
    assert tuner.exploits
    for child, src, step in tuner.exploits:
        sent = [
            json.loads(it.config_json)["tuned"]["lr"]
            for r in master.calls["SubmitRequests"]
            for it in r.items
            if it.step > step
        ]
        child_cfg = Config.of(tuner.trials[child].config)
        src_cfg = Config.of(tuner.trials[src].config)
        assert child_cfg.values_at(step - 1) == src_cfg.values_at(step - 1)  # same prefix: a branch at `step`
        assert any(s.get("kind") == "piecewise" for s in sent)


async def test_other_errors_stop_the_run() -> None:
    master = FakeMaster()
    study = await _study(master)
    master.errors["SubmitRequests"].append(FakeRpcError(grpc.StatusCode.PERMISSION_DENIED, "not yours"))
    with pytest.raises(e.PermissionDenied, match="not yours"):
        await drive(study, _asha())


async def test_progress_shows_the_run_and_each_failed_trial_once(capsys: pytest.CaptureFixture[str]) -> None:
    master = FakeMaster()
    master.fail_if = lambda c, step: float(c.values_at(0)["lr"]) < 0.05 and step > 1  # type: ignore[arg-type]
    study = await _study(master)
    tuner = _asha()
    run = await drive(study, tuner, progress=True)
    err = capsys.readouterr().err
    failed = {ev.trial_id for ev, _ in run.trace if isinstance(ev, Failed)}
    assert failed
    for t in failed:
        assert err.count(f"✗ trial {t} failed (lr=") == 1, err  # once each, with its config
    assert "boom" in err
    assert "s: trials" in err and f"/{tuner.max_trials}" in err  # the bar counts trials of the planned number
    assert f"best acc {tuner.best().value:.4g}" in err  # type: ignore[union-attr]


async def test_without_progress_nothing_is_drawn(capsys: pytest.CaptureFixture[str]) -> None:
    run = await drive(await _study(FakeMaster()), _asha(), progress=False)
    assert run.jobs and capsys.readouterr().err == ""


async def test_ctrl_c_stops_the_run_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import signal

    master = FakeMaster()
    master.stuck_if = lambda _c, step: step >= 9  # the upper rungs never finish: the run is still going
    study = await _study(master)
    before = signal.getsignal(signal.SIGINT)

    async def interrupt_once_stuck() -> None:  # Ctrl-C once work that never finishes reached the master
        while not any(i.step >= 9 for r in master.calls["SubmitRequests"] for i in r.items):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    tuner = _asha()
    ctrl_c = asyncio.create_task(interrupt_once_stuck())
    run = await drive(study, tuner, progress=False)
    await ctrl_c
    assert run.interrupted and not any(t.status == "running" for t in tuner.trials.values())
    assert master.calls["CancelRequest"]  # the outstanding evals were cancelled on the master
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("stopped by Ctrl-C: cancelled ") and "To resume" in lines[-1]
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C is the caller's again
