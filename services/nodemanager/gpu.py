"""What GPUs this machine has and how busy they are: the ``GpuProbe`` port and its NVML adapter.

``NvmlGpuProbe`` asks NVML (``pynvml``, from ``nvidia-ml-py``) for each GPU's name, memory and compute
capability, and samples utilization, memory in use and per-process memory for telemetry. A machine
without the NVIDIA driver, or with no GPU, is not an error: the probe finds no GPU, says so in one log
line, and the node manager runs CPU-only slots. ``StaticGpuProbe`` reports a fixed list (tests, and
machines where NVML must not be touched).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as a slot needs it: its NVML index, model name, memory and compute capability."""

    index: int
    name: str
    memory_bytes: int
    compute_capability: str  # "major.minor", e.g. "9.0"


@dataclass(frozen=True)
class GpuSample:
    """One telemetry sample of one GPU; ``processes`` maps pid to the GPU memory it holds (bytes)."""

    index: int
    utilization: float  # percent of time a kernel ran over the last sample period
    memory_used: int
    memory_total: int
    processes: dict[int, int] = field(default_factory=dict)


class GpuProbe(ABC):
    """Finds this machine's GPUs and samples them."""

    @abstractmethod
    def gpus(self) -> list[GpuInfo]:
        """The GPUs workers may use; empty when there are none (or no driver). Never raises."""

    @abstractmethod
    def sample(self) -> list[GpuSample]:
        """A telemetry sample of every GPU; empty without GPUs. Never raises."""

    def close(self) -> None:  # noqa: B027  (an optional hook: most probes hold nothing)
        """Release the driver handle, if any."""


class StaticGpuProbe(GpuProbe):
    """A fixed list of GPUs (samples report them idle)."""

    def __init__(self, gpus: Sequence[GpuInfo] = ()) -> None:
        self._gpus = list(gpus)

    def gpus(self) -> list[GpuInfo]:
        return list(self._gpus)

    def sample(self) -> list[GpuSample]:
        return [GpuSample(g.index, 0.0, 0, g.memory_bytes) for g in self._gpus]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlGpuProbe(GpuProbe):
    """GPUs through NVML. Initializes NVML on first use; without it, behaves as a machine with no GPU."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._handles: list[tuple[int, Any]] | None = None  # None: not probed yet

    def _init(self) -> list[tuple[int, Any]]:
        if self._handles is not None:
            return self._handles
        self._handles = []
        try:
            import pynvml  # type: ignore[import-untyped]

            pynvml.nvmlInit()
            self._nvml = pynvml
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            log.info("no NVIDIA GPU usable (%s): running CPU-only slots", e, extra={"reason": repr(e)})
            self._shutdown()
            return self._handles
        if not self._handles:
            log.info("NVML sees no GPU: running CPU-only slots")
        return self._handles

    def gpus(self) -> list[GpuInfo]:
        with self._lock:
            out = []
            for index, h in self._init():
                try:
                    nv = self._nvml
                    major, minor = nv.nvmlDeviceGetCudaComputeCapability(h)
                    mem = nv.nvmlDeviceGetMemoryInfo(h)
                    out.append(GpuInfo(index, _text(nv.nvmlDeviceGetName(h)), int(mem.total), f"{major}.{minor}"))
                except Exception as e:  # a GPU that fell off the bus, a MIG parent, ...
                    log.warning("GPU %d skipped: NVML cannot describe it (%s)", index, e, extra={"gpu_index": index})
            return out

    def sample(self) -> list[GpuSample]:
        with self._lock:
            out = []
            for index, h in self._init():
                try:
                    nv = self._nvml
                    util = nv.nvmlDeviceGetUtilizationRates(h)
                    mem = nv.nvmlDeviceGetMemoryInfo(h)
                    procs: dict[int, int] = {}
                    for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                        used = p.usedGpuMemory  # None when the driver does not tell (no permission, MIG)
                        procs[int(p.pid)] = int(used) if isinstance(used, int) and used >= 0 else 0
                    out.append(GpuSample(index, float(util.gpu), int(mem.used), int(mem.total), procs))
                except Exception as e:
                    log.debug("GPU %d not sampled (%s)", index, e, extra={"gpu_index": index})
            return out

    def _shutdown(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                log.debug("nvmlShutdown failed", exc_info=True)
            self._nvml = None

    def close(self) -> None:
        with self._lock:
            self._shutdown()
            self._handles = None
