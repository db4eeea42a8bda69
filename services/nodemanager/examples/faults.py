"""``FaultyDigits``: the digits trainer with injectable faults, for drills of the failure paths.

Fixed values (besides the digits ones): ``fault`` names what happens when ``train()`` is called at
step ``fault_step``; ``sleep_s`` slows every step down without changing what it computes (to give a
signal time to arrive); ``fault_once`` (a file path) makes the fault happen only while that file does
not exist (it is created just before the fault), so a retried batch succeeds. ``FaultyDigits`` also takes
``fault_lr_above``: only a trial whose learning rate at ``fault_step`` is above it faults (one corner of
a sweep crashes, the rest trains on).

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class Injected:
    """What a trainer's fixed values ask it to do wrong: ``fault`` (a name in ``FAULTS``) at step
    ``fault_step`` on rank ``fault_rank`` (-1: every rank), only the first time when ``fault_once`` names a
    marker file, and ``sleep_s`` seconds of sleep in every step."""

    fault: Callable[[], None] | None
    step: int
    sleep_s: float
    once: Path | None

    @classmethod
    def of(cls, fixed: Mapping[str, Any], rank: int = 0) -> Injected:
        name = str(fixed.get("fault", ""))
        if name and name not in FAULTS:
            raise InvalidArgument(f"unknown fault {name!r}; known: {sorted(FAULTS)}")
        on = int(fixed.get("fault_rank", -1))
        once = str(fixed.get("fault_once", ""))
        return cls(
            FAULTS.get(name) if on < 0 or on == rank else None,
            int(fixed.get("fault_step", 0)),
            float(fixed.get("sleep_s", 0.0)),
            Path(once) if once else None,
        )

    def at(self, step: int, armed: bool = True) -> None:
        """Call at the start of each step (``armed``: whether the fault may happen at all)."""
        if armed and self.fault is not None and step == self.step:
            if self.once is None:
                self.fault()
            elif not self.once.exists():
                self.once.touch()
                self.fault()
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)


class FaultyDigits(DigitsMLP):
    def init(self) -> None:
        self._injected = Injected.of(self.fixed)
        self._lr_above = float(self.fixed.get("fault_lr_above", float("-inf")))
        super().init()

    def train(self) -> StepMetrics | None:
        self._injected.at(self.step, armed=float(self.optimizer.param_groups[0]["lr"]) > self._lr_above)
        return super().train()


class FaultyTorchDigits(DigitsTorch):
    def init(self) -> None:
        self._injected = Injected.of(self.fixed, self.rank)
        self._noise = bool(self.fixed.get("rank_noise", False))
        super().init()

    def train(self) -> dict[str, torch.Tensor]:
        self._injected.at(self.step)
        if self._noise:
            torch.rand(self.rank + 1)
        return super().train()
