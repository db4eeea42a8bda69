"""Tuner-like request streams for ``core.simulator``: every config at once (``GridDriver``) and ASHA
(``ASHADriver``), over the synthetic learning curves of ``core.simulator.synthetic_curve``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stagetree.core.config import Config
from stagetree.core.simulator import Ask, Curve


class GridDriver:
    """Every config to ``max_step`` at once (optionally with intermediate evaluations)."""

    def __init__(self, configs: Sequence[Config], max_step: int, evals: Sequence[int] = ()) -> None:
        self.configs = list(configs)
        self.max_step = max_step
        self.evals = sorted(set(evals) | {max_step})

    def start(self) -> list[Ask]:
        return [Ask((i, s), c, s) for i, c in enumerate(self.configs) for s in self.evals]

    def on_result(self, tag: Any, step: int, metrics: dict[str, float]) -> list[Ask]:
        return []


class ASHADriver:
    """Asynchronous successive halving (Li et al., MLSys 2020, Algorithm 2) over a config list.

    Keeps ``concurrency`` jobs outstanding; each free job goes to the highest rung with a promotable
    config (top 1/eta of its rung, not yet promoted), else a new config enters rung 0.
    """

    def __init__(
        self,
        configs: Sequence[Config],
        min_step: int,
        eta: int,
        max_step: int,
        concurrency: int,
        curve: Curve,
    ) -> None:
        self.configs = list(configs)
        self.eta = eta
        self.curve = curve
        self.rungs: list[int] = []
        r = min_step
        while r <= max_step:
            self.rungs.append(r)
            r *= eta
        self.results: list[dict[int, float]] = [{} for _ in self.rungs]
        self.promoted: list[set[int]] = [set() for _ in self.rungs]
        self.next_config = 0
        self.concurrency = concurrency

    def _job(self) -> Ask | None:
        for k in range(len(self.rungs) - 2, -1, -1):
            done = self.results[k]
            top = sorted(done, key=lambda i: (done[i], i))[: len(done) // self.eta]
            for i in top:
                if i not in self.promoted[k]:
                    self.promoted[k].add(i)
                    return Ask((i, k + 1), self.configs[i], self.rungs[k + 1])
        if self.next_config < len(self.configs):
            i = self.next_config
            self.next_config += 1
            return Ask((i, 0), self.configs[i], self.rungs[0])
        return None

    def _fill(self, n: int) -> list[Ask]:
        out = []
        for _ in range(n):
            job = self._job()
            if job is None:
                break
            out.append(job)
        return out

    def start(self) -> list[Ask]:
        return self._fill(self.concurrency)

    def on_result(self, tag: Any, step: int, metrics: dict[str, float]) -> list[Ask]:
        i, k = tag
        self.results[k][i] = metrics["loss"]
        return self._fill(1)
