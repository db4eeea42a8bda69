"""The worker entry point as a real subprocess: signals, exit codes, the event stream."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stagetree.core.batch import BatchSpec, Point, Source
from stagetree.nodemanager.examples.digits import digits_batch
from stagetree.nodemanager.examples.faults import ENTRY_POINT as FAULTY
from stagetree.nodemanager.examples.faults import EXIT_CODE
from stagetree.nodemanager.runtime.events import decode_event
from stagetree.nodemanager.runtime.worker import EventWriter
from tests.unit.nodemanager.fakes import ENV_RECORDER

HP = {"lr": 0.1, "momentum": 0.9, "bs": 32}
SLOW = {"sleep_s": 0.005, "dropout": 0.1}  # >= 0.75 s of training: time for a signal to arrive
STEPS = 150
_SPEC_IDS = itertools.count()


class Worker:
    def __init__(self, spec: BatchSpec, tmp: Path, *extra: str, pass_fds: tuple[int, ...] = ()) -> None:
        path = tmp / f"spec-{next(_SPEC_IDS)}.json"
        path.write_text(json.dumps(spec.to_json()))
        cmd = [sys.executable, "-m", "stagetree.nodemanager.runtime.worker", "--spec", str(path)]
        cmd += ["--checkpoint-root", str(tmp / "ckpt"), *extra]
        env = {**os.environ, "STAGETREE_WORKER_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, pass_fds=pass_fds)
        self.events: list[tuple[str, dict[str, Any]]] = []

    def read_until(self, kind: str, step: int | None = None) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            k, _ts, payload = decode_event(line)  # every line is a well-formed event
            self.events.append((k, payload))
            if k == kind and (step is None or payload.get("step", -1) >= step):
                return payload
        raise AssertionError(f"stream ended before {kind}: {[k for k, _ in self.events]}")

    def finish(self, timeout: float = 60) -> int:
        assert self.proc.stdout is not None
        out, _ = self.proc.communicate(timeout=timeout)
        self.events += [decode_event(line)[::2] for line in out.splitlines()]  # type: ignore[misc]
        return self.proc.returncode

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [p for k, p in self.events if k == kind]


def _final_metrics(w: Worker) -> dict[str, float]:
    (m,) = [p["metrics"] for p in w.of("metrics") if p["step"] == STEPS]
    return dict(m)


def test_signal_preempts_and_resume_matches_straight(tmp_path: Path) -> None:
    straight = Worker(
        digits_batch([(1, 0, STEPS, HP)], trainer=FAULTY, fixed_values=SLOW, evals=[(1, STEPS)]), tmp_path
    )
    spec = digits_batch([(1, 0, STEPS, HP)], trainer=FAULTY, fixed_values=SLOW, evals=[(1, STEPS)], batch_id=2)
    victim = Worker(spec, tmp_path)
    victim.read_until("progress", step=10)
    victim.proc.send_signal(signal.SIGTERM)
    assert victim.finish() == 0
    (stop,) = victim.of("batch_preempted")
    assert 10 <= stop["step"] < STEPS and not victim.of("batch_finished")
    assert victim.of("checkpoint_saved")[-1]["uri"] == stop["uri"]

    resume = digits_batch(
        [(1, stop["step"], STEPS, HP)],
        trainer=FAULTY,
        fixed_values=SLOW,
        source=Source(Point(1, stop["step"]), stop["uri"]),
        evals=[(1, STEPS)],
        batch_id=2,
        attempt=2,
    )
    resumed = Worker(resume, tmp_path)
    assert resumed.finish() == 0 and straight.finish() == 0
    assert resumed.of("batch_finished") == [{"batch_id": 2, "attempt": 2, "steps": STEPS - stop["step"]}]
    a, b = _final_metrics(resumed), _final_metrics(straight)
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], abs=1e-6) for k in a)


def test_crash_in_user_code_is_a_nonzero_exit_without_batch_finished(tmp_path: Path) -> None:
    crash = Worker(
        digits_batch([(1, 0, 20, HP)], trainer=FAULTY, fixed_values={"fault": "exit", "fault_step": 5}), tmp_path
    )
    failing = Worker(
        digits_batch([(1, 0, 20, HP)], trainer=FAULTY, fixed_values={"fault": "raise", "fault_step": 5}),
        tmp_path,
        "--events-fd",
        "1",
    )
    assert crash.finish() == EXIT_CODE
    kinds = [k for k, _ in crash.events]
    assert "batch_finished" not in kinds and "batch_failed" not in kinds
    # Progress is flushed at most every 50 ms (a flush per step costs too much): the lines written just
    # before os._exit may be lost, never invented.
    assert 1 <= crash.of("progress")[-1]["step"] <= 5

    assert failing.finish() == 1
    (failed,) = failing.of("batch_failed")
    assert "ValueError: injected fault" in failed["error"] and "Traceback" in failed["traceback"]
    assert failed["oom"] is False


def test_unknown_trainer_fails_the_batch_and_bad_spec_is_a_usage_error(tmp_path: Path) -> None:
    unknown = Worker(digits_batch([(1, 0, 2, HP)], trainer="no_such_module_xyz:Trainer"), tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"batch_id": 1}')
    cmd = [sys.executable, "-m", "stagetree.nodemanager.runtime.worker", "--spec", str(bad)]
    rc = subprocess.run([*cmd, "--checkpoint-root", str(tmp_path)], capture_output=True, check=False).returncode
    assert rc == 2
    assert unknown.finish() == 1
    assert "no_such_module_xyz" in unknown.of("batch_failed")[0]["error"]


def test_spec_on_stdin_after_preload_and_empty_stdin_means_nothing_to_run(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "stagetree.nodemanager.runtime.worker", "--spec", "-"]
    cmd += ["--checkpoint-root", str(tmp_path / "ckpt"), "--preload", "json,no_such_module_xyz"]
    cmd += ["--warm-cuda"]  # without a GPU (or with CUDA hidden, a CPU slot's case) it does nothing
    env = {**os.environ, "STAGETREE_WORKER_THREADS": "1"}
    spec = digits_batch([(1, 0, 3, HP)], evals=[(1, 3)])
    out = subprocess.run(cmd, input=json.dumps(spec.to_json()), capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0, out.stderr
    kinds = [decode_event(line)[0] for line in out.stdout.splitlines()]
    assert kinds[0] == "batch_started" and kinds[-1] == "batch_finished" and "metrics" in kinds
    assert "preload of no_such_module_xyz failed" in out.stderr  # a bad preload is logged, not fatal
    idle = subprocess.run(cmd, input="", capture_output=True, text=True, env=env, check=False)
    assert idle.returncode == 0 and idle.stdout == ""


@pytest.mark.parametrize(
    ("trainer", "hint", "used"),
    [
        (None, None, True),  # the digits trainer may be built ahead: the batch starts from it
        (ENV_RECORDER, None, False),  # a trainer that did not opt in (prepare_ahead): only imported ahead
        (None, {"hidden": 8}, False),  # built for another fixed part: dropped, the batch builds its own
        (None, "not json", False),  # a bad prepare line is logged; the batch still runs
    ],
)
def test_a_prepare_line_builds_the_trainer_ahead_only_when_it_may_and_fits(
    tmp_path: Path, trainer: str | None, hint: Any, used: bool
) -> None:
    kw: dict[str, Any] = {}
    if trainer:
        kw = {"trainer": trainer, "fixed_values": {"env_file": str(tmp_path / "env.json")}}
    spec = digits_batch([(1, 0, 3, HP)], evals=[(1, 3)], **kw)
    if hint == "not json":
        line = '{"prepare": nope\n'
    else:
        fixed = spec.fixed.to_json() if hint is None else {**spec.fixed.to_json(), "values": hint}
        line = json.dumps({"prepare": {"fixed": fixed, "gpus": spec.gpus}}) + "\n"
    cmd = [sys.executable, "-m", "stagetree.nodemanager.runtime.worker", "--spec", "-"]
    cmd += ["--checkpoint-root", str(tmp_path / "ckpt")]
    env = {**os.environ, "STAGETREE_WORKER_THREADS": "1"}
    text = line + json.dumps(spec.to_json())
    out = subprocess.run(cmd, input=text, capture_output=True, text=True, env=env, check=False)
    kinds = [decode_event(x)[0] for x in out.stdout.splitlines()]
    assert kinds[0] == "batch_started" and kinds[-1] in ("batch_finished", "batch_failed"), out.stderr
    assert ("starting from the trainer built ahead" in out.stderr) == used
    if hint == "not json":
        assert "could not prepare the trainer ahead" in out.stderr
    if hint == {"hidden": 8}:
        assert "for another fixed part" in out.stderr


def test_event_writer_holds_fast_progress_and_writes_everything_else_at_once() -> None:
    class Stream(io.StringIO):
        flushes = 0

        def flush(self) -> None:
            Stream.flushes += 1

    now = [100.0]
    stream = Stream()
    write = EventWriter(stream, progress_flush_s=0.05, clock=lambda: now[0])
    ids = {"batch_id": 1, "attempt": 1}

    def lines() -> list[tuple[str, Any]]:
        return [(k, p.get("step")) for k, _, p in map(decode_event, stream.getvalue().splitlines())]

    write("progress", {**ids, "node": 1, "step": 1})  # the first one goes out
    for step in range(2, 6):  # within 50 ms of that flush: held, each replacing the last
        write("progress", {**ids, "node": 1, "step": step})
    assert lines() == [("progress", 1)] and Stream.flushes == 1
    write("metrics", {**ids, "node": 1, "step": 5, "metrics": {"loss": 1.0}})  # the held one goes first
    assert lines() == [("progress", 1), ("progress", 5), ("metrics", 5)] and Stream.flushes == 2
    now[0] += 0.06
    write("progress", {**ids, "node": 1, "step": 6})  # the interval has passed: at once
    write("progress", {**ids, "node": 1, "step": 7})
    assert lines()[-1] == ("progress", 6)
    write.flush()
    assert lines()[-1] == ("progress", 7) and Stream.flushes == 4


def test_warm_cuda_never_fails_the_worker(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from stagetree.nodemanager.runtime import worker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker.warm_cuda() == 0.0

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "ones", broken)
    assert worker.warm_cuda() == 0.0
    assert "could not create the CUDA context ahead" in caplog.text


@pytest.mark.parametrize("device, collections", [("cpu", 0), ("cuda", 1)])
def test_a_trainer_left_in_memory_is_collected_for_only_when_it_held_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, collections: int
) -> None:
    """A kept trainer the next batch cannot continue is dropped; a full ``gc.collect`` (a fraction of a
    second of CPU with torch and sklearn imported) runs only to free a GPU's memory, by the device the
    trainer ran on: a CPU slot's batches ask for ``gpus=1`` too."""
    import gc

    import torch

    from stagetree.nodemanager.examples.digits import DigitsMLP
    from stagetree.nodemanager.runtime import worker
    from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
    from stagetree.nodemanager.runtime.executor import InMemory

    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or 0)
    done = digits_batch([(1, 0, 3, HP)], batch_id=1)
    assert done.gpus > 0  # what a CPU slot is sent
    trainer = DigitsMLP()
    trainer.device = torch.device(device)  # where it ran (no CUDA is touched: only the attribute is read)
    kept = InMemory.after(done, trainer)
    assert kept.on_gpu is (device == "cuda")

    events = io.StringIO()
    w = worker._Worker(worker._parse_args(["--spec", "-", "--checkpoint-root", str(tmp_path)]))
    w.store = LocalCheckpointStore(tmp_path)
    w._emit = EventWriter(events)
    w.kept = kept
    other = digits_batch([(2, 0, 3, HP)], batch_id=2, trainer="no_such_module_here:Net")  # fails at once
    assert w.run(other) is None
    assert w.kept is None and len(calls) == collections
    assert "batch_failed" in events.getvalue()
