"""stagetree on a real GPU: exact resume on CUDA, out of memory, preemption, Ray Tune, packing, NCCL.

    python -m tests.bench.gpu [--phases probe,resume,oom,preempt,raytune,packing,nccl] [--json FILE]
                              [--merge FILE] [--work DIR] [--budget-s S] [--snapshots DIR] ...

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
* raytune: ``tests.bench.vs_raytune``'s S1 (its first ``--s1-trials`` trials, 24 by default: 24 trials x
  40 steps of the digits MLP, the learning rate branching in three phases, merge rate 3.2, as the whole
  S1's 48) with both systems on the GPU, each running 2 trials at a time on half of it: Ray Tune with
  ``num_gpus=0.5`` per trial and ``reuse_actors``, then stagetree embedded with 2 slots on the GPU. Ray
  runs first, stopped after ``--ray-cap-s`` (its ``time_budget_s``): stopped early, its GPU-seconds and
  end-to-end time are lower bounds (``ratio_is_lower_bound``, ``ray_trials_finished``), and stagetree's
  run is measured in any case. GPU-seconds: the slot time of the work (stagetree: its slots' occupancy,
  on each slot the union of its batch attempts' spans from being sent to the node manager to their end,
  from the ledger, so a batch sent ahead is not counted while the one before it still trains; their plain
  sum is ``stagetree_gpu_s_attempt_sum``; Ray: every trial from the start of the trainable to its last
  report) times the slot's half GPU. ``gpu_s_ratio_vs_raytune`` is Ray's over
  stagetree's (target: 0.8 x the merge rate), ``e2e_ratio_vs_raytune`` likewise of the wall times; the
  finals of the trials both finished must agree to 1e-6 and stagetree must train exactly the unique
  steps. Each system warms up first (4 short trials).
* packing (HyperSack): 8 independent trials of a small ``CifarResNet`` (width 16, 128 images x 8 a step,
  150 steps; no shared prefix) on embedded clusters, placed by the master's round: 1 slot on the GPU
  with HyperSack's ``one_per_gpu`` baseline (one trial at a time), and 4 slots (plain time-slicing:
  ``packed``; under the node manager's MPS daemon, 25% of the SMs each: ``mps``) with ``wfd`` and each
  batch declaring 25% of the GPU. ``--packing`` picks the configurations. Throughput in trials per hour
  over the study's wall time; ``max_concurrent_batches`` from the ledger; NVML sampled every 0.1 s (the
  GPU's utilization, i.e. the share of time a kernel ran, the memory used, and per-process SM
  utilization). ``mps_packing_vs_one`` is MPS-packed over one at a time (HyperSack: 2.5-2.8x on A100s).
  While the trials run, the dashboard's cluster view (``/api/v1/dashboard/cluster``: the slots and the
  GPU telemetry NVML sent through the aggregator) is read every second; with ``--snapshots DIR`` the
  busiest one is written to ``DIR/cluster-<configuration>.json`` (``tests.bench.gpu_screenshot`` draws
  the Cluster page from it).
* nccl: a batch of 2 ranks through the node manager (assignment, worker group, report) on two slots of
  the one GPU, so NCCL on CUDA; ``nccl_batch_ok`` when it trained and its workers joined over NCCL.
  NCCL may refuse two ranks on one GPU: the phase then also runs one rank over NCCL alone (an
  all-reduce), which says whether NCCL itself works on the machine.

Each phase has its own time limit (``PHASE_CAPS``) and, with ``--budget-s``, no more than what is left
of the run; a phase past its limit is stopped and reported with its error, and the next one runs.

The last line printed is ``device=<name> resume_exact=<b> mps_packing_vs_one=<r> preempt_s=<t>
preempt_frees_memory=<b> gpu_s_ratio_vs_raytune=<r> e2e_ratio_vs_raytune=<r> raytune_merge_rate=<r>
nccl_batch_ok=<b>`` (a figure whose phase failed reads ``nan`` or ``false``); ``--json`` holds it with
the driver and CUDA versions and every phase's details. ``--cpu`` runs the phases on CPU slots with small
sizes: a dry run of the bench's own code (its figures mean nothing, NVML parts are skipped).
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

PHASES = ("probe", "resume", "oom", "preempt", "raytune", "packing", "nccl")
PACKING_TIMEOUT_S = 150.0
NEEDS_GPU = "tests.bench.gpu needs an NVIDIA GPU: CUDA and NVML see none on this machine (see docs/gpu.md)"


@dataclass
class Context:
    work: Path
    cpu: bool  # the --cpu dry run
    slot: SlotInfo
    nvml: Nvml | None
    minibatches: int = 50
    s1_trials: int = 24
    ray_cap_s: float = 150.0
    packing: tuple[str, ...] = ("one", "packed", "mps")
    oom_blocks: int = 2  # the oom phase's blocks a stage (more on a GPU with more memory)
    snapshots: Path | None = None  # where the packing phase writes the dashboard's cluster view it saw
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
        "blocks": ctx.oom_blocks,
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
    s1 = s1_work()[: ctx.scaled(ctx.s1_trials, 6)]
    warm = [TrialWork(w.trial_id, w.config, (3,)) for w in s1[:4]]
    share = 0.0 if ctx.cpu else 0.5
    home = ctx.work / "raytune"
    # Ray's actors train with the cuBLAS workspace stagetree's GPU workers get (slots.worker_env): the
    # same kernels, so both systems' finals can be compared to 1e-6
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    # Ray first, under its own time budget: a run that does not end in time still gives a lower bound of
    # Ray's GPU-seconds (and the trials it finished), and stagetree's run after it always gets measured.
    ray_side = RaySide(home, fixed, gpu_per_trial=share)
    await asyncio.to_thread(ray_side.start)
    try:
        await asyncio.to_thread(ray_side.run, "warmup", warm)
        ray = await asyncio.to_thread(ray_side.run, "S1", s1, ctx.ray_cap_s)
        ctx.log(f"  {ray.line()}  ({ray.notes['complete']} of {len(s1)} trials finished)")
    finally:
        await asyncio.to_thread(ray_side.stop)
    async with StagetreeSide(home / "stagetree", fixed, slots_per_gpu=2, cpu_figures=ctx.cpu) as st:
        await st.run("warmup", warm)
        st_run: RunFigures = await st.run("S1", s1)
        ctx.log(f"  {st_run.line()}")

    gpu_share = share or 1.0
    # stagetree: its slots' occupancy (a batch sent ahead while the one before it trains is not on the
    # device yet); Ray: each trial's span on its actor
    st_gpu, ray_gpu = float(st_run.notes["slot_held_s"]) * gpu_share, ray.slot_s * gpu_share
    complete = int(ray.notes["complete"])
    capped = complete < len(s1)
    common = [t for t in ray.metrics if t in st_run.metrics]
    worst = max((max_abs_diff(ray.metrics[t], st_run.metrics[t]) for t in common), default=math.nan)
    unique, m1 = unique_steps(s1), merge_rate(s1)
    out: dict[str, Any] = {
        "trials": len(s1),
        "steps_per_trial": max(w.stop for w in s1),
        "merge_rate": m1,
        "unique_steps": unique,
        "executed_steps": st_run.executed,
        "stagetree_gpu_s": st_gpu,
        "stagetree_gpu_s_attempt_sum": st_run.slot_s * gpu_share,  # every attempt from sent to end, added up
        "ray_gpu_s": ray_gpu,
        "ray_trials_finished": complete,
        "ray_capped_s": ctx.ray_cap_s if capped else None,
        # Ray stopped by its budget: its GPU-seconds (and so the ratio) are lower bounds
        "ratio_is_lower_bound": capped,
        "gpu_s_ratio_vs_raytune": ray_gpu / st_gpu,
        "target": 0.8 * m1,
        "stagetree_e2e_s": st_run.e2e_s,
        "ray_e2e_s": ray.e2e_s,
        "e2e_ratio_vs_raytune": ray.e2e_s / st_run.e2e_s,
        "max_abs_diff_vs_ray": worst,
        "compared_trials": len(common),
        "exact": worst <= 1e-6 and st_run.executed == unique,
        "minibatches_per_step": ctx.minibatches,
    }
    bound = ">=" if capped else ""
    ctx.log(
        f"  raytune: GPU-s stagetree {st_gpu:.1f} ray {bound}{ray_gpu:.1f} ratio {bound}{ray_gpu / st_gpu:.2f} "
        f"(target {0.8 * m1:.2f}, merge rate {m1:.2f}); e2e {st_run.e2e_s:.1f} / {bound}{ray.e2e_s:.1f} s; "
        f"max |diff| {worst:.1e} over {len(common)} trials"
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


class ClusterViewSampler:
    """The dashboard's cluster view (``GET /api/v1/dashboard/cluster``, what its Cluster page draws) read
    every ``interval_s`` in a thread while a study runs: ``best`` is the view whose GPUs were busiest (the
    GPU telemetry the node manager's NVML probe sent through the aggregator), ``gpu_samples`` how many
    views carried GPU telemetry."""

    def __init__(self, http_url: str, token: str, interval_s: float = 1.0) -> None:
        self.url = f"{http_url}/api/v1/dashboard/cluster"
        self.token = token
        self.interval_s = interval_s
        self.best: dict[str, Any] | None = None
        self.gpu_samples = 0
        self._score = -1.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-view", daemon=True)

    def _run(self) -> None:
        import urllib.request

        req = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self.token}"})
        while not self._stop.wait(self.interval_s):
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    view = json.loads(resp.read())
            except OSError:
                continue
            gpus = [g for nm in view.get("node_managers", []) for g in nm.get("gpus", [])]
            if gpus:
                self.gpu_samples += 1
            busy = view.get("summary", {}).get("busy", 0)
            score = sum(float(g.get("utilization") or 0) for g in gpus) + busy
            if score > self._score:
                self._score, self.best = score, view

    def __enter__(self) -> ClusterViewSampler:
        if self.url.startswith("http"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)


def max_concurrent_attempts(store: Any, since: float) -> int:
    """The most batch attempts (dispatched at or after ``since``) that trained at once, from the ledger's
    start and end times: how many the placement packed together."""
    from sqlalchemy import select

    from stagetree.master.store import models as m

    a = m.BatchAttempt
    with store.ledger.db.tx("bench concurrency") as s:
        rows = s.execute(select(a.started_at, a.finished_at).where(a.dispatched_at >= since)).all()
    edges = sorted(
        [(float(st), 1) for st, end in rows if st is not None and end is not None]
        + [(float(end), -1) for st, end in rows if st is not None and end is not None]
    )
    most = now = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


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
        http_port=0,  # the dashboard's cluster view is sampled while the trials run
    )
    async with Embedded(settings) as cluster, connect(cluster.target, token=cluster.token) as client:
        await cluster.workers_ready()  # the packing is timed without the start-up
        # HyperSack's placement through the master's round: the study declares each batch's share of the
        # GPU (25 %: 4 fit on one), and ``wfd`` packs them; one at a time is its ``one_per_gpu`` baseline
        placement: dict[str, Any] = (
            {"placement": "wfd", "placement_params": {"compute": 100.0 / slots_per_gpu}}
            if slots_per_gpu > 1
            else {"placement": "one_per_gpu"}
        )
        study = await Study.create(
            client,
            f"packing-{name}",
            trainer=cifar.ENTRY_POINT,
            dataset=cifar.DATASET,
            model="resnet-w16",
            seed=0,
            values=fixed,
            tuned=["lr"],
            policies=placement,
        )
        sampler = Sampler() if ctx.nvml is not None else None
        views = ClusterViewSampler(cluster.http_url, cluster.token)
        since = time.time()
        t0 = time.perf_counter()
        with sampler if sampler is not None else contextlib.nullcontext(), views:
            evals = (study.submit({"lr": Constant(round(0.02 + 0.01 * i, 4))}, steps) for i in range(trials))
            results = await asyncio.wait_for(asyncio.gather(*evals), PACKING_TIMEOUT_S)
            wall = time.perf_counter() - t0
        slot_s = await asyncio.to_thread(attempt_slot_seconds, cluster.app.store, since)
        concurrent = await asyncio.to_thread(max_concurrent_attempts, cluster.app.store, since)
    if ctx.snapshots is not None and views.best is not None:
        ctx.snapshots.mkdir(parents=True, exist_ok=True)
        (ctx.snapshots / f"cluster-{name}.json").write_text(json.dumps(views.best, indent=1) + "\n")
    out = {
        "slots": slots_per_gpu,
        "mps": mps,
        "trials": trials,
        "steps": steps,
        "wall_s": wall,
        "trials_per_hour": trials / wall * 3600,
        "slot_s": slot_s,
        "placement": placement,
        "max_concurrent_batches": concurrent,
        "dashboard_gpu_samples": views.gpu_samples,
        "accuracy_mean": statistics.mean(float(r["accuracy"]) for r in results),
        **(sampler.summary() if sampler is not None else {}),
    }
    ctx.log(
        f"  packing {name}: {trials} trials in {wall:.1f} s ({out['trials_per_hour']:.0f}/h), GPU util "
        f"{out.get('gpu_util_mean')}, memory max {out.get('memory_used_max_mb')} MB"
    )
    return out


def phase_packing(ctx: Context) -> dict[str, Any]:
    mps_ok = not ctx.cpu and shutil.which("nvidia-cuda-mps-control") is not None
    known = {"one": (1, False), "packed": (4, False), "mps": (4, True)}
    configs = [(n, *known[n]) for n in ctx.packing if n != "mps" or mps_ok]
    out: dict[str, Any] = {"mps_available": mps_ok}
    for name, slots, mps in configs:
        try:
            out[name] = asyncio.run(_pack(ctx, name, slots, mps))
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            ctx.log(f"  packing {name} failed: {type(e).__name__}: {e}")
    one = out.get("one", {}).get("trials_per_hour")
    for name in ("packed", "mps"):
        tph = out.get(name, {}).get("trials_per_hour")
        if one and tph:
            out[f"{name}_vs_one"] = tph / one
    return out


# -- NCCL --------------------------------------------------------------------------------------------

NCCL_ONE_RANK = r"""
import datetime, json, os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
print(json.dumps({"ok": t.tolist() == [1.0] * 4, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}))
dist.destroy_process_group()
"""


async def _nccl_batch(ctx: Context) -> dict[str, Any]:
    """A batch of 2 ranks through the node manager (its assignment, its worker group, its report), on
    two slots of the one GPU: NCCL on CUDA slots, gloo in the --cpu dry run."""
    import dataclasses

    from stagetree.nodemanager.agent import NodeManager
    from stagetree.nodemanager.examples.faults import TORCH_ENTRY_POINT
    from stagetree.nodemanager.link import RUN, Assignment
    from stagetree.nodemanager.reporting import GrpcReporter
    from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
    from stagetree.nodemanager.workers import ForkserverLauncher
    from tests.unit.nodemanager.fakes import FakeLink

    root = ctx.work / "nccl"
    link = FakeLink()
    store = LocalCheckpointStore(root / "ckpt", fsync=False)
    launcher = ForkserverLauncher(str(store.root), root / "work", progress_interval_s=0.0)
    slots = build_slots([], cpu_slots=2) if ctx.cpu else gpu_slots(slots_per_gpu=2)
    nm = NodeManager(link, GrpcReporter(link), slots[:2], launcher, node_manager_id="bench-nccl", store=store)
    stop = asyncio.Event()
    task = asyncio.create_task(nm.run(stop))
    steps = 20
    spec = digits_batch([(1, 0, steps, {"lr": 0.1, "bs": 32})], batch_id=ctx.batch_id(), trainer=TORCH_ENTRY_POINT)
    spec = dataclasses.replace(spec, slots=2)
    t0 = time.perf_counter()
    try:
        link.feed.put_nowait(Assignment(spec.batch_id, 1, RUN, json.dumps(spec.to_json())))
        deadline = time.monotonic() + 120
        while not (reports := [r for r in link.reports if r.batch_id == spec.batch_id]):
            if time.monotonic() > deadline:
                raise TimeoutError("no report of the 2-rank batch in 120 s")
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    logs = "\n".join(f.read_text(errors="replace") for f in (root / "work").rglob("*.log"))
    backend = next((b for b in ("nccl", "gloo") if f"backend={b}" in logs), "unknown")
    report = reports[0]
    return {
        "ok": bool(report.ok),
        "error": str(report.error or "")[:1500],
        "backend_in_logs": backend,
        "seconds": time.perf_counter() - t0,
        "slots": [sl.id for sl in slots[:2]],
    }


def phase_nccl(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {"two_ranks": asyncio.run(_nccl_batch(ctx))}
    two = out["two_ranks"]
    ctx.log(
        f"  nccl: 2 ranks on one GPU through the node manager: ok={two['ok']} backend {two['backend_in_logs']}"
        + (f" ({two['error'][:200]})" if not two["ok"] else "")
    )
    if not ctx.cpu:  # whether NCCL itself runs here (the fallback when it refuses two ranks on one GPU)
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-c", NCCL_ONE_RANK],
            capture_output=True,
            text=True,
            timeout=90,
            env={**os.environ, "PORT": str(port)},
        )
        last = res.stdout.strip().splitlines()[-1:] or ["{}"]
        one = json.loads(last[0]) if res.returncode == 0 else {"ok": False, "error": res.stderr[-1500:]}
        out["one_rank"] = one
        ctx.log(f"  nccl: 1 rank over NCCL: {one}")
    out["nccl_batch_ok"] = bool(two["ok"]) and (ctx.cpu or two["backend_in_logs"] == "nccl")
    return out


# -- the bench ---------------------------------------------------------------------------------------

PHASE_FUNCS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "probe": phase_probe,
    "resume": phase_resume,
    "oom": phase_oom,
    "preempt": phase_preempt,
    "raytune": phase_raytune,
    "packing": phase_packing,
    "nccl": phase_nccl,
}
# Each phase's own time limit (seconds); with --budget-s a phase also gets no more than what is left
PHASE_CAPS = {"probe": 60, "resume": 120, "oom": 60, "preempt": 120, "raytune": 300, "packing": 240, "nccl": 150}


class PhaseTimeout(Exception):
    pass


@contextlib.contextmanager
def phase_limit(seconds: float, phase: str) -> Any:
    """Raise ``PhaseTimeout`` in this (the main) thread after ``seconds``: a phase that hangs costs its
    limit, not the call (what it started is stopped by its own ``finally`` blocks)."""
    import signal

    def _expired(signum: int, frame: Any) -> None:
        raise PhaseTimeout(f"{phase} ran past its {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def figures(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The last line's keys and values from the phases' results (nan / false where a phase failed)."""
    probe, resume, preempt = results.get("probe", {}), results.get("resume", {}), results.get("preempt", {})
    raytune = results.get("raytune", {})
    name = str(probe.get("device") or probe.get("nvml_name") or "unknown")
    exact = [r.get("resume_exact") for r in (resume, preempt) if "resume_exact" in r]
    return {
        "device": "-".join(name.split()),
        "resume_exact": bool(exact) and all(exact),
        "mps_packing_vs_one": float(results.get("packing", {}).get("mps_vs_one", math.nan)),
        "preempt_s": float(preempt.get("preempt_s", math.nan)),
        "preempt_frees_memory": bool(preempt.get("preempt_frees_memory", False)),
        "gpu_s_ratio_vs_raytune": float(raytune.get("gpu_s_ratio_vs_raytune", math.nan)),
        "e2e_ratio_vs_raytune": float(raytune.get("e2e_ratio_vs_raytune", math.nan)),
        "raytune_merge_rate": float(raytune.get("merge_rate", math.nan)),
        "nccl_batch_ok": bool(results.get("nccl", {}).get("nccl_batch_ok", False)),
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
    p.add_argument("--minibatches", type=int, default=50, help="minibatches per S1 step (the digits MLP)")
    p.add_argument(
        "--s1-trials", type=int, default=24, help="raytune: the first N of S1's 48 trials (24: merge rate 3.2)"
    )
    p.add_argument("--ray-cap-s", type=float, default=150.0, help="raytune: Ray Tune's S1 run stops after this long")
    p.add_argument("--packing", default="one,packed,mps", help="packing: the configurations, of one, packed, mps")
    p.add_argument("--oom-blocks", type=int, default=2, help="oom: blocks a stage (2 exhaust 80 GB, 8 for 141 GB)")
    p.add_argument("--snapshots", type=Path, default=None, help="packing: write the dashboard's cluster views here")
    p.add_argument(
        "--budget-s", type=float, default=None, help="the whole run's time: a phase gets at most what is left"
    )
    p.add_argument("--cpu", action="store_true", help="a dry run on CPU slots with small sizes (figures mean nothing)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    phases = [p.strip() for p in ns.phases.split(",") if p.strip()]
    unknown = sorted(set(phases) - set(PHASES))
    packing = tuple(n.strip() for n in ns.packing.split(",") if n.strip())
    if unknown or ns.minibatches < 1 or not 1 <= ns.s1_trials <= 48 or set(packing) - {"one", "packed", "mps"}:
        print(
            f"unknown phases {unknown}; known: {list(PHASES)}"
            if unknown
            else "--minibatches >= 1, --s1-trials in 1..48, --packing of one, packed, mps"
        )
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
        minibatches=ns.minibatches,
        s1_trials=ns.s1_trials,
        ray_cap_s=ns.ray_cap_s,
        packing=packing,
        snapshots=ns.snapshots,
        oom_blocks=ns.oom_blocks,
        log=lambda s: print(s, flush=True),
    )
    saved: dict[str, Any] = json.loads(ns.merge.read_text()) if ns.merge else {}
    results: dict[str, dict[str, Any]] = dict(saved.get("phases", {}))
    t_all = time.perf_counter()
    try:
        for phase in phases:
            cap = float(PHASE_CAPS[phase])
            if ns.budget_s is not None:
                cap = min(cap, ns.budget_s - (time.perf_counter() - t_all))
                if cap < 20:
                    print(f"{phase}: skipped, {cap:.0f} s left of --budget-s", flush=True)
                    continue
            print(f"{phase} ... (at most {cap:.0f} s)", flush=True)
            t0 = time.perf_counter()
            try:
                with phase_limit(cap, phase):
                    res = PHASE_FUNCS[phase](ctx)
            except BaseException as e:  # PhaseTimeout included: the next phase still runs
                if isinstance(e, KeyboardInterrupt | SystemExit):
                    raise
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
