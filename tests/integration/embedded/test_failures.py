"""A trainer that raises, in embedded mode with real workers: the request fails on its first attempt
with the traceback and the worker's log path, everywhere the user looks (the SDK's EvalFailed, REST, the
CLI); a study that asks retries it; a metric that comes back NaN is reported as such, with its step."""

from __future__ import annotations

import asyncio
import json
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

import stagetree
from stagetree.client import cli
from stagetree.client.sdk import EvalFailed
from stagetree.core.sequences import Constant
from stagetree.embedded import Embedded, EmbeddedSettings
from stagetree.master.store import models as m

TRAINERS = """
from stagetree.nodemanager.examples.digits import DigitsMLP


def check_the_batch(step):
    if step >= 2:
        raise RuntimeError(f"exploded on purpose at step {step}")


class Exploding(DigitsMLP):
    def train(self):
        check_the_batch(self.step)
        super().train()


class Diverging(DigitsMLP):
    def evaluate(self):
        out = super().evaluate()
        return {**out, "loss": float("nan")}
"""
CFG = {"lr": Constant(0.1), "bs": Constant(32)}


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory with the user's trainer module, on the workers' path as on the user's."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "flaky_trainers.py").write_text(textwrap.dedent(TRAINERS))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    yield root


def _get(cluster: Embedded, path: str) -> object:  # off the event loop: the REST server runs on it
    req = urllib.request.Request(
        f"{cluster.http_url}/api/v1{path}", headers={"Authorization": f"Bearer {cluster.token}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _failures(cluster: Embedded, study_id: str) -> list[int]:
    with cluster.app.store.db.tx("test: failures") as s:
        return [int(f) for f in s.scalars(select(m.Request.failures).where(m.Request.study_id == study_id))]


async def test_a_trainer_that_raises_fails_once_with_its_traceback(user_dir: Path, tmp_path: Path) -> None:
    settings = EmbeddedSettings(home=tmp_path / "home", workers=1, http_port=0)
    async with Embedded(settings) as cluster, stagetree.connect(cluster.target, token=cluster.token) as client:
        study = await stagetree.Study.create(
            client, "explodes", trainer="flaky_trainers:Exploding", values={"hidden": 16}, tuned=["lr", "bs"]
        )
        with pytest.raises(EvalFailed) as err:
            await study.eval(CFG, 5)
        text = err.value.message
        assert "RuntimeError: exploded on purpose at step 2" in text
        assert "in check_the_batch" in text and "in train" in text  # the traceback, down to the raise
        assert "worker log: " in text and "batch-" in text
        log_path = Path(text.split("worker log: ", 1)[1].split(" on node manager", 1)[0])
        assert "Traceback (most recent call last)" in log_path.read_text()  # the whole story in the log
        assert _failures(cluster, study.id) == [1]  # failed on its first attempt: no retry of a user error

        (rest,) = await asyncio.to_thread(_get, cluster, f"/studies/{study.id}/requests")
        assert rest["state"] == "FAILED" and "in check_the_batch" in rest["error"]
        parsed = cli._parser().parse_args(["study", "show", study.id])
        _doc, shown, _ = await asyncio.to_thread(cli.run, parsed, cli.RestClient(cluster.http_url, cluster.token))
        assert "failed    1 request(s)" in shown and "exploded on purpose at step 2" in shown

        retried = await stagetree.Study.create(
            client,
            "retries",
            trainer="flaky_trainers:Exploding",
            values={"hidden": 17},
            tuned=["lr", "bs"],
            retry_user_errors=True,
        )
        with pytest.raises(EvalFailed):
            await retried.eval(CFG, 5)
        assert _failures(cluster, retried.id) == [cluster.app.settings.scheduling.max_attempts]


async def test_a_diverging_metric_is_reported_with_its_step(user_dir: Path, tmp_path: Path) -> None:
    async with (
        Embedded(EmbeddedSettings(home=tmp_path / "home", workers=1)) as cluster,
        stagetree.connect(cluster.target, token=cluster.token) as client,
    ):
        study = await stagetree.Study.create(client, "nan", trainer="flaky_trainers:Diverging", tuned=["lr", "bs"])
        with pytest.raises(EvalFailed, match=r"evaluate\(\) returned loss=nan at step 3: the training diverged"):
            await study.eval(CFG, 3)
        assert _failures(cluster, study.id) == [1]


async def test_a_trainer_the_workers_cannot_import_is_refused_at_creation(user_dir: Path, tmp_path: Path) -> None:
    async with (
        Embedded(EmbeddedSettings(home=tmp_path / "home", workers=1)) as cluster,
        stagetree.connect(cluster.target, token=cluster.token) as client,
    ):
        with pytest.raises(stagetree.InvalidArgument) as err:
            await stagetree.Study.create(client, "typo", trainer="flaky_trainerz:Exploding", tuned=["lr", "bs"])
        assert "no module named 'flaky_trainerz' on the workers' search path" in err.value.message
        assert "PYTHONPATH" in err.value.message
        ok = await stagetree.Study.create(client, "fine", trainer="flaky_trainers:Exploding", tuned=["lr", "bs"])
        assert ok.fixed is not None and ok.fixed.code_version.startswith("src-")  # digested from user_dir
