"""Slots from GPUs (shares, CPU-only fallback), each worker's environment, the NVML probe on a machine
without a GPU, MPS command construction, settings, and the CLI's log format. The ``gpu`` tests run
NVML, MPS and a CUDA worker for real and are skipped without a GPU."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from stagetree.core.errors import FailedPrecondition, InvalidArgument
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager.gpu import GpuInfo, NvmlGpuProbe, StaticGpuProbe
from stagetree.nodemanager.mps import MpsDaemon
from stagetree.nodemanager.settings import NodeManagerSettings
from stagetree.nodemanager.slots import build_slots, worker_env
from stagetree.nodemanager.workers import ExecLauncher, ForkserverLauncher, make_launcher

H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 * 2**30, "9.0")
A100 = GpuInfo(1, "NVIDIA A100-SXM4-40GB", 40 * 2**30, "8.0")


def _has_gpu() -> bool:
    probe = NvmlGpuProbe()
    try:
        return bool(probe.gpus())
    finally:
        probe.close()


needs_gpu = pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU (NVML finds none)")


def test_no_gpu_gives_cpu_slots() -> None:
    slots = build_slots([], cpu_slots=3, threads_per_worker=2)
    assert [s.id for s in slots] == ["cpu0", "cpu1", "cpu2"]
    assert all(s.gpu_type == "cpu" and s.gpu_index == -1 and s.share == 0 and s.cpu_cores == 2 for s in slots)


def test_one_slot_per_gpu_gets_the_whole_gpu() -> None:
    slots = build_slots([H100, A100], cpu_count=16)
    assert [(s.id, s.gpu_type, s.gpu_index, s.share) for s in slots] == [
        ("gpu0", H100.name, 0, 0.0),
        ("gpu1", A100.name, 1, 0.0),
    ]
    assert slots[0].memory_bytes == H100.memory_bytes and slots[0].compute_capability == "9.0"
    assert all(s.cpu_cores == 8 for s in slots)


def test_shared_gpu_slots_split_compute_and_memory() -> None:
    slots = build_slots([H100], slots_per_gpu=4, cpu_count=16)
    assert [s.id for s in slots] == ["gpu0.0", "gpu0.1", "gpu0.2", "gpu0.3"]
    assert all(s.share == 0.25 and s.memory_bytes == H100.memory_bytes // 4 and s.cpu_cores == 4 for s in slots)
    assert slots[0].mps_thread_percentage() == 25
    assert build_slots([H100], slots_per_gpu=3)[0].mps_thread_percentage() == 34  # rounded up, never 0


def test_bad_slot_settings_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="slots_per_gpu"):
        build_slots([H100], slots_per_gpu=0)


def test_worker_env_pins_the_device_threads_and_mps_share() -> None:
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}
    cpu = worker_env(SlotInfo("cpu0"), threads=2, base=base)
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and cpu["OMP_NUM_THREADS"] == "2" and cpu["PATH"] == "/bin"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in cpu

    shared = build_slots([H100, A100], slots_per_gpu=2)[2]  # gpu1.0
    mps = {"CUDA_MPS_PIPE_DIRECTORY": "/w/mps/pipe", "CUDA_MPS_LOG_DIRECTORY": "/w/mps/log"}
    env = worker_env(shared, threads=4, mps_env=mps, base=base)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["STAGETREE_WORKER_THREADS"] == "4"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50" and env["CUDA_MPS_PIPE_DIRECTORY"] == "/w/mps/pipe"

    whole = worker_env(build_slots([H100])[0], threads=1, mps_env=mps, base=base)
    assert whole["CUDA_VISIBLE_DEVICES"] == "0" and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in whole
    without_mps = worker_env(shared, threads=1, base=base)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in without_mps and "CUDA_MPS_PIPE_DIRECTORY" not in without_mps


def test_gpu_workers_get_a_fixed_cublas_workspace_unless_one_is_set() -> None:
    gpu = build_slots([H100])[0]
    assert worker_env(gpu, threads=1, base={})["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert worker_env(gpu, threads=1, base={"CUBLAS_WORKSPACE_CONFIG": ":16:8"})["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert "CUBLAS_WORKSPACE_CONFIG" not in worker_env(SlotInfo("cpu0"), threads=1, base={})


def test_nvml_probe_without_a_gpu_says_so_once_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    if _has_gpu():
        pytest.skip("this machine has a GPU")
    probe = NvmlGpuProbe()
    with caplog.at_level(logging.INFO, logger="stagetree.nodemanager.gpu"):
        assert probe.gpus() == [] and probe.sample() == [] and probe.gpus() == []
    probe.close()
    (record,) = caplog.records
    assert "CPU-only" in record.getMessage()


def test_static_probe_reports_its_gpus_idle() -> None:
    probe = StaticGpuProbe([H100])
    assert probe.gpus() == [H100]
    (sample,) = probe.sample()
    assert sample.memory_total == H100.memory_bytes and sample.utilization == 0.0


def test_mps_commands_and_environment(tmp_path: Path) -> None:
    mps = MpsDaemon(tmp_path / "nm", [0, 2])
    assert mps.start_command() == ["nvidia-cuda-mps-control", "-d"]
    assert mps.stop_command() == (["nvidia-cuda-mps-control"], "quit\n")
    env = mps.daemon_env({"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "nm" / "mps" / "pipe")
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "nm" / "mps" / "log")
    assert mps.client_env() == {k: env[k] for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}


def test_mps_start_and_stop_run_the_control_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in ``nvidia-cuda-mps-control`` records how it was called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.jsonl"
    fake = bin_dir / "nvidia-cuda-mps-control"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(calls)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'stdin': '' if sys.argv[1:] else sys.stdin.read(),\n"
        "        'pipe': os.environ['CUDA_MPS_PIPE_DIRECTORY'], 'gpus': os.environ['CUDA_VISIBLE_DEVICES']}) + '\\n')\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    mps = MpsDaemon(tmp_path / "w", [0])
    mps.start()
    assert mps.pipe_dir.is_dir() and mps.log_dir.is_dir()
    mps.stop()
    mps.stop()  # once only
    started, stopped = (json.loads(line) for line in calls.read_text().splitlines())
    assert started == {"argv": ["-d"], "stdin": "", "pipe": str(mps.pipe_dir), "gpus": "0"}
    assert stopped["argv"] == [] and stopped["stdin"] == "quit\n"


def test_mps_start_without_the_binary_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FailedPrecondition, match="STAGETREE_NM_MPS=false"):
        MpsDaemon(tmp_path, [0]).start()
    with pytest.raises(FailedPrecondition, match="STAGETREE_NM_WORK_DIR"):
        MpsDaemon(tmp_path / ("x" * 100), [0]).start()


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGETREE_NM_MASTER_TARGET", "master:6000")
    monkeypatch.setenv("STAGETREE_NM_ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("STAGETREE_NM_SLOTS_PER_GPU", "2")
    monkeypatch.setenv("STAGETREE_NM_MPS", "true")
    monkeypatch.setenv("STAGETREE_NM_BUS__KAFKA_BOOTSTRAP_SERVERS", "k1:9092,k2:9092")
    s = NodeManagerSettings()
    assert (s.master_target, s.slots_per_gpu, s.mps) == ("master:6000", 2, True)
    assert s.bus.kafka_bootstrap_servers == "k1:9092,k2:9092"
    assert s.admin_token.get_secret_value() == "s3cret" and "s3cret" not in repr(s)
    assert s.resolved_id() and s.resolved_id() == NodeManagerSettings(node_manager_id="").resolved_id()


def test_launcher_choice(tmp_path: Path) -> None:
    cpu, gpu_slot = SlotInfo("cpu0"), build_slots([H100])[0]
    assert isinstance(make_launcher("auto", [cpu], "/c", tmp_path), ForkserverLauncher)
    assert isinstance(make_launcher("auto", [gpu_slot], "/c", tmp_path), ForkserverLauncher)
    exec_launcher = make_launcher("exec", [cpu], "/c", tmp_path, preload=["torch._dynamo"], threads=3)
    assert isinstance(exec_launcher, ExecLauncher)
    cmd = exec_launcher.command()
    assert cmd[1:5] == ["-m", "stagetree.nodemanager.runtime.worker", "--spec", "-"]
    assert cmd[-2:] == ["--preload", "torch._dynamo"] and "3" in cmd
    with pytest.raises(InvalidArgument, match="known"):
        make_launcher("thread", [cpu], "/c", tmp_path)  # type: ignore[arg-type]


def test_only_gpu_slots_workers_make_their_cuda_context_ahead(tmp_path: Path) -> None:
    cpu, gpu_slot = SlotInfo("cpu0"), build_slots([H100])[0]
    warm = make_launcher("exec", [cpu, gpu_slot], "/c", tmp_path, warm_cuda=True)
    assert isinstance(warm, ExecLauncher)
    assert "--warm-cuda" in warm.command(gpu_slot) and "--warm-cuda" not in warm.command(cpu)
    assert "--warm-cuda" not in warm.command()
    cold = make_launcher("exec", [gpu_slot], "/c", tmp_path, warm_cuda=False)
    assert "--warm-cuda" not in cold.command(gpu_slot)
    assert NodeManagerSettings().worker_warm_cuda is True  # the node manager's default


# -- on a GPU machine -----------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_nvml_probe_describes_and_samples_the_gpus() -> None:
    probe = NvmlGpuProbe()
    try:
        gpus = probe.gpus()
        assert gpus and all(g.memory_bytes > 0 and g.name and "." in g.compute_capability for g in gpus)
        samples = probe.sample()
        assert [s.index for s in samples] == [g.index for g in gpus]
        for s, g in zip(samples, gpus, strict=True):
            assert 0 <= s.utilization <= 100 and s.memory_total == g.memory_bytes
    finally:
        probe.close()


@pytest.mark.gpu
@needs_gpu
def test_real_mps_daemon_serves_a_cuda_worker_on_a_half_share(tmp_path: Path) -> None:
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not installed")
    import subprocess

    from stagetree.nodemanager.examples.digits import digits_batch

    probe = NvmlGpuProbe()
    gpus = probe.gpus()
    probe.close()
    mps = MpsDaemon(Path("/tmp") / f"st-mps-{os.getpid()}", [gpus[0].index])
    mps.start()
    try:
        slot = build_slots(gpus[:1], slots_per_gpu=2)[0]
        env = worker_env(slot, threads=1, mps_env=mps.client_env())
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps(digits_batch([(1, 0, 5, {"lr": 0.1})], evals=[(1, 5)]).to_json()))
        cmd = [sys.executable, "-m", "stagetree.nodemanager.runtime.worker", "--spec", str(spec)]
        cmd += ["--checkpoint-root", str(tmp_path / "ckpt")]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stderr
        assert '"batch_finished"' in out.stdout
    finally:
        mps.stop()
        shutil.rmtree(mps.pipe_dir.parent.parent, ignore_errors=True)
