"""When a warm worker runs another batch, and when it is replaced: two pure decisions of the node manager.

A worker process runs batch after batch on its slot (``workers``): the trainer's module imported once,
the next batch's spec handed over a pipe, the model kept in memory for a batch that continues where
the last one ended. Isolation stays, decided here from what the node manager knows of the worker
(``WorkerView``, plain data):

* ``retire_after_batch``: after a batch that finished, is the worker kept? Not when reuse is off, when
  the batch left processes running (they would outlive it, holding its pipes and memory), or when its
  memory grew by more than the policy's bound since its first batch (a leak: tensors a trainer keeps
  in a global, a cache that never empties). A batch that failed or was preempted ends its worker
  (the worker exits by itself: a preemption frees the slot and the GPU's memory that way).
* ``retire_before_batch``: is the waiting worker fit for the batch at hand? Not when it has exited,
  or when it imported another trainer or another code version of it (``FixedPart.code_version``: a
  module imported once would run the old code).

Each returns the reason to replace the worker (logged) or None to keep it.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024
DEFAULT_MAX_RSS_GROWTH_BYTES = 1024 * MIB


@dataclass(frozen=True)
class TrainerKey:
    """Which code a worker runs: the trainer's entry point and its code version."""

    entry_point: str
    code_version: str


@dataclass(frozen=True)
class ReusePolicy:
    """``reuse``: keep workers between batches at all; ``max_rss_growth_bytes``: the memory a worker may
    grow by after its first batch before it is replaced (0: no bound)."""

    reuse: bool = True
    max_rss_growth_bytes: int = DEFAULT_MAX_RSS_GROWTH_BYTES


@dataclass(frozen=True)
class WorkerView:
    """What the node manager knows of one worker process."""

    trainer: TrainerKey | None = None  # what it imported (ahead, or for a batch); None: nothing yet
    batches: int = 0  # batches it ran to their end
    rss_bytes: int = 0  # its resident memory after its last batch
    first_rss_bytes: int = 0  # ... after its first batch
    children: int = 0  # processes its last batch left running
    exited: bool = False


def retire_after_batch(worker: WorkerView, policy: ReusePolicy) -> str | None:
    """Why a worker whose batch just finished is not kept for the next one, or None to keep it."""
    if not policy.reuse:
        return "workers are not reused (STAGETREE_NM_WORKER_REUSE=false)"
    if worker.children:
        return f"its batch left {worker.children} process(es) running"
    grown = worker.rss_bytes - worker.first_rss_bytes
    if policy.max_rss_growth_bytes > 0 and grown > policy.max_rss_growth_bytes:
        return (
            f"its memory grew by {grown // MIB} MiB since its first batch (bound: "
            f"{policy.max_rss_growth_bytes // MIB} MiB, STAGETREE_NM_WORKER_MAX_RSS_GROWTH_MB)"
        )
    return None


def retire_before_batch(worker: WorkerView, needs: TrainerKey) -> str | None:
    """Why a waiting worker may not run a batch of trainer ``needs``, or None when it may."""
    if worker.exited:
        return "it exited"
    have = worker.trainer
    if have is None:
        return None
    if have.entry_point != needs.entry_point:
        return f"it imported trainer {have.entry_point!r}, the batch runs {needs.entry_point!r}"
    if have.code_version != needs.code_version:
        return f"it imported code version {have.code_version!r} of the trainer, the batch runs {needs.code_version!r}"
    return None
