"""stagetree on a real GPU (issue 24): exact resume on CUDA, out of memory, preemption, Ray Tune, packing.

    python -m tests.bench.gpu [--phases probe,resume,oom,preempt,raytune,packing] [--json FILE]
                              [--merge FILE] [--work DIR]

Without a GPU (CUDA and NVML see none) it says so and exits 2. Every phase runs the platform's own code
on the GPU: worker processes started as the node manager starts them (``tests.gpu_workers``), and the
embedded cluster (master, aggregator, node manager, workers) for the studies. A phase that fails is
reported with its error and the others still run; ``--json`` is rewritten after every phase, and
``--merge`` starts from an earlier run's file (a rerun of some phases keeps the others' results).

* probe: the device, driver, CUDA, PyTorch and cuDNN versions (read in a subprocess: this process never
  holds a CUDA context), and whether ``nvidia-cuda-mps-control`` is there.
* resume: ``CifarResNet`` (examples/cifar.py: a ResNet on CIFAR-10-shaped data) with deterministic
  algorithms, a warmup-then-cosine learning rate: 30 steps straight in one worker against 13 steps, a
  checkpoint, and 17 more in another worker. ``resume_exact`` when the two final checkpoints (model,
  optimizer, data loader, RNG states) are equal bit for bit and so are the metrics. The same is run
  without deterministic algorithms (cuDNN's heuristics, for information).
* oom: a batch too large for the GPU (a ResNet of width 256 on 6,144 images in one minibatch): true when
  the worker reports ``batch_failed`` with ``oom`` (so the master retries it with more slots, and does not
  take it for the user's error) and NVML shows its memory returned.
* preempt (Hermes' suspend and resume): a worker training ``CifarResNet`` (width 64, 2 blocks, 4 x 512
  images a step) is sent SIGUSR1, as the node manager preempts; ``suspend_s`` is from the signal to NVML
  no longer listing the process (the step finished, a checkpoint written, the process gone);
  ``resume_s`` from handing the checkpoint's batch to the slot's waiting worker (started ahead with its
  CUDA context, as the node manager keeps one) to its first trained step. ``preempt_s`` is their sum
  (Hermes measured 0.67-1.57 s for save plus restore). ``preempt_frees_memory`` when NVML stops listing
  the process and the GPU's used memory falls by at least 90% of what NVML said it held. The resumed run
  must equal a straight run bit for bit (part of ``resume_exact``). ``cold_resume_s``: the same resume by
  a worker started when the batch arrives (imports and CUDA context on the batch's time).
* raytune: ``tests.bench.vs_raytune``'s S1 (48 trials x 40 steps of the digits MLP, the learning rate
  branching in three phases: merge rate 3.2) with both systems on the GPU, each running 2 trials at a
  time on half of it: stagetree embedded with 2 slots on the GPU, Ray Tune with ``num_gpus=0.5`` per
  trial and ``reuse_actors``. GPU-seconds: the slot time of the work (stagetree: every batch attempt
  from being sent to its node manager to its end, from the ledger; Ray: every trial from the start of
  the trainable to its last report) times the slot's half GPU. ``gpu_s_ratio_vs_raytune`` is Ray's over
  stagetree's (target: 0.8 x the merge rate); the finals must agree to 1e-6 (both trained the same) and
  stagetree must train exactly the unique steps. Each system warms up first (4 short trials); unless
  ``--no-cold``, stagetree runs S1 a second time with its workers' CUDA contexts not created ahead. On
  an H100, Ray Tune's S1 run had not ended when the time lent ran out (twice, after the other phases):
  give this phase a call of its own.
* packing (HyperSack): 8 independent trials of a small ``CifarResNet`` (width 16, 128 images x 8 a step,
  150 steps; no shared prefix) on embedded clusters with 1 slot on the GPU (one trial at a time), 4
  slots (packed, time-sliced) and 4 slots under the node manager's MPS daemon (25% of the SMs each).
  Throughput in trials per hour over the study's wall time; NVML sampled every 0.1 s (the GPU's
  utilization, i.e. the share of time a kernel ran, the memory used, and per-process SM utilization).
  ``mps_packing_vs_one`` is MPS-packed over one at a time (HyperSack: 2.5-2.8x on A100s).

The last line printed is ``device=<name> resume_exact=<b> mps_packing_vs_one=<r> preempt_s=<t>
preempt_frees_memory=<b> gpu_s_ratio_vs_raytune=<r>`` (a figure whose phase failed reads ``nan`` or
``false``); ``--json`` holds it with the driver and CUDA versions and every phase's details.
``--cpu`` runs the phases on CPU slots with small sizes: a dry run of the bench's own code (its figures
mean nothing, NVML parts are skipped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagetree.core.batch import BatchSpec
from stagetree.core.sequences import Constant, Cosine, Warmup
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager.examples import cifar
from stagetree.nodemanager.examples.digits import digits_batch
from stagetree.nodemanager.examples.faults import ENTRY_POINT as FAULTY
from stagetree.nodemanager.slots import CUBLAS_WORKSPACE, build_slots
from tests.gpu_workers import Nvml, SlotWorker, checkpoint_state, differences, gpu_slots, has_gpu

PHASES = ("probe", "resume", "oom", "preempt", "raytune", "packing")
PACKING_TIMEOUT_S = 150.0
NEEDS_GPU = "tests.bench.gpu needs an NVIDIA GPU: CUDA and NVML see none on this machine (see docs/gpu.md)"


@dataclass
class Context:
    work: Path
    cpu: bool  # the --cpu dry run
    slot: SlotInfo
    nvml: Nvml | None
    runs: int = 1
    minibatches: int = 50
    cold: bool = True
    log: Callable[[str], None] = print
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def batch_id(self) -> int:
        return next(self.ids)

    def scaled(self, gpu: int, cpu: int) -> int:
        return cpu if self.cpu else gpu


def worker(ctx: Context, root: Path, name: str, *, warm_cuda: bool = True) -> SlotWorker:
    (ctx.work / "logs").mkdir(parents=True, exist_ok=True)
    return SlotWorker(ctx.slot, root, ctx.work / "logs" / f"{name}.log", warm_cuda=warm_cuda)


def run_batch(ctx: Context, root: Path, name: str, spec: BatchSpec, timeout: float = 300.0) -> SlotWorker:
    w = worker(ctx, root, name)
    w.send(spec)
    rc = w.finish(timeout)
    if rc != 0:
        raise RuntimeError(f"{name}: worker exited {rc}: {w.of('batch_failed')}\n{w.log_tail()}")
    return w


# -- probe -------------------------------------------------------------------------------------------

PROBE = r"""
import json, torch
p = torch.cuda.get_device_properties(0)
print(json.dumps({"torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version(), "device": torch.cuda.get_device_name(0),
    "sms": p.multi_processor_count, "memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}"}))
"""


def phase_probe(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "mps_control": shutil.which("nvidia-cuda-mps-control")}
    if ctx.cpu:
        import torch

        return {**out, "device": "cpu", "torch": torch.__version__}
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    out.update(json.loads(res.stdout.strip().splitlines()[-1]))
    import pynvml  # type: ignore[import-untyped]

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["nvml_name"] = _text(pynvml.nvmlDeviceGetName(h))
        out["driver"] = _text(pynvml.nvmlSystemGetDriverVersion())
        v = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        out["cuda_driver"] = f"{v // 1000}.{(v % 1000) // 10}"
        with contextlib.suppress(pynvml.NVMLError):
            out["compute_mode"] = int(pynvml.nvmlDeviceGetComputeMode(h))
    finally:
        pynvml.nvmlShutdown()
    return out


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# -- resume ------------------------------------------------------------------------------------------


def _resume_pair(ctx: Context, deterministic: bool) -> dict[str, Any]:
    steps, at = ctx.scaled(30, 6), ctx.scaled(13, 3)
    fixed = {
        "width": ctx.scaled(32, 8),
        "blocks": 1,
        "train_rows": ctx.scaled(8192, 512),
        "eval_rows": ctx.scaled(1024, 128),
        "minibatches": 2,
        "batch_size": ctx.scaled(128, 32),
        "deterministic": deterministic,
    }
    hps = {"lr": Warmup(0.01, 8, Cosine(0.1, 0.001, 22)), "momentum": Constant(0.9)}
    root = ctx.work / f"resume-{'det' if deterministic else 'nondet'}"
    tag = "det" if deterministic else "nondet"
    straight_w = worker(ctx, root, f"resume-{tag}-straight")
    first_w = worker(ctx, root, f"resume-{tag}-first")
    straight_w.send(cifar.cifar_batch(ctx.batch_id(), 0, steps, hps, fixed, seed=7))
    first_w.send(cifar.cifar_batch(ctx.batch_id(), 0, at, hps, fixed, evaluate=False, seed=7))
    for w in (straight_w, first_w):
        if w.finish(300) != 0:
            raise RuntimeError(f"worker exited {w.proc.returncode}: {w.of('batch_failed')}\n{w.log_tail()}")
    uri = first_w.checkpoint_at(at)
    second = cifar.cifar_batch(ctx.batch_id(), at, steps, hps, fixed, source_uri=uri, seed=7)
    second_w = run_batch(ctx, root, f"resume-{tag}-second", second)
    straight = checkpoint_state(root, straight_w.checkpoint_at(steps))
    resumed = checkpoint_state(root, second_w.checkpoint_at(steps))
    diffs = differences(straight, resumed)
    m_straight, m_resumed = straight_w.metrics_at(steps), second_w.metrics_at(steps)
    out: dict[str, Any] = {
        "exact": not diffs and m_straight == m_resumed,
        "steps": steps,
        "resumed_at": at,
        "metrics_straight": m_straight,
        "metrics_resumed": m_resumed,
        "differences": diffs[:20],
    }
    if diffs:  # is it the resume, or does the training itself differ from run to run?
        again_w = run_batch(
            ctx, root, f"resume-{tag}-straight-again", cifar.cifar_batch(ctx.batch_id(), 0, steps, hps, fixed, seed=7)
        )
        out["straight_runs_equal"] = not differences(straight, checkpoint_state(root, again_w.checkpoint_at(steps)))
    return out


def phase_resume(ctx: Context) -> dict[str, Any]:
    det = _resume_pair(ctx, deterministic=True)
    nondet = _resume_pair(ctx, deterministic=False)
    ctx.log(
        f"  resume: deterministic exact={det['exact']} (metrics {det['metrics_resumed']}); "
        f"cuDNN heuristics exact={nondet['exact']}"
    )
    return {"resume_exact": det["exact"], "deterministic": det, "nondeterministic": nondet}


# -- out of memory -----------------------------------------------------------------------------------


def phase_oom(ctx: Context) -> dict[str, Any]:
    # Width 256 and 2 blocks a stage over 6,144 images: 6.4 GB an activation in the first stages (each
    # tensor under 2^31 elements, so no kernel's 32-bit indexing limit fails first), some 190 GB saved
    # for the backward: more than an H100 or an H200 holds.
    rows = ctx.scaled(6144, 64)
    fixed = {
        "width": ctx.scaled(256, 8),
        "blocks": 2,
        "train_rows": rows,
        "eval_rows": 64,
        "batch_size": rows,
        "deterministic": False,
    }
    spec = cifar.cifar_batch(ctx.batch_id(), 0, 2, {"lr": Constant(0.1)}, fixed)
    if ctx.cpu:  # no GPU to exhaust: the dry run raises what CUDA raises, to check the plumbing below
        faulty = {"fault": "cuda_oom", "fault_step": 0}
        spec = digits_batch([(1, 0, 2, {"lr": 0.1})], batch_id=ctx.batch_id(), trainer=FAULTY, fixed_values=faulty)
    root = ctx.work / "oom"
    w = worker(ctx, root, "oom")
    w.send(spec)
    rc = w.finish(300)
    failed = w.of("batch_failed")
    gone = ctx.nvml is None or ctx.nvml.wait_process(w.pid, present=False, timeout=10) is not None
    first = failed[0] if failed else {}
    reported = bool(first) and bool(first.get("oom")) and not first.get("user_error")
    ctx.log(f"  oom: exit {rc}, reported oom={first.get('oom')} user_error={first.get('user_error')}")
    return {
        "oom_reported": reported,
        "exit_code": rc,
        "memory_returned": gone,
        "error": str(first.get("error", ""))[:600],
    }


# -- preemption --------------------------------------------------------------------------------------


def phase_preempt(ctx: Context) -> dict[str, Any]:
    steps, stop_after = ctx.scaled(40, 12), ctx.scaled(10, 4)
    fixed = {
        "width": ctx.scaled(64, 8),
        "blocks": 2,
        "train_rows": ctx.scaled(16384, 512),
        "eval_rows": ctx.scaled(1024, 128),
        "minibatches": 4,
        "batch_size": ctx.scaled(512, 32),
        "deterministic": True,
    }
    hps = {"lr": Warmup(0.01, 5, Constant(0.1)), "momentum": Constant(0.9)}
    root = ctx.work / "preempt"
    straight_w = run_batch(
        ctx, root, "preempt-straight", cifar.cifar_batch(ctx.batch_id(), 0, steps, hps, fixed, seed=7)
    )
    straight = checkpoint_state(root, straight_w.checkpoint_at(steps))

    # The victim and the slot's next worker, both started ahead with their CUDA contexts (as a node
    # manager has them: a GPU slot's next worker starts as soon as its batch does).
    victim, resumer = worker(ctx, root, "preempt-victim"), worker(ctx, root, "preempt-resumer")
    nvml = ctx.nvml
    if nvml is not None:
        for w in (victim, resumer):
            if nvml.wait_process(w.pid, present=True, timeout=120) is None:
                raise RuntimeError(f"worker {w.pid} never showed a CUDA context in NVML\n{w.log_tail()}")
    victim.send(cifar.cifar_batch(ctx.batch_id(), 0, steps, hps, fixed, seed=7))
    victim.wait_step(stop_after)
    held = used_before = 0
    if nvml is not None:
        held = nvml.process_memory(victim.pid) or 0
        used_before = nvml.sample().memory_used
    t0 = time.monotonic()
    victim.preempt()
    t_gone = nvml.wait_process(victim.pid, present=False, timeout=60) if nvml is not None else None
    rc = victim.finish(120)
    t_exit = time.monotonic()
    used_after = nvml.sample().memory_used if nvml is not None else 0
    (stop,) = victim.of("batch_preempted")
    at = int(stop["step"])
    suspend_s = (t_gone if t_gone is not None else t_exit) - t0
    frees = nvml is None or (held > 0 and t_gone is not None and rc == 0 and used_before - used_after >= 0.9 * held)

    uri = str(stop["uri"])
    resumer.send(cifar.cifar_batch(ctx.batch_id(), at, steps, hps, fixed, source_uri=uri, seed=7))
    first_step = resumer.wait_step(at + 1)
    assert resumer.sent_at is not None
    resume_s = first_step - resumer.sent_at
    started = resumer.wait_for(lambda k, _p: k == "batch_started")[0] - resumer.sent_at
    if resumer.finish(300) != 0:
        raise RuntimeError(f"resumed worker failed: {resumer.of('batch_failed')}\n{resumer.log_tail()}")
    diffs = differences(straight, checkpoint_state(root, resumer.checkpoint_at(steps)))

    cold = worker(ctx, root, "preempt-cold-resumer", warm_cuda=False)
    cold.send(cifar.cifar_batch(ctx.batch_id(), at, steps, hps, fixed, source_uri=uri, seed=7))
    cold_s = cold.wait_step(at + 1) - cold.started_at
    cold.finish(300)
    out = {
        "preempt_s": suspend_s + resume_s,
        "suspend_s": suspend_s,
        "resume_s": resume_s,
        "exit_after_signal_s": t_exit - t0,
        "cold_resume_s": cold_s,
        "resume_until_batch_started_s": started,
        "resume_ready_log": _ready_line(resumer),
        "preempted_at_step": at,
        "signal_after_step": stop_after,
        "memory_held_mb": held / 2**20,
        "used_before_mb": used_before / 2**20,
        "used_after_mb": used_after / 2**20,
        "preempt_frees_memory": frees,
        "resume_exact": not diffs,
        "differences": diffs[:20],
    }
    ctx.log(
        f"  preempt: suspend {suspend_s:.2f} s + resume {resume_s:.2f} s (cold {cold_s:.2f} s); held "
        f"{held / 2**20:.0f} MB, freed={frees}; resumed exact={not diffs}"
    )
    return out


def _ready_line(w: SlotWorker) -> str:
    """The worker's own account of its batch's start (``batch ready to train: init ..., restore ...``)."""
    lines = [line for line in w.log_tail(200).splitlines() if "batch ready to train" in line]
    return lines[-1][:300] if lines else ""


# -- Ray Tune ----------------------------------------------------------------------------------------


async def _raytune(ctx: Context) -> dict[str, Any]:
    from tests.bench.raytune_workloads import TrialWork, max_abs_diff, merge_rate, s1_work, unique_steps
    from tests.bench.vs_raytune import RaySide, RunFigures, StagetreeSide

    fixed = {"hidden": 256, "minibatches": ctx.minibatches}
    s1 = s1_work()
    if ctx.cpu:
        s1 = s1[:6]
    warm = [TrialWork(w.trial_id, w.config, (3,)) for w in s1[:4]]
    share = 0.0 if ctx.cpu else 0.5
    home = ctx.work / "raytune"
    # Ray's actors train with the cuBLAS workspace stagetree's GPU workers get (slots.worker_env): the
    # same kernels, so both systems' finals can be compared to 1e-6
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    ray_side = RaySide(home, fixed, gpu_per_trial=share)
    st_runs: list[RunFigures] = []
    ray_runs: list[RunFigures] = []
    async with StagetreeSide(home / "stagetree", fixed, slots_per_gpu=2) as st:
        await asyncio.to_thread(ray_side.start)
        try:
            await asyncio.to_thread(ray_side.run, "warmup", warm)
            await st.run("warmup", warm)
            for i in range(ctx.runs):
                for system in ("stagetree", "ray") if i % 2 == 0 else ("ray", "stagetree"):
                    if system == "stagetree":
                        st_runs.append(await st.run("S1", s1))
                    else:
                        ray_runs.append(await asyncio.to_thread(ray_side.run, "S1", s1))
                    ctx.log(f"  {(st_runs if system == 'stagetree' else ray_runs)[-1].line()}")
        finally:
            await asyncio.to_thread(ray_side.stop)
    cold: RunFigures | None = None
    if ctx.cold:
        os.environ["STAGETREE_NM_WORKER_WARM_CUDA"] = "false"
        try:
            async with StagetreeSide(home / "stagetree-cold", fixed, slots_per_gpu=2) as st_cold:
                await st_cold.run("warmup", warm)
                cold = await st_cold.run("S1", s1)
                ctx.log(f"  {cold.line()}   (workers without a CUDA context made ahead)")
        finally:
            os.environ.pop("STAGETREE_NM_WORKER_WARM_CUDA", None)

    gpu_share = share or 1.0
    st_gpu = statistics.median(r.slot_s for r in st_runs) * gpu_share
    ray_gpu = statistics.median(r.slot_s for r in ray_runs) * gpu_share
    st_e2e = statistics.median(r.e2e_s for r in st_runs)
    ray_e2e = statistics.median(r.e2e_s for r in ray_runs)
    worst = max(
        max_abs_diff(ray_runs[0].metrics[t], r.metrics.get(t, {})) for r in st_runs for t in ray_runs[0].metrics
    )
    unique = unique_steps(s1)
    m1 = merge_rate(s1)
    out: dict[str, Any] = {
        "trials": len(s1),
        "merge_rate": m1,
        "unique_steps": unique,
        "executed_steps": [r.executed for r in st_runs],
        "stagetree_gpu_s": st_gpu,
        "ray_gpu_s": ray_gpu,
        "gpu_s_ratio_vs_raytune": ray_gpu / st_gpu,
        "target": 0.8 * m1,
        "stagetree_e2e_s": st_e2e,
        "ray_e2e_s": ray_e2e,
        "e2e_ratio_vs_raytune": ray_e2e / st_e2e,
        "max_abs_diff_vs_ray": worst,
        "exact": worst <= 1e-6 and all(r.executed == unique for r in st_runs),
        "runs": ctx.runs,
        "minibatches_per_step": ctx.minibatches,
    }
    if cold is not None:
        out["stagetree_cold_gpu_s"] = cold.slot_s * gpu_share
        out["stagetree_cold_e2e_s"] = cold.e2e_s
        out["gpu_s_ratio_vs_raytune_cold"] = ray_gpu / (cold.slot_s * gpu_share)
    ctx.log(
        f"  raytune: GPU-s stagetree {st_gpu:.1f} ray {ray_gpu:.1f} ratio {ray_gpu / st_gpu:.2f} (target "
        f"{0.8 * m1:.2f}); e2e {st_e2e:.1f} / {ray_e2e:.1f} s; max |diff| {worst:.1e}"
    )
    return out


def phase_raytune(ctx: Context) -> dict[str, Any]:
    try:
        import ray  # noqa: F401
        from ray import tune  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"Ray Tune is not installed here ({e}): pip install 'ray[tune]==2.60.0'") from None
    return asyncio.run(_raytune(ctx))


# -- packing -----------------------------------------------------------------------------------------


class Sampler:
    """NVML every ``interval_s`` in a thread: the GPU's utilization and memory, and each process's SM
    utilization (``nvmlDeviceGetProcessUtilization``: the share of time its kernels ran on the SMs)."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.util: list[float] = []
        self.memory: list[int] = []
        self.procs: list[int] = []
        self.sm: dict[int, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)

    def _run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            last = 0
            while not self._stop.wait(self.interval_s):
                self.util.append(float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu))
                self.memory.append(int(pynvml.nvmlDeviceGetMemoryInfo(h).used))
                self.procs.append(len(pynvml.nvmlDeviceGetComputeRunningProcesses(h)))
                try:
                    for s in pynvml.nvmlDeviceGetProcessUtilization(h, last):
                        self.sm.setdefault(int(s.pid), []).append(float(s.smUtil))
                        last = max(last, int(s.timeStamp))
                except pynvml.NVMLError:
                    pass  # no sample since the last one
        finally:
            pynvml.nvmlShutdown()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def summary(self) -> dict[str, Any]:
        per_proc = [statistics.mean(v) for v in self.sm.values() if v]
        return {
            "gpu_util_mean": statistics.mean(self.util) if self.util else None,
            "gpu_util_max": max(self.util) if self.util else None,
            "memory_used_max_mb": max(self.memory) / 2**20 if self.memory else None,
            "processes_max": max(self.procs) if self.procs else None,
            "process_sm_util_mean": statistics.mean(per_proc) if per_proc else None,
        }


async def _pack(ctx: Context, name: str, slots_per_gpu: int, mps: bool) -> dict[str, Any]:
    from stagetree.client.sdk import Study, connect
    from stagetree.embedded import Embedded, EmbeddedSettings
    from tests.bench.vs_raytune import attempt_slot_seconds

    trials, steps = ctx.scaled(8, 4), ctx.scaled(150, 10)
    fixed = {
        "width": 16,
        "blocks": 1,
        "train_rows": ctx.scaled(8192, 512),
        "eval_rows": ctx.scaled(1024, 128),
        "minibatches": ctx.scaled(8, 2),
        "batch_size": ctx.scaled(128, 32),
        "deterministic": False,
    }
    settings = EmbeddedSettings(
        home=ctx.work / f"packing-{name}",
        workers=slots_per_gpu,  # CPU slots in the --cpu dry run
        slots_per_gpu=slots_per_gpu,
        mps=mps,
        threads_per_worker=1,
    )
    async with Embedded(settings) as cluster, connect(cluster.target, token=cluster.token) as client:
        await cluster.workers_ready()  # the packing is timed without the start-up
        study = await Study.create(
            client,
            f"packing-{name}",
            trainer=cifar.ENTRY_POINT,
            dataset=cifar.DATASET,
            model="resnet-w16",
            seed=0,
            values=fixed,
            tuned=["lr"],
        )
        sampler = Sampler() if ctx.nvml is not None else None
        since = time.time()
        t0 = time.perf_counter()
        with sampler if sampler is not None else contextlib.nullcontext():
            evals = (study.submit({"lr": Constant(round(0.02 + 0.01 * i, 4))}, steps) for i in range(trials))
            results = await asyncio.wait_for(asyncio.gather(*evals), PACKING_TIMEOUT_S)
            wall = time.perf_counter() - t0
        slot_s = await asyncio.to_thread(attempt_slot_seconds, cluster.app.store, since)
    out = {
        "slots": slots_per_gpu,
        "mps": mps,
        "trials": trials,
        "steps": steps,
        "wall_s": wall,
        "trials_per_hour": trials / wall * 3600,
        "slot_s": slot_s,
        "accuracy_mean": statistics.mean(float(r["accuracy"]) for r in results),
        **(sampler.summary() if sampler is not None else {}),
    }
    ctx.log(
        f"  packing {name}: {trials} trials in {wall:.1f} s ({out['trials_per_hour']:.0f}/h), GPU util "
        f"{out.get('gpu_util_mean')}, memory max {out.get('memory_used_max_mb')} MB"
    )
    return out


def phase_packing(ctx: Context) -> dict[str, Any]:
    configs: list[tuple[str, int, bool]] = [("one", 1, False), ("packed", 4, False)]
    mps_ok = not ctx.cpu and shutil.which("nvidia-cuda-mps-control") is not None
    if mps_ok:
        configs.append(("mps", 4, True))
    out: dict[str, Any] = {"mps_available": mps_ok}
    for name, slots, mps in configs:
        try:
            out[name] = asyncio.run(_pack(ctx, name, slots, mps))
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            ctx.log(f"  packing {name} failed: {type(e).__name__}: {e}")
    one = out["one"].get("trials_per_hour")
    for name in ("packed", "mps"):
        tph = out.get(name, {}).get("trials_per_hour")
        if one and tph:
            out[f"{name}_vs_one"] = tph / one
    return out


# -- the bench ---------------------------------------------------------------------------------------

PHASE_FUNCS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "probe": phase_probe,
    "resume": phase_resume,
    "oom": phase_oom,
    "preempt": phase_preempt,
    "raytune": phase_raytune,
    "packing": phase_packing,
}


def figures(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The last line's keys and values from the phases' results (nan / false where a phase failed)."""
    probe, resume, preempt = results.get("probe", {}), results.get("resume", {}), results.get("preempt", {})
    name = str(probe.get("device") or probe.get("nvml_name") or "unknown")
    exact = [r.get("resume_exact") for r in (resume, preempt) if "resume_exact" in r]
    return {
        "device": "-".join(name.split()),
        "resume_exact": bool(exact) and all(exact),
        "mps_packing_vs_one": float(results.get("packing", {}).get("mps_vs_one", math.nan)),
        "preempt_s": float(preempt.get("preempt_s", math.nan)),
        "preempt_frees_memory": bool(preempt.get("preempt_frees_memory", False)),
        "gpu_s_ratio_vs_raytune": float(results.get("raytune", {}).get("gpu_s_ratio_vs_raytune", math.nan)),
    }


def last_line(f: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.2f}"
        return str(v)

    return " ".join(f"{k}={fmt(v)}" for k, v in f.items())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.bench.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    p.add_argument("--json", type=Path, default=None, help="write the figures and every phase's details here")
    p.add_argument("--merge", type=Path, default=None, help="start from this earlier --json (phases rerun replace)")
    p.add_argument("--work", type=Path, default=None, help="work directory (default: a temporary one)")
    p.add_argument("--runs", type=int, default=1, help="timed S1 runs per system in the raytune phase (median)")
    p.add_argument("--minibatches", type=int, default=50, help="minibatches per S1 step (the digits MLP)")
    p.add_argument("--no-cold", action="store_true", help="raytune: skip the run without CUDA contexts made ahead")
    p.add_argument("--cpu", action="store_true", help="a dry run on CPU slots with small sizes (figures mean nothing)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    phases = [p.strip() for p in ns.phases.split(",") if p.strip()]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown or ns.runs < 1 or ns.minibatches < 1:
        print(f"unknown phases {unknown}; known: {list(PHASES)}" if unknown else "--runs and --minibatches >= 1")
        return 2
    if not ns.cpu and not has_gpu():
        print(NEEDS_GPU, file=sys.stderr)
        return 2
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    work = ns.work or Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    slot = build_slots([], cpu_slots=1)[0] if ns.cpu else gpu_slots()[0]
    nvml = None if ns.cpu else Nvml()
    ctx = Context(
        work.resolve(),
        ns.cpu,
        slot,
        nvml,
        runs=ns.runs,
        minibatches=ns.minibatches,
        cold=not ns.no_cold,
        log=lambda s: print(s, flush=True),
    )
    saved: dict[str, Any] = json.loads(ns.merge.read_text()) if ns.merge else {}
    results: dict[str, dict[str, Any]] = dict(saved.get("phases", {}))
    t_all = time.perf_counter()
    try:
        for phase in phases:
            print(f"{phase} ...", flush=True)
            t0 = time.perf_counter()
            try:
                res = PHASE_FUNCS[phase](ctx)
            except Exception as e:
                res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
                print(f"  {phase} FAILED: {res['error']}", flush=True)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            results[phase] = res
            if ns.json is not None:
                _write(ns.json, results)
    finally:
        if nvml is not None:
            nvml.close()
        if ns.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"total {time.perf_counter() - t_all:.0f} s")
    print(last_line(figures(results)))
    return 0


def _write(path: Path, results: dict[str, dict[str, Any]]) -> None:
    probe = results.get("probe", {})
    doc = {
        "figures": figures(results),
        "driver": probe.get("driver"),
        "cuda_driver": probe.get("cuda_driver"),
        "torch": probe.get("torch"),
        "torch_cuda": probe.get("torch_cuda"),
        "cudnn": probe.get("cudnn"),
        "command": "python -m tests.bench.gpu " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "phases": results,
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_no_nan(doc), indent=1, default=str, allow_nan=False) + "\n")
    os.replace(tmp, path)


def _no_nan(obj: Any) -> Any:
    """``obj`` with NaN as None (JSON has no NaN: a figure not measured is null)."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _no_nan(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_no_nan(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
