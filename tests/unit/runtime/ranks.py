"""Run one batch spec as ``n`` real rank processes of ``runtime.worker`` (one torch thread each, gloo on
the CPU), handing each its place the way the node manager does (``spec.extra["rank"]``), and read
what they wrote. Used by the runtime's multi-rank tests and ``tests.bench.multigpu``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagetree.core.batch import BatchSpec
from stagetree.nodemanager.runtime.events import decode_event
from stagetree.nodemanager.runtime.ranks import LOOPBACK, RANK_KEY, RankInfo, free_port

WORKER = "stagetree.nodemanager.runtime.worker"


@dataclass
class RanksRun:
    """What the ranks of one run wrote: rank 0's events, every rank's events and exit status."""

    events: list[tuple[str, dict[str, Any]]]  # rank 0's
    rank_events: list[list[tuple[str, dict[str, Any]]]]
    codes: list[int]
    wall_s: float  # from the first process started to the last one gone
    logs: list[Path]
    progress_times: list[tuple[float, dict[str, Any]]]  # rank 0's progress events with their time stamps

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [p for k, p in self.events if k == kind]

    def metrics_at(self, step: int) -> dict[str, float]:
        found = [p["metrics"] for p in self.of("metrics") if p["step"] == step]
        assert found, f"no metrics at step {step}: {[k for k, _ in self.events]}; {self.log_tails()}"
        return dict(found[0])

    def checkpoint_at(self, step: int) -> dict[str, Any]:
        found = [p for p in self.of("checkpoint_saved") if p["step"] == step]
        assert found, f"no checkpoint at step {step}: {self.of('checkpoint_saved')}; {self.log_tails()}"
        return found[0]

    def log_tails(self) -> str:
        return "\n".join(f"rank {r}: {p.read_text()[-1500:]}" for r, p in enumerate(self.logs) if p.exists())


def _event(line: bytes) -> tuple[str, dict[str, Any]]:
    kind, _ts, payload = decode_event(line)
    return kind, payload


def rank_spec(spec: BatchSpec, rank: int, n: int, port: int) -> BatchSpec:
    """``spec`` as rank ``rank`` of ``n`` gets it (unchanged on one rank)."""
    if n == 1:
        return dataclasses.replace(spec, slots=1)
    info = RankInfo(rank, n, rank, LOOPBACK, port)
    return dataclasses.replace(spec, slots=n, extra={**spec.extra, RANK_KEY: info.to_json()})


def start_ranks(spec: BatchSpec, n: int, checkpoint_root: Path, work: Path) -> list[subprocess.Popen[bytes]]:
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STAGETREE_WORKER_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs = []
    for r in range(n):
        path = work / f"spec-b{spec.batch_id}a{spec.attempt}-r{r}.json"
        path.write_text(json.dumps(rank_spec(spec, r, n, port).to_json()))
        cmd = [sys.executable, "-m", WORKER, "--spec", str(path), "--checkpoint-root", str(checkpoint_root)]
        with open(work / f"log-b{spec.batch_id}a{spec.attempt}-r{r}.txt", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [*cmd, "--threads", "1"], stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True
                )
            )
    return procs


def run_ranks(spec: BatchSpec, n: int, checkpoint_root: Path, work: Path, timeout_s: float = 180) -> RanksRun:
    """Run ``spec`` on ``n`` ranks to its end; every process is gone when this returns."""
    t0 = time.perf_counter()
    procs = start_ranks(spec, n, checkpoint_root, work)
    outs: list[bytes] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout_s)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.perf_counter() - t0
    rank_events = [[_event(line) for line in out.splitlines() if line.strip()] for out in outs]
    logs = [work / f"log-b{spec.batch_id}a{spec.attempt}-r{r}.txt" for r in range(n)]
    progress = []
    for line in outs[0].splitlines() if outs else ():
        if line.strip():
            kind, ts, payload = decode_event(line)
            if kind == "progress":
                progress.append((ts, payload))
    return RanksRun(rank_events[0], rank_events, [int(p.returncode) for p in procs], wall, logs, progress)
