"""The worker runtime on a real GPU: exact resume on CUDA, out of memory reported as such, a preempted
worker's GPU memory returned, a waiting worker's CUDA context made ahead. Skipped without a GPU (they
run on the device machine: ``scripts/gpu_device_run.sh``); ``tests.bench.gpu`` measures the same paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stagetree.core.batch import BatchSpec
from stagetree.core.sequences import Constant, Cosine, Warmup
from stagetree.nodemanager.examples import cifar
from tests.gpu_workers import Nvml, SlotWorker, checkpoint_state, differences, gpu_slots, has_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU (CUDA and NVML see none)"),
]

SMALL = {"width": 16, "train_rows": 1024, "eval_rows": 256, "minibatches": 2, "batch_size": 64}
HPS = {"lr": Warmup(0.01, 3, Cosine(0.1, 0.001, 5)), "momentum": Constant(0.9)}


def _spec(batch_id: int, start: int, end: int, fixed: dict[str, Any], source_uri: str | None = None) -> BatchSpec:
    return cifar.cifar_batch(batch_id, start, end, HPS, fixed, source_uri=source_uri)


def _run(tmp_path: Path, name: str, spec: BatchSpec, **kw: Any) -> SlotWorker:
    w = SlotWorker(gpu_slots()[0], tmp_path / "ckpt", tmp_path / f"{name}.log", **kw)
    w.send(spec)
    assert w.finish(300) == 0, (w.of("batch_failed"), w.log_tail())
    return w


def test_resume_on_cuda_is_bitwise_exact(tmp_path: Path) -> None:
    fixed = {**SMALL, "deterministic": True}
    straight = _run(tmp_path, "straight", _spec(1, 0, 8, fixed))
    first = _run(tmp_path, "first", _spec(2, 0, 3, fixed))
    resumed = _run(tmp_path, "second", _spec(3, 3, 8, fixed, first.checkpoint_at(3)))
    a = checkpoint_state(tmp_path / "ckpt", straight.checkpoint_at(8))
    b = checkpoint_state(tmp_path / "ckpt", resumed.checkpoint_at(8))
    assert "cuda" in a["runtime"]["rng"]  # the CUDA generator's state travels with the checkpoint
    assert differences(a, b) == []
    assert straight.metrics_at(8) == resumed.metrics_at(8)


def test_out_of_memory_on_cuda_is_reported_as_oom_and_returns_the_memory(tmp_path: Path) -> None:
    rows = 6144  # width 256, 2 blocks a stage: 6.4 GB an activation, some 190 GB saved for the backward
    fixed = {"width": 256, "blocks": 2, "train_rows": rows, "eval_rows": 64, "batch_size": rows}
    fixed["deterministic"] = False
    w = SlotWorker(gpu_slots()[0], tmp_path / "ckpt", tmp_path / "oom.log")
    w.send(_spec(1, 0, 2, fixed))
    assert w.finish(300) == 1
    (failed,) = w.of("batch_failed")
    assert failed["oom"] is True and failed["user_error"] is False, failed["error"]
    nvml = Nvml()
    try:
        assert nvml.wait_process(w.pid, present=False, timeout=10) is not None
    finally:
        nvml.close()


def test_preempted_worker_returns_its_gpu_memory(tmp_path: Path) -> None:
    nvml = Nvml()
    try:
        w = SlotWorker(gpu_slots()[0], tmp_path / "ckpt", tmp_path / "victim.log")
        assert nvml.wait_process(w.pid, present=True, timeout=120) is not None  # its context, made ahead
        w.send(_spec(1, 0, 10_000, {**SMALL, "deterministic": False}))
        w.wait_step(3)
        held = nvml.process_memory(w.pid)
        assert held is not None and held > 0
        w.preempt()
        assert nvml.wait_process(w.pid, present=False, timeout=60) is not None
        assert w.finish(60) == 0
        (stop,) = w.of("batch_preempted")
        assert stop["step"] >= 3 and w.of("checkpoint_saved")[-1]["uri"] == stop["uri"]
    finally:
        nvml.close()


def test_a_cold_worker_makes_its_context_only_for_its_batch(tmp_path: Path) -> None:
    nvml = Nvml()
    try:
        w = SlotWorker(gpu_slots()[0], tmp_path / "ckpt", tmp_path / "cold.log", warm_cuda=False)
        assert nvml.wait_process(w.pid, present=True, timeout=8) is None
        w.send(_spec(1, 0, 2, SMALL))
        assert w.finish(300) == 0
    finally:
        nvml.close()


def test_torch_trainer_keeps_the_step_loss_on_the_gpu() -> None:
    from stagetree.nodemanager.runtime.trainer import TrainerContext

    t = cifar.CifarResNet()
    t.bind(TrainerContext(fixed={**SMALL, "deterministic": False}, seed=0, device=torch.device("cuda")))
    t.init()
    t.setup({"lr": 0.05, "momentum": 0.9})
    loss = t.train()["loss"]
    assert isinstance(loss, torch.Tensor) and loss.device.type == "cuda" and float(loss) > 0


def test_a_worker_forked_from_the_fork_server_trains_on_cuda(tmp_path: Path) -> None:
    """The node manager's default launcher on a GPU slot: the fork server never initialized CUDA, so its
    child makes its own context (ahead, while it waits) and trains."""
    import asyncio

    from stagetree.nodemanager.workers import ForkserverLauncher

    async def run() -> tuple[int, list[str]]:
        slot = gpu_slots()[0]
        launcher = ForkserverLauncher(str(tmp_path / "ckpt"), tmp_path, warm_cuda=True, preload=["torch._dynamo"])
        await launcher.start([slot])
        try:
            w = await launcher.spawn(_spec(1, 0, 3, SMALL), slot)
            kinds = [kind async for kind, _ in w.events()]
            return await w.wait(), kinds
        finally:
            await launcher.close()

    rc, kinds = asyncio.run(run())
    assert rc == 0 and kinds[0] == "batch_started" and kinds[-1] == "batch_finished", kinds
