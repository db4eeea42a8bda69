"""Worker processes on a GPU slot, driven as a node manager drives them, and NVML's view of them: what the
GPU tests (``tests/unit/runtime/test_cuda.py``) and the GPU bench (``tests.bench.gpu``) share.

A ``SlotWorker`` is started ahead, as the node manager's launcher starts it (``runtime.worker --spec -``,
the slot's environment from ``slots.worker_env``, optionally ``--warm-cuda``); its events are read by a
thread as they come, each stamped with the monotonic time it arrived, so a caller can time a batch's
start, a preemption or a resume from outside the process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from stagetree.core.batch import BatchSpec
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager.gpu import GpuSample, NvmlGpuProbe
from stagetree.nodemanager.runtime.checkpoints import open_checkpoint_store
from stagetree.nodemanager.runtime.events import decode_event
from stagetree.nodemanager.settings import NodeManagerSettings
from stagetree.nodemanager.slots import build_slots, worker_env

Event = tuple[float, str, dict[str, Any]]  # (monotonic time it arrived, kind, payload)


def has_gpu() -> bool:
    """Whether this machine has a CUDA GPU that NVML sees too (what the GPU tests need)."""
    if not torch.cuda.is_available():
        return False
    probe = NvmlGpuProbe()
    try:
        return bool(probe.gpus())
    finally:
        probe.close()


def gpu_slots(slots_per_gpu: int = 1) -> list[SlotInfo]:
    """The slots a node manager would build on this machine's first GPU."""
    probe = NvmlGpuProbe()
    try:
        gpus = probe.gpus()
    finally:
        probe.close()
    return build_slots(gpus[:1], slots_per_gpu=slots_per_gpu)


class SlotWorker:
    """One worker process started ahead on ``slot`` (imports done, waiting for its spec on stdin)."""

    def __init__(
        self,
        slot: SlotInfo,
        checkpoint_root: Path,
        log_path: Path,
        *,
        warm_cuda: bool = True,
        mps_env: Mapping[str, str] | None = None,
    ) -> None:
        env = worker_env(slot, threads=1, mps_env=mps_env)
        cmd = [sys.executable, "-m", "stagetree.nodemanager.runtime.worker", "--spec", "-"]
        cmd += ["--checkpoint-root", str(checkpoint_root), "--progress-interval", "0"]
        cmd += ["--preload", NodeManagerSettings().worker_preload]  # as the node manager starts them
        if warm_cuda:
            cmd.append("--warm-cuda")
        self.started_at = time.monotonic()
        self.sent_at: float | None = None
        with open(log_path, "ab") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True
            )
        self.log_path = log_path
        self.events: list[Event] = []
        self._cond = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, name=f"worker-{self.proc.pid}-events", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, _ts, payload = decode_event(line)
            with self._cond:
                self.events.append((time.monotonic(), kind, payload))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def send(self, spec: BatchSpec) -> None:
        """Hand the worker its batch (and close its input)."""
        assert self.proc.stdin is not None
        self.sent_at = time.monotonic()
        self.proc.stdin.write(json.dumps(spec.to_json()).encode())
        self.proc.stdin.close()

    def wait_for(self, match: Callable[[str, dict[str, Any]], bool], timeout: float = 120.0) -> Event:
        """The first event that ``match``-es (waiting for it); AssertionError with the log's tail when the
        worker ends or the time is up first."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for ev in self.events[seen:]:
                    if match(ev[1], ev[2]):
                        return ev
                seen = len(self.events)
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
        raise AssertionError(
            f"worker {self.pid}: no matching event ({'it ended' if self._eof else 'timed out'}); events "
            f"{[k for _, k, _ in self.events]}; log tail:\n{self.log_tail()}"
        )

    def wait_step(self, step: int, timeout: float = 120.0) -> float:
        """When the first progress event at ``step`` or later arrived."""
        return self.wait_for(lambda k, p: k == "progress" and int(p["step"]) >= step, timeout)[0]

    def finish(self, timeout: float = 300.0) -> int:
        """The exit status, once the process and its event stream have ended."""
        rc = self.proc.wait(timeout)
        self._reader.join(timeout)
        return rc

    def preempt(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._cond:
            return [p for _, k, p in self.events if k == kind]

    def checkpoint_at(self, step: int) -> str:
        uris = [p["uri"] for p in self.of("checkpoint_saved") if int(p["step"]) == step]
        assert uris, f"worker {self.pid}: no checkpoint at step {step}: {self.of('checkpoint_saved')}"
        return str(uris[-1])

    def metrics_at(self, step: int) -> dict[str, float]:
        found = [p["metrics"] for p in self.of("metrics") if int(p["step"]) == step]
        assert found, f"worker {self.pid}: no metrics at step {step}"
        return dict(found[-1])

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# -- NVML -------------------------------------------------------------------------------------------


class Nvml:
    """The node manager's own NVML adapter, read for the first GPU."""

    def __init__(self) -> None:
        self.probe = NvmlGpuProbe()

    def sample(self) -> GpuSample:
        samples = self.probe.sample()
        assert samples, "NVML returned no sample of the GPU"
        return samples[0]

    def process_memory(self, pid: int) -> int | None:
        """The GPU memory NVML says ``pid`` holds (None: it holds no context)."""
        return self.sample().processes.get(pid)

    def wait_process(self, pid: int, present: bool, timeout: float = 60.0, poll_s: float = 0.005) -> float | None:
        """When NVML first showed ``pid`` holding (``present``) or no longer holding a context; None if it
        did not within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (pid in self.sample().processes) == present:
                return time.monotonic()
            time.sleep(poll_s)
        return None

    def close(self) -> None:
        self.probe.close()


# -- checkpoints ------------------------------------------------------------------------------------


def checkpoint_state(root: Path, uri: str) -> dict[str, Any]:
    """A checkpoint's two files (the trainer's state and the runtime's) as loaded tensors."""
    store = open_checkpoint_store(str(root))
    with store.open(uri) as d:
        return {
            "user": torch.load(d / "user" / "trainer.pt", weights_only=True, map_location="cpu"),
            "runtime": torch.load(d / "runtime.pt", weights_only=True, map_location="cpu"),
        }


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two loaded states differ, bit for bit (tensors by ``torch.equal`` with equal dtypes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: tensor vs {type(b).__name__ if isinstance(a, torch.Tensor) else type(a).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("nan")
            return [f"{path}: tensors differ (max |a - b| {diff:.3g})"]
        return []
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out = [f"{path}/{k}: only on one side" for k in set(a) ^ set(b)]
        for k in sorted(set(a) & set(b), key=str):
            out += differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]
