"""Slots: the places on this machine where one worker runs, and the environment each worker gets.

A GPU gives ``slots_per_gpu`` slots, each with ``share = 1 / slots_per_gpu`` of it (``share`` 0 means
the whole GPU, as the master reads it); a machine without a GPU gives ``cpu_slots`` CPU-only slots.
A worker sees only its slot's GPU (``CUDA_VISIBLE_DEVICES``) and, under MPS, runs with
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` set from the share, so packed trials cannot starve each other.
GPU workers also get ``CUBLAS_WORKSPACE_CONFIG`` (unless it is set), which deterministic training needs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from stagetree.core.errors import InvalidArgument
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager.gpu import GpuInfo


def build_slots(
    gpus: Sequence[GpuInfo],
    *,
    slots_per_gpu: int = 1,
    cpu_slots: int = 2,
    cpu_count: int | None = None,
    threads_per_worker: int = 1,
) -> list[SlotInfo]:
    """The slots of a machine with ``gpus`` (CPU-only slots when there are none)."""
    if slots_per_gpu < 1 or cpu_slots < 1 or threads_per_worker < 1:
        raise InvalidArgument(
            f"slots_per_gpu, cpu_slots and threads_per_worker must be >= 1, got "
            f"{slots_per_gpu}, {cpu_slots}, {threads_per_worker}"
        )
    cores = cpu_count or os.cpu_count() or 1
    if not gpus:
        return [SlotInfo(f"cpu{i}", cpu_cores=threads_per_worker) for i in range(cpu_slots)]
    per_slot_cores = max(1, cores // (len(gpus) * slots_per_gpu))
    share = 0.0 if slots_per_gpu == 1 else 1.0 / slots_per_gpu
    out = []
    for g in gpus:
        for k in range(slots_per_gpu):
            out.append(
                SlotInfo(
                    id=f"gpu{g.index}" if slots_per_gpu == 1 else f"gpu{g.index}.{k}",
                    gpu_type=g.name,
                    memory_bytes=g.memory_bytes if slots_per_gpu == 1 else g.memory_bytes // slots_per_gpu,
                    compute_capability=g.compute_capability,
                    share=share,
                    cpu_cores=per_slot_cores,
                    gpu_index=g.index,
                )
            )
    return out


# cuBLAS with a fixed workspace per stream, as PyTorch asks before a trainer may turn on deterministic
# algorithms (``torch.use_deterministic_algorithms``): set for GPU workers unless the environment says otherwise
CUBLAS_WORKSPACE = ":4096:8"
USER_PATH_ENV = "STAGETREE_USER_PATH"  # directories a worker imports the user's trainer from (runtime.trainer)


def worker_env(
    slot: SlotInfo,
    *,
    threads: int,
    mps_env: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a worker on ``slot``: ``base`` (default: this process's) plus the slot's
    device, thread and MPS settings."""
    env = dict(os.environ if base is None else base)
    # A CPU slot hides every GPU so a trainer cannot grab one by accident.
    env["CUDA_VISIBLE_DEVICES"] = str(slot.gpu_index) if slot.is_gpu else ""
    env["STAGETREE_WORKER_THREADS"] = str(threads)
    env["OMP_NUM_THREADS"] = str(threads)  # numpy/BLAS in user code: no more threads than the slot has
    env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
    if slot.is_gpu:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if slot.is_gpu and mps_env:
        env.update(mps_env)
        pct = slot.mps_thread_percentage()
        if pct is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(pct)
    return env
