"""The user's own tools against a real embedded study: a ``TorchTrainer`` trained by worker processes,
trials proposed by Optuna's TPE through the bridge with ASHA promotions, logged live to MLflow by the
driver callback and afterwards from the stored metrics to MLflow and TensorBoard (read back from a
local MLflow file store and the event files), and exported to an Optuna SQLite storage; meanwhile the
Prometheus ``/metrics`` of the master (with the embedded node manager's and aggregator's) are scraped
before, during and after, and must have moved."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

import stagetree  # noqa: E402
from stagetree.client.spaces import Choice, Family, LogUniform  # noqa: E402
from stagetree.core.sequences import Cosine, Exponential, MultiStep, Warmup  # noqa: E402
from stagetree.embedded import Embedded, EmbeddedSettings  # noqa: E402
from stagetree.integrations.optuna import OptunaSpace, OptunaTuner, export_to_optuna  # noqa: E402
from stagetree.integrations.records import study_trials, tuner_configs  # noqa: E402
from stagetree.integrations.trackers import (  # noqa: E402
    MlflowTracker,
    TensorBoardTracker,
    TrackerCallback,
    log_study,
)
from stagetree.nodemanager.examples.torch_digits import ENTRY_POINT  # noqa: E402

pytestmark = pytest.mark.slow


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
NM = "embedded"  # the embedded node manager's id (other node managers of this process have their own)


async def scrape(base: str) -> Samples:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient() as http:
        r = await http.get(f"{base}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            out[key] = out.get(key, 0.0) + s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the samples of ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


async def watch_busy(base: str, done: asyncio.Event) -> float:
    seen = 0.0
    while not done.is_set():
        seen = max(seen, value(await scrape(base), "stagetree_nm_slots_busy", node_manager=NM))
        await asyncio.sleep(0.02)  # a batch of this study can be over in a few tenths of a second
    return seen


def space() -> OptunaSpace:
    decay = Choice(
        [
            Family(Cosine, init=LogUniform(0.05, 0.3), min_value=0.001, period=12),
            Family(Exponential, init=LogUniform(0.05, 0.3), gamma=0.9),
        ]
    )
    lr = Family(Warmup, init=0.01, period=1, then=decay)
    return OptunaSpace({"lr": lr, "momentum": 0.9, "bs": Choice([32, MultiStep(32, [3], 2)])}, grid=3)


async def test_optuna_tpe_with_asha_logged_to_mlflow_and_tensorboard(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    mlruns = f"file://{tmp_path / 'mlruns'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tuner = OptunaTuner(
        space(), optuna.samplers.TPESampler(seed=0, n_startup_trials=3), metric="accuracy", n_trials=6,
        min_step=2, max_step=6, eta=3, max_concurrent=2,
    )  # fmt: skip
    live = MlflowTracker(mlruns, experiment="live")
    async with (
        Embedded(EmbeddedSettings(home=tmp_path / "home", workers=2, http_port=0)) as cluster,
        stagetree.connect(cluster.target, token=cluster.token) as client,
    ):
        study = await stagetree.Study.create(
            # 200 minibatches a step: batches long enough that a scrape every few tens of milliseconds sees
            # a slot busy on a loaded machine (with 2, a batch trained for a few milliseconds)
            client, "tools", trainer=ENTRY_POINT, seed=0, values={"hidden": 16, "minibatches": 200},
            tuned=["lr", "momentum", "bs"],
        )  # fmt: skip
        before = await scrape(cluster.http_url)
        watching = asyncio.Event()
        busy_seen = asyncio.create_task(watch_busy(cluster.http_url, watching))
        run = await asyncio.wait_for(stagetree.drive(study, tuner, on_event=TrackerCallback(live, "tools")), 240)
        watching.set()
        max_busy = await busy_seen
        after = await scrape(cluster.http_url)
        plan_only = await study_trials(study)
        configs = tuner_configs(tuner)
        trials = await study_trials(study, configs, curves=True)
        n_mlflow = await log_study(study, MlflowTracker(mlruns, experiment="stored"), configs=configs)
        n_tb = await log_study(study, TensorBoardTracker(tmp_path / "tb"), configs=configs)
    assert tuner.finished and len(tuner.trials) == 6 and n_mlflow == n_tb == 6

    # Prometheus: the master's /metrics (in the embedded mode the node manager's and aggregator's too) moved
    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("stagetree_master_round_seconds_count") > 0
    assert moved("stagetree_master_batches_dispatched_total") > 0
    assert moved("stagetree_master_assignment_latency_seconds_count") > 0
    assert value(after, "stagetree_master_requests", state="DONE") >= len(run.submits()) - 1
    assert value(after, "stagetree_master_slots") == 2 and value(after, "stagetree_nm_slots", node_manager=NM) == 2
    assert moved("stagetree_aggregator_messages_applied_total") > 0
    assert moved("stagetree_aggregator_metric_points_total") > 0
    assert moved("stagetree_nm_worker_events_total", kind="metrics") > 0
    assert moved("stagetree_nm_attempts_total", status="finished") > 0
    assert moved("stagetree_nm_checkpoint_bytes_total") > 0 and value(after, "stagetree_master_checkpoint_bytes") > 0
    assert max_busy >= 1  # seen during the study
    assert value(after, "stagetree_aggregator_consumer_lag") >= 0
    assert {s.step for s in run.submits()} == {2, 6}

    # the stored trials are the tuner's trials: same labels, same metrics at the same steps
    by_label = {t.label: t for t in trials}
    for t in tuner.trials.values():
        rec = by_label[f"trial-{t.trial_id}"]
        assert rec.config == t.config and rec.points == {s: pytest.approx(m) for s, m in t.results.items()}
    # without the tuner's configs, the plan's: exact up to each trial's last evaluated step
    for rec in plan_only:
        full, last = by_label[rec.label].config, rec.last_step()
        assert rec.config is not None and full is not None and last is not None
        assert all(rec.config[n].value(s) == full[n].value(s) for n in full for s in range(last))

    # MLflow: a study run, one nested run per trial, each with its config and one point per evaluated step
    from mlflow.tracking import MlflowClient

    client_ml = MlflowClient(tracking_uri=mlruns)
    for name in ("live", "stored"):
        exp = client_ml.get_experiment_by_name(name)
        runs = client_ml.search_runs([exp.experiment_id])
        parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
        assert len(parents) == 1 and len(children) == 6
        for r in children:
            rec = by_label[r.data.tags["stagetree.trial"]]
            assert r.data.params["lr"] == repr(rec.config["lr"]) and r.info.status == "FINISHED"
            history = client_ml.get_metric_history(r.info.run_id, "accuracy")
            assert {(m.step, round(m.value, 6)) for m in history} == {
                (s, round(m["accuracy"], 6)) for s, m in rec.points.items()
            }
            if name == "stored":  # the learning curve too, as step/<name>, apart from the evaluations
                history = client_ml.get_metric_history(r.info.run_id, "step/loss")
                assert rec.curve and {(m.step, round(m.value, 6)) for m in history} == {
                    (s, round(v["loss"], 6)) for s, v in rec.curve
                }

    # TensorBoard: one event directory per trial with the accuracy curve
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for label, rec in by_label.items():
        acc = EventAccumulator(str(tmp_path / "tb" / "tools" / label))
        acc.Reload()
        scalars = {(e.step, round(e.value, 5)) for e in acc.Scalars("accuracy")}
        assert scalars == {(s, round(m["accuracy"], 5)) for s, m in rec.points.items()}

    # Optuna: the export loads back with the same best value
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    export_to_optuna(trials, storage=url, study_name="tools", metric="accuracy")
    loaded = optuna.load_study(study_name="tools", storage=url)
    best = tuner.best()
    assert best is not None and loaded.best_value == pytest.approx(best.value)
