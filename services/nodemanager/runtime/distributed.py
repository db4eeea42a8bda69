"""The ranks of a multi-slot batch: one ``torch.distributed`` group of its worker processes.

A batch with ``spec.slots == n > 1`` runs as ``n`` worker processes on ``n`` slots of one node manager.
The node manager hands each its ``RankInfo`` in the spec's ``extra["rank"]`` (the spec travels to a
worker started ahead, so the rendezvous is known only then); the worker sets the usual variables
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``) and joins the group with
``join_group``: NCCL when the batch trains on CUDA, gloo otherwise (CPU slots).

``RankGroup`` is what the batch loop needs of the group, and nothing more:

* ``step_sync(flags, values)``: after each step, in one all-reduce (on two busy cores a small
  collective costs milliseconds: ``tests.bench.multigpu``), every rank's bit flags OR-ed together, so
  that a decision one rank takes alone (a preemption signal, a checkpoint due by the clock) is taken by
  all at the same step (a checkpoint gathers every rank's RNG state, which is a collective), and the
  step metrics averaged over the ranks;
* ``gather(obj)``: every rank's object on rank 0 (RNG states), None elsewhere.

A single-process batch gets ``SINGLE_RANK``, whose calls cost nothing.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stagetree.nodemanager.runtime.ranks import RankInfo

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0  # a collective that waits longer fails the rank (a peer hung, not died)


def backend_for(device: torch.device) -> str:
    """NCCL for ranks on CUDA devices (when this torch has it), gloo for CPU ranks."""
    if device.type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


class RankGroup:
    """The collectives the batch loop uses; on one rank (``SINGLE_RANK``) they are identities."""

    def __init__(self, info: RankInfo, device: torch.device | None = None) -> None:
        self.info = info
        self.device = device or torch.device("cpu")  # where its tensors go (NCCL: the rank's GPU)

    @property
    def distributed(self) -> bool:
        return self.info.distributed

    @property
    def leader(self) -> bool:
        return self.info.leader

    def step_sync(self, flags: int, values: Mapping[str, Any] | None) -> tuple[int, dict[str, float] | None]:
        """``flags`` (8 bits) OR-ed over every rank, and the step metrics ``values`` (numbers or 0-d
        tensors; every rank reports the same names) averaged over the ranks, in one all-reduce (each rank
        must call it at the same point)."""
        return self.start_sync(flags, values).wait()

    def start_sync(self, flags: int, values: Mapping[str, Any] | None, step: int = 0, at: float = 0.0) -> StepSync:
        """``step_sync`` started, not waited for: the all-reduce runs while the next step trains, and the
        caller takes its result (``wait``) one step later (``step`` and ``at`` ride along)."""
        given = values or {}
        names = tuple(sorted(given))
        if not self.distributed:
            return StepSync(None, flags, {n: float(given[n]) for n in names}, values is not None, 1, step, at)
        row = [float((flags >> i) & 1) for i in range(_FLAG_BITS)] + [float(given[n]) for n in names]
        buf = torch.tensor(row, dtype=torch.float64, device=self.device)
        work = dist.all_reduce(buf, async_op=True)
        return StepSync((work, buf, names), 0, {}, values is not None, self.info.world_size, step, at)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (by rank) on rank 0; None on the others."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.info.world_size if self.leader else None
        dist.gather_object(obj, out, dst=0)
        return out


SINGLE_RANK = RankGroup(RankInfo())
_FLAG_BITS = 8


@dataclass
class StepSync:
    """A ``RankGroup.start_sync`` in flight; ``wait`` gives the OR-ed flags and the averaged metrics (None
    when the step reported none) of step ``step``, which ended at ``at``."""

    _inflight: tuple[Any, torch.Tensor, tuple[str, ...]] | None
    _flags: int
    _values: dict[str, float]
    _reported: bool
    _world: int
    step: int
    at: float

    def wait(self) -> tuple[int, dict[str, float] | None]:
        if self._inflight is not None:
            work, buf, names = self._inflight
            self._inflight = None
            work.wait()
            got = buf.tolist()
            self._flags = sum(1 << i for i in range(_FLAG_BITS) if got[i] > 0)
            self._values = {n: got[_FLAG_BITS + i] / self._world for i, n in enumerate(names)}
        return self._flags, self._values if self._reported else None


def join_group(info: RankInfo, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> RankGroup:
    """Set this process's rank variables and join the group (blocks until every rank has joined, up to
    ``timeout_s``). On one rank, nothing to join."""
    if not info.distributed:
        return SINGLE_RANK
    os.environ.update(info.env())
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # each rank sees its slot's GPU only
    log.info(
        "joining the batch's process group",
        extra={"rank": info.rank, "world_size": info.world_size, "backend": backend, "port": info.port},
    )
    dist.init_process_group(
        backend,
        init_method=f"tcp://{info.addr}:{info.port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return RankGroup(info, device if backend == "nccl" else torch.device("cpu"))


def data_parallel(model: torch.nn.Module, device: torch.device, world_size: int) -> torch.nn.Module:
    """``model`` wrapped in ``DistributedDataParallel`` on a group of several ranks (the group is joined:
    this broadcasts rank 0's parameters), else ``model`` itself."""
    if world_size <= 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index or 0] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


_DIST_ERRORS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(dist, "DistError", None),) if isinstance(t, type) and issubclass(t, BaseException)
)
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "gloo", "nccl")


def is_peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is a collective failing because another rank went away: no fault
    of this rank's code, whatever frame it surfaced in."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _DIST_ERRORS):
            return True
        text = str(e).lower()
        if isinstance(e, RuntimeError) and any(m in text for m in _PEER_LOST):
            return True
        e = e.__cause__ or e.__context__
    return False
