"""``FaultyDigits``: the digits trainer with injectable faults, for drills of the failure paths.

Fixed values (besides the digits ones): ``fault`` names what happens when ``train()`` is called at
step ``fault_step``; ``sleep_s`` slows every step down without changing what it computes (to give a
signal time to arrive); ``fault_once`` (a file path) makes the fault happen only while that file does
not exist (it is created just before the fault), so a retried batch succeeds.

``FaultyTorchDigits`` is the same with ``DigitsTorch`` (a ``TorchTrainer``: data parallel on a batch of
several slots); ``fault_rank`` (default: every rank) makes only that rank fault. It also takes
``rank_noise``: rank ``r`` draws ``r + 1`` extra random numbers before each step, so the ranks' random
streams (dropout masks) differ, as they do when ranks sample differently (an exact resume needs every
rank's stream). Faults:

=================  =====================================================================
``raise``          ``ValueError`` from user code
``cuda_oom``       ``torch.cuda.OutOfMemoryError`` (what a CUDA allocation failure raises)
``runtime_oom``    ``RuntimeError("... out of memory ...")`` (older torch, CPU allocators)
``memory_error``   ``MemoryError``
``exit``           ``os._exit(17)``: the process dies with no chance to report anything
``say_and_exit``   a line on stderr, then ``exit`` (the line must reach the failure's report)
=================  =====================================================================
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from stagetree.core.errors import InvalidArgument
from stagetree.nodemanager.examples.digits import DigitsMLP
from stagetree.nodemanager.examples.torch_digits import DigitsTorch
from stagetree.nodemanager.runtime.trainer import StepMetrics

ENTRY_POINT = "stagetree.nodemanager.examples.faults:FaultyDigits"
TORCH_ENTRY_POINT = "stagetree.nodemanager.examples.faults:FaultyTorchDigits"
EXIT_CODE = 17


def _raise_value_error() -> None:
    raise ValueError("injected fault in user code")


def _raise_cuda_oom() -> None:
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def _raise_runtime_oom() -> None:
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: out of memory (injected)")


def _raise_memory_error() -> None:
    raise MemoryError("injected")


def _exit() -> None:
    os._exit(EXIT_CODE)


def _say_and_exit() -> None:
    sys.stderr.write("dying on purpose (fault say_and_exit)\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


FAULTS: dict[str, Callable[[], None]] = {
    "raise": _raise_value_error,
    "cuda_oom": _raise_cuda_oom,
    "runtime_oom": _raise_runtime_oom,
    "memory_error": _raise_memory_error,
    "exit": _exit,
    "say_and_exit": _say_and_exit,
}


class FaultyDigits(DigitsMLP):
    def init(self) -> None:
        name = str(self.fixed.get("fault", ""))
        if name and name not in FAULTS:
            raise InvalidArgument(f"unknown fault {name!r}; known: {sorted(FAULTS)}")
        self._fault = FAULTS.get(name)
        self._fault_step = int(self.fixed.get("fault_step", 0))
        self._sleep_s = float(self.fixed.get("sleep_s", 0.0))
        once = str(self.fixed.get("fault_once", ""))
        self._once = Path(once) if once else None
        super().init()

    def train(self) -> StepMetrics | None:
        if self._fault is not None and self.step == self._fault_step:
            if self._once is None:
                self._fault()
            elif not self._once.exists():
                self._once.touch()
                self._fault()
        if self._sleep_s > 0:
            time.sleep(self._sleep_s)
        return super().train()


class FaultyTorchDigits(DigitsTorch):
    def init(self) -> None:
        name = str(self.fixed.get("fault", ""))
        if name and name not in FAULTS:
            raise InvalidArgument(f"unknown fault {name!r}; known: {sorted(FAULTS)}")
        rank = int(self.fixed.get("fault_rank", -1))
        self._fault = FAULTS.get(name) if rank < 0 or rank == self.rank else None
        self._fault_step = int(self.fixed.get("fault_step", 0))
        self._sleep_s = float(self.fixed.get("sleep_s", 0.0))
        self._noise = bool(self.fixed.get("rank_noise", False))
        once = str(self.fixed.get("fault_once", ""))
        self._once = Path(once) if once else None
        super().init()

    def train(self) -> dict[str, float]:
        if self._fault is not None and self.step == self._fault_step:
            if self._once is None:
                self._fault()
            elif not self._once.exists():
                self._once.touch()
                self._fault()
        if self._sleep_s > 0:
            time.sleep(self._sleep_s)
        if self._noise:
            torch.rand(self.rank + 1)
        return super().train()
