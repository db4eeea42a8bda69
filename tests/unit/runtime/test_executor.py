"""``run_batch`` in-process with the real digits trainer, real files and real torch state."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stagetree.core.batch import Point, Source
from stagetree.core.config import Config
from stagetree.core.sequences import Linear, MultiStep, Value, Warmup
from stagetree.nodemanager.examples.digits import DigitsMLP, digits_batch
from stagetree.nodemanager.examples.faults import ENTRY_POINT as FAULTY
from stagetree.nodemanager.examples.faults import FaultyDigits
from stagetree.nodemanager.runtime.checkpoints import CheckpointStore, LocalCheckpointStore, StoredCheckpoint
from stagetree.nodemanager.runtime.executor import BatchRun, constant_until, run_batch

FIXED = {"dropout": 0.2, "hidden": 32}  # dropout: the torch RNG must be restored too
HP: dict[str, Any] = {"lr": MultiStep(0.2, [12], 0.5), "momentum": 0.9, "bs": MultiStep(16, [15], 2)}
HP_CHILD_A: dict[str, Any] = {"lr": 0.05, "momentum": 0.9, "bs": 16}
HP_CHILD_B: dict[str, Any] = {"lr": 0.3, "momentum": 0.5, "bs": 48}


def _run(spec: Any, store: CheckpointStore, events: Any, trainer: Callable[[], Any] = DigitsMLP, **kw: Any) -> Any:
    outcome = run_batch(spec, trainer, store, events, **kw)
    assert outcome.status == "finished", events.of("batch_failed")
    return outcome


def _close(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], abs=1e-6), (k, a, b)


def test_thirty_straight_equals_ten_resume_twenty_across_a_batch_size_change(store, make_events) -> None:
    straight = make_events()
    _run(digits_batch([(1, 0, 30, HP)], fixed_values=FIXED, evals=[(1, 30)]), store, straight)

    head = make_events()
    _run(digits_batch([(1, 0, 10, HP)], fixed_values=FIXED, saves=[(1, 10)], batch_id=2), store, head)
    uri = head.checkpoint_at(10)["uri"]
    torch.manual_seed(999)  # whatever the process did in between must not matter
    tail = make_events()
    spec = digits_batch(
        [(1, 10, 30, HP)], fixed_values=FIXED, source=Source(Point(1, 10), uri), evals=[(1, 30)], batch_id=3
    )
    outcome = _run(spec, store, tail)
    assert outcome.steps_trained == 20 and tail.of("batch_finished") == [{"batch_id": 3, "attempt": 1, "steps": 20}]
    _close(tail.metrics_at(30), straight.metrics_at(30))
    # and the run really learns: the comparison is not between two untrained models
    assert straight.metrics_at(30)["accuracy"] > 0.5


class _SlowStore(CheckpointStore):
    """Delays every write: training goes on meanwhile, so a snapshot that shares tensors with the
    live trainer would be written with later weights."""

    def __init__(self, inner: LocalCheckpointStore, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def put(self, key: str, write: Callable[[Path], None]) -> StoredCheckpoint:
        time.sleep(self.delay_s)
        return self.inner.put(key, write)

    def open(self, uri: str) -> Any:
        return self.inner.open(uri)

    def exists(self, uri: str) -> bool:
        return self.inner.exists(uri)

    def delete(self, uri: str) -> None:
        self.inner.delete(uri)

    @property
    def location(self) -> str:
        return self.inner.location


def test_siblings_from_one_background_branch_checkpoint_match_straight_runs(store, make_events) -> None:
    slow = _SlowStore(store, delay_s=0.3)
    parent = make_events()
    # the parent goes on training 20 steps past the branch point while the checkpoint is written
    _run(digits_batch([(1, 0, 30, HP)], fixed_values=FIXED, saves=[(1, 10)]), slow, parent)
    ckpt = parent.checkpoint_at(10)
    assert ckpt["kind"] == "central" and ckpt["node"] == 1 and ckpt["bytes"] > 0
    assert parent.kinds().index("checkpoint_saved") > parent.kinds().index("progress")

    results = {}
    for node, hp in ((2, HP_CHILD_A), (3, HP_CHILD_B)):
        child = make_events()
        spec = digits_batch(
            [(node, 10, 25, hp)],
            fixed_values=FIXED,
            source=Source(Point(1, 10), ckpt["uri"]),
            evals=[(node, 25)],
            batch_id=10 + node,
        )
        _run(spec, store, child)
        straight = make_events()
        spec = digits_batch(
            [(1, 0, 10, HP), (node, 10, 25, hp)], fixed_values=FIXED, evals=[(node, 25)], batch_id=20 + node
        )
        _run(spec, store, straight)
        _close(child.metrics_at(25), straight.metrics_at(25))
        results[node] = child.metrics_at(25)
    assert results[2] != results[3]


class _Recording(DigitsMLP):
    calls: list[tuple[int, dict[str, Value]]]

    def init(self) -> None:
        super().init()
        self.calls = []

    def setup(self, hp_changes: dict[str, Value]) -> None:
        self.calls.append((getattr(self, "step", -1), dict(hp_changes)))
        super().setup(hp_changes)

    def train(self) -> None:
        super().train()
        self.step += 1  # so the next setup call records the step it precedes


def test_setup_is_called_only_on_changes(store, make_events) -> None:
    trainers: list[_Recording] = []

    def factory() -> _Recording:
        trainers.append(_Recording())
        return trainers[-1]

    hp = {"lr": MultiStep(0.1, [5, 7], 0.5), "bs": 16}
    # a stage boundary at 9 where only bs changes; the child's lr continues the parent's
    child = {"lr": MultiStep(0.1, [5, 7], 0.5), "bs": 32}
    events = make_events()
    spec = digits_batch([(1, 0, 9, hp), (2, 9, 12, child)], saves=[(2, 10)])
    _run(spec, store, events, factory)
    assert trainers[0].calls == [
        (0, {"bs": 16, "lr": 0.1}),
        (5, {"lr": 0.05}),
        (7, {"lr": 0.025}),
        (9, {"bs": 32}),
    ]
    uri = events.checkpoint_at(10)["uri"]
    spec = digits_batch([(2, 10, 12, child)], source=Source(Point(2, 10), uri), batch_id=5)
    _run(spec, store, make_events(), factory)
    assert trainers[-1].calls == [(10, {"bs": 32, "lr": 0.025})]  # everything after a restore


def test_peripheral_checkpoints_every_n_steps_and_resume_from_one(store, make_events) -> None:
    events = make_events()
    spec = digits_batch(
        [(1, 0, 35, HP)], fixed_values=FIXED, saves=[(1, 15)], evals=[(1, 35)], peripheral_every_steps=10
    )
    _run(spec, store, events)
    saved = [(p["step"], p["kind"]) for p in events.of("checkpoint_saved")]
    # the count restarts at the central one; none at the batch's end
    assert saved == [(10, "peripheral"), (15, "central"), (25, "peripheral")]
    resumed = make_events()
    uri = events.checkpoint_at(25)["uri"]
    spec = digits_batch(
        [(1, 25, 35, HP)], fixed_values=FIXED, source=Source(Point(1, 25), uri), evals=[(1, 35)], batch_id=2
    )
    _run(spec, store, resumed)
    _close(resumed.metrics_at(35), events.metrics_at(35))


def test_peripheral_checkpoints_by_time(store, make_events) -> None:
    events = make_events()
    fixed = {"sleep_s": 0.02}
    spec = digits_batch([(1, 0, 20, HP)], fixed_values=fixed, trainer=FAULTY, peripheral_every_s=0.1)
    _run(spec, store, events, FaultyDigits)
    steps = [p["step"] for p in events.of("checkpoint_saved")]
    assert all(p["kind"] == "peripheral" for p in events.of("checkpoint_saved"))
    assert len(steps) >= 2 and 20 not in steps  # 20 steps of >= 20 ms: at least 0.4 s


def test_preemption_saves_and_resume_matches_straight(store, make_events) -> None:
    straight = make_events()
    _run(digits_batch([(1, 0, 30, HP)], fixed_values=FIXED, evals=[(1, 30)]), store, straight)

    preempted = make_events()
    spec = digits_batch([(1, 0, 30, HP)], fixed_values=FIXED, evals=[(1, 30)], batch_id=2)
    flag = {"stop": False}

    def on_progress(kind: str, payload: dict[str, Any]) -> None:
        if kind == "progress" and payload["step"] == 17:
            flag["stop"] = True

    preempted._on_emit = on_progress
    outcome = run_batch(spec, DigitsMLP, store, preempted, lambda: flag["stop"])
    assert outcome.status == "preempted" and outcome.step == 17
    (stop,) = preempted.of("batch_preempted")
    assert stop["step"] == 17 and stop["node"] == 1
    assert preempted.checkpoint_at(17) == {**preempted.checkpoint_at(17), "kind": "peripheral", "uri": stop["uri"]}
    assert "batch_finished" not in preempted.kinds() and "metrics" not in preempted.kinds()

    resumed = make_events()
    spec = digits_batch(
        [(1, 17, 30, HP)], fixed_values=FIXED, source=Source(Point(1, 17), stop["uri"]), evals=[(1, 30)]
    )
    _run(spec, store, resumed)
    _close(resumed.metrics_at(30), straight.metrics_at(30))


def test_extra_saves_and_evals_inside_a_batch_do_not_perturb_training(store, make_events) -> None:
    plain = make_events()
    _run(digits_batch([(1, 0, 20, HP)], fixed_values=FIXED, evals=[(1, 20)]), store, plain)
    events = make_events()
    spec = digits_batch(
        [(1, 0, 20, HP)], fixed_values=FIXED, saves=[(1, 5), (1, 8)], evals=[(1, 9), (1, 20)], batch_id=2
    )
    assert BatchRun(spec, DigitsMLP, store, events).run().status == "finished"
    assert [p["step"] for p in events.of("checkpoint_saved")] == [5, 8]
    assert [p["step"] for p in events.of("metrics")] == [9, 20]
    _close(events.metrics_at(20), plain.metrics_at(20))  # dropout RNG untouched by the extra eval


@pytest.mark.parametrize(
    ("fault", "oom"),
    [("raise", False), ("cuda_oom", True), ("runtime_oom", True), ("memory_error", True)],
)
def test_user_errors_become_batch_failed(store, make_events, fault: str, oom: bool) -> None:
    events = make_events()
    spec = digits_batch(
        [(1, 0, 10, HP)], trainer=FAULTY, fixed_values={"fault": fault, "fault_step": 4}, saves=[(1, 3)]
    )
    outcome = run_batch(spec, FaultyDigits, store, events)
    assert outcome.status == "failed" and outcome.oom is oom and outcome.step == 4
    (failed,) = events.of("batch_failed")
    assert failed["oom"] is oom
    assert "injected" in failed["error"] and "Traceback" in failed["traceback"]
    assert "faults.py" in failed["traceback"]  # points at the user's code
    assert "batch_finished" not in events.kinds()
    assert [p["step"] for p in events.of("checkpoint_saved")] == [3]  # the good one is still reported
    assert events.kinds()[-1] == "batch_failed"


def test_failed_checkpoint_write_fails_the_batch(tmp_path: Path, make_events) -> None:
    class Broken(LocalCheckpointStore):
        def put(self, key: str, write: Callable[[Path], None]) -> StoredCheckpoint:
            raise OSError("No space left on device")

    events = make_events()
    spec = digits_batch([(1, 0, 10, HP)], saves=[(1, 5)])
    outcome = run_batch(spec, DigitsMLP, Broken(tmp_path), events)
    assert outcome.status == "failed" and not outcome.oom
    assert "No space left" in events.of("batch_failed")[0]["error"]


class _FileSaving(DigitsMLP):
    """Overrides save/load: checkpointed synchronously, through the user's own files."""

    def save(self, directory: Path) -> None:
        torch.save(self.model.state_dict(), directory / "model.pt")
        torch.save(self.optimizer.state_dict(), directory / "opt.pt")
        torch.save(self.loader.state_dict(), directory / "loader.pt")

    def load(self, directory: Path) -> None:
        self.model.load_state_dict(torch.load(directory / "model.pt", weights_only=True))
        self.optimizer.load_state_dict(torch.load(directory / "opt.pt", weights_only=True))
        self.loader.load_state_dict(torch.load(directory / "loader.pt", weights_only=True))


def test_trainer_with_its_own_save_and_load_resumes_exactly(store, make_events) -> None:
    assert DigitsMLP.snapshots_in_memory() and not _FileSaving.snapshots_in_memory()
    straight = make_events()
    _run(digits_batch([(1, 0, 20, HP)], fixed_values=FIXED, evals=[(1, 20)]), store, straight, _FileSaving)
    head = make_events()
    _run(digits_batch([(1, 0, 8, HP)], fixed_values=FIXED, saves=[(1, 8)]), store, head, _FileSaving)
    uri = head.checkpoint_at(8)["uri"]
    with store.open(uri) as d:
        assert sorted(p.name for p in (d / "user").iterdir()) == ["loader.pt", "model.pt", "opt.pt"]
    tail = make_events()
    spec = digits_batch([(1, 8, 20, HP)], fixed_values=FIXED, source=Source(Point(1, 8), uri), evals=[(1, 20)])
    _run(spec, store, tail, _FileSaving)
    _close(tail.metrics_at(20), straight.metrics_at(20))


def test_event_order_of_a_finished_batch(store, make_events) -> None:
    events = make_events()
    spec = digits_batch([(1, 0, 3, HP)], saves=[(1, 3)], evals=[(1, 0), (1, 3)], batch_id=7, attempt=2)
    _run(spec, store, events)
    kinds = events.kinds()
    # the step metrics go out every 0.25 s and before the batch ends: before or after the last save
    assert kinds.count("curve") == 1 and kinds.index("curve") < kinds.index("batch_finished")
    assert [k for k in kinds if k != "curve"] == [
        "batch_started",
        "metrics",
        "progress",
        "progress",
        "progress",
        "metrics",
        "checkpoint_saved",
        "batch_timing",
        "batch_finished",
    ]
    assert [p["step"] for p in events.of("progress")] == [1, 2, 3]
    assert [s for s, _ in events.of("curve")[0]["points"]] == [1, 2, 3]
    assert all(p["batch_id"] == 7 and p["attempt"] == 2 for _, p in events.items)


@pytest.mark.parametrize(
    "hps",
    [
        {"lr": MultiStep(0.1, [5, 9], 0.5), "bs": MultiStep(16, [7], 2)},
        {"lr": Linear(0.1, -0.001), "bs": 32},
        {"lr": Warmup(0.0, 6, MultiStep(0.1, [20], 0.1)), "bs": 8},
    ],
)
def test_constant_until_never_skips_a_change(hps: dict[str, Any]) -> None:
    config = Config.of(hps)
    for s in range(40):
        until = constant_until(config, s)
        assert until > s
        for t in range(s, int(min(until, 45))):
            assert config.values_at(t) == config.values_at(s), (s, t, until)
        if until < 45:
            assert config.values_at(int(until)) != config.values_at(s) or until == s + 1


class _SlowSteps(DigitsMLP):
    """Slow to build and to step, so where the time went shows above the machine's noise."""

    def init(self) -> None:
        time.sleep(0.3)
        super().init()

    def train(self) -> Any:
        time.sleep(0.05)
        return super().train()


@pytest.mark.parametrize("background", [True, False])
def test_the_attempts_time_is_split_into_start_up_checkpoint_io_and_training_without_overlap(
    store: LocalCheckpointStore, make_events: Any, background: bool
) -> None:
    slow = _SlowStore(store, delay_s=0.3)
    events = make_events()
    spec = digits_batch([(1, 0, 6, HP)], fixed_values=FIXED, saves=[(1, 3), (1, 6)], evals=[(1, 6)])
    given = time.time() - 0.5  # handed the batch half a second ago (the process start-up, say)
    _run(spec, slow, events, _SlowSteps, given_at=given, background_saves=background)
    ended = time.time()
    (t,) = events.of("batch_timing")
    assert events.kinds()[-2:] == ["batch_timing", "batch_finished"]
    assert t["given_at"] == given
    assert t["startup_s"] >= 0.5 + 0.3  # before the run, and the trainer's init
    assert t["checkpoint_s"] >= 0.3  # the last save was waited for (both, when written inline)
    if not background:
        assert t["checkpoint_s"] >= 2 * 0.3
    assert t["train_s"] >= 6 * 0.05
    # no second is counted twice: the parts fit in the attempt's life
    assert t["startup_s"] + t["checkpoint_s"] + t["train_s"] <= ended - given + 0.05


def test_a_failed_or_preempted_attempt_reports_its_time_before_it_ends(store, make_events) -> None:
    failed = make_events()
    spec = digits_batch([(1, 0, 5, HP)], trainer=FAULTY, fixed_values={"fault": "raise", "fault_step": 2})
    outcome = run_batch(spec, FaultyDigits, store, failed)
    assert outcome.status == "failed" and failed.kinds()[-2:] == ["batch_timing", "batch_failed"]
    preempted = make_events()
    outcome = run_batch(digits_batch([(1, 0, 50, HP)]), DigitsMLP, store, preempted, lambda: True)
    assert outcome.status == "preempted" and preempted.kinds()[-2:] == ["batch_timing", "batch_preempted"]
    assert preempted.of("batch_timing")[0]["train_s"] > 0
