"""A slot as a node manager registers it: a whole GPU, a share of one (MPS), or CPU cores.

The one registered-slot type: the node manager builds these from NVML, the master stores them, and
the scheduler's policies read them (``core.scheduler.Slot`` is where a batch can be placed in a round).
"""

from __future__ import annotations

import math
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
