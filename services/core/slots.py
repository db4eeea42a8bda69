"""A slot as a node manager registers it: a whole GPU, a share of one (MPS), or CPU cores.

Two types, one per concept: ``SlotInfo`` is a slot as its node manager registers it (built from NVML,
stored by the master); ``Slot`` is that slot where the master places work (which node manager and
device it is on), the one the scheduler and the policies read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

CPU = "cpu"


@dataclass(frozen=True)
class SlotInfo:
    """One slot (``Slot`` in master.proto); the GPU's details come from NVML, a CPU slot has none."""

    id: str
    gpu_type: str = CPU
    memory_bytes: int = 0
    compute_capability: str = ""
    share: float = 0.0  # fraction of the GPU; 0 = the whole GPU (and always 0 for a CPU slot)
    cpu_cores: int = 0
    gpu_index: int = -1  # -1 for a CPU slot

    @property
    def is_gpu(self) -> bool:
        return self.gpu_index >= 0

    def mps_thread_percentage(self) -> int | None:
        """The MPS active-thread percentage for this slot's share (None: the whole GPU or CPU)."""
        if not self.is_gpu or self.share <= 0 or self.share >= 1:
            return None
        return max(1, min(100, math.ceil(self.share * 100)))


@dataclass(frozen=True)
class Slot:
    """A registered slot as the scheduler places work on it: its node manager and what its device offers."""

    id: str
    node_manager: str = ""
    gpu_type: str = CPU
    gpu_index: int = -1  # -1 for a CPU slot
    memory_bytes: int = 0
    cpu_cores: int = 0

    @classmethod
    def on(cls, node_manager: str, info: SlotInfo) -> Slot:
        return cls(info.id, node_manager, info.gpu_type, info.gpu_index, info.memory_bytes, info.cpu_cores)

    @property
    def device(self) -> str:
        """The device the slot shares with the node manager's other slots on it (a GPU, or the CPU)."""
        dev = f"gpu{self.gpu_index}" if self.gpu_index >= 0 else "cpu"
        return f"{self.node_manager}/{dev}"

    @property
    def rank_place(self) -> str:
        """What two ranks of one batch never share: a GPU (NCCL refuses two ranks on one device, "Duplicate
        GPU detected", and a second rank there would add no memory), or for a CPU slot the slot itself."""
        return self.device if self.gpu_index >= 0 else f"{self.node_manager}/{self.id}"


def rank_places(slots: Iterable[Slot]) -> dict[str, int]:
    """Node manager -> the most ranks one batch can have there: its CPU slots, or its GPUs (not their
    slots: a GPU shared by several slots holds one rank of a batch)."""
    places: dict[str, set[str]] = {}
    for s in slots:
        places.setdefault(s.node_manager, set()).add(s.rank_place)
    return {nm: len(p) for nm, p in places.items()}


def keeps_snapshots_on(slots: Sequence[Slot]) -> bool:
    """Whether a batch placed on ``slots`` can keep an in-memory snapshot of every step it trains: on one
    CPU slot only (on a GPU a copy per step would make every step wait for the device; a batch on several
    ranks saves from rank 0 alone)."""
    return len(slots) == 1 and slots[0].gpu_type == CPU
