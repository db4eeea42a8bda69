"""The lives of requests, batches and batch attempts: their states, and how an attempt's end decides them.

A request waits (``NOT_SCHED``), is carried by a running batch (``SCHED``) and ends ``DONE`` (its
metrics exist), ``CANCELLED`` or ``FAILED``. A batch runs as a sequence of attempts; the batch's state
is its current attempt's. When an attempt ends, :func:`end_attempt` decides, from plain data, what
becomes of the batch and of every request it still carries::

    report (AttemptEnd) ──▶ end_attempt(batch head, carried requests, retry policy) ──▶ AttemptDecision
                                                                                         (batch state,
                                                                                          failed, requeued,
                                                                                          counted, error)

Every write path (a node manager's gRPC report, the aggregator's bus ingest, a lost node manager, an
abort) calls it and persists the decision through one adapter (``master.store.ledger``), so a rule of
a batch's life changes here and only here. State names are spelled only in this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

MAX_ERROR_CHARS = 4000  # the tail of an error kept with a request (a traceback's end says the most)


class RequestState(StrEnum):
    NOT_SCHED = "NOT_SCHED"  # waiting for a scheduling round
    SCHED = "SCHED"  # carried by a running batch
    DONE = "DONE"  # its metrics exist
    CANCELLED = "CANCELLED"  # by its study, or by a policy (the reason is kept as its error)
    FAILED = "FAILED"  # its work failed more times than the retry policy allows

    def is_finished(self) -> bool:
        """It has its answer: nothing will change it again."""
        return self in _FINISHED_REQUESTS

    def is_live(self) -> bool:
        """It still wants its metrics (waiting or carried)."""
        return not self.is_finished()


_FINISHED_REQUESTS = frozenset({RequestState.DONE, RequestState.CANCELLED, RequestState.FAILED})
LIVE_REQUEST_STATES: tuple[RequestState, ...] = (RequestState.NOT_SCHED, RequestState.SCHED)
FINISHED_REQUEST_STATES: tuple[RequestState, ...] = tuple(s for s in RequestState if s.is_finished())


class BatchState(StrEnum):
    """The state of a batch attempt; a batch's state is its current attempt's."""

    RUNNING = "RUNNING"
    DONE = "DONE"  # ran to its end
    FAILED = "FAILED"  # the worker failed (the trainer raised, the process died)
    # it ran out of memory: a failure like FAILED, kept apart so that the cost estimator, reading the
    # ledger, gives the plan's next batch twice the slots (TreeML §5.2)
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    PREEMPTED = "PREEMPTED"  # yielded at the master's request and saved where it stopped
    LOST = "LOST"  # its node manager was lost, or came back without it
    ABORTED = "ABORTED"  # no live request needed it any more

    def is_finished(self) -> bool:
        return self is not BatchState.RUNNING


AttemptState = BatchState


class Outcome(StrEnum):
    """How an attempt ended, as its reporter or the master saw it."""

    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"  # the worker failed for a reason a retry may cure (it was killed, a disk filled up)
    USER_ERROR = "USER_ERROR"  # the trainer's own code raised: a retry would raise again
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    PREEMPTED = "PREEMPTED"
    LOST = "LOST"
    ABORTED = "ABORTED"
    # the node manager's host cannot run the batch's trainer (its module, or one it imports, is not
    # installed there): another node manager may, so the work goes back to the queue uncounted and the
    # plan's next batches avoid that node manager (``AttemptDecision.exclude_host``)
    HOST_PROBLEM = "HOST_PROBLEM"

    def counts_as_failure(self) -> bool:
        """An end that counts against the retry budget of the requests the attempt carried."""
        return self in (Outcome.FAILED, Outcome.USER_ERROR, Outcome.OUT_OF_MEMORY)

    def batch_state(self) -> BatchState:
        return _BATCH_STATE_OF[self]

    @classmethod
    def of_report(
        cls,
        ok: bool,
        *,
        preempted: bool = False,
        oom: bool = False,
        user_error: bool = False,
        host_problem: bool = False,
    ) -> Outcome:
        """The outcome a node manager's report flags say (``ok`` wins; a preemption is no failure; out of
        memory is retried with more GPUs even when user code hit it; a host that cannot import the trainer
        hands the work to another)."""
        if ok:
            return cls.SUCCEEDED
        if preempted:
            return cls.PREEMPTED
        if oom:
            return cls.OUT_OF_MEMORY
        if host_problem:
            return cls.HOST_PROBLEM
        return cls.USER_ERROR if user_error else cls.FAILED


_BATCH_STATE_OF = {
    Outcome.SUCCEEDED: BatchState.DONE,
    Outcome.FAILED: BatchState.FAILED,
    Outcome.USER_ERROR: BatchState.FAILED,
    Outcome.OUT_OF_MEMORY: BatchState.OUT_OF_MEMORY,
    Outcome.PREEMPTED: BatchState.PREEMPTED,
    Outcome.LOST: BatchState.LOST,
    Outcome.ABORTED: BatchState.ABORTED,
    Outcome.HOST_PROBLEM: BatchState.FAILED,
}


class NodeManagerState(StrEnum):
    ALIVE = "ALIVE"  # registered and heartbeating
    LOST = "LOST"  # its heartbeat lapsed: its running batches were requeued
    LEFT = "LEFT"  # it stopped gracefully: no work is sent to it until it registers again


class AssignmentKind(StrEnum):
    """What a node manager is told to do on its assignment stream."""

    RUN = "RUN"
    ABORT = "ABORT"
    PREEMPT = "PREEMPT"
    DELETE_CHECKPOINTS = "DELETE_CHECKPOINTS"


@dataclass(frozen=True)
class Assignment:
    """One message of a node manager's assignment stream: RUN a batch attempt, or a control action on
    one (ABORT, PREEMPT) or on checkpoints (DELETE_CHECKPOINTS); the master sends it, the node manager
    acts on it."""

    batch_id: int
    attempt: int
    kind: AssignmentKind = AssignmentKind.RUN
    spec_json: str = ""  # RUN: the core BatchSpec's JSON
    checkpoint_uris: tuple[str, ...] = ()  # DELETE_CHECKPOINTS
    slot_id: str = ""  # RUN: the slot the master placed the batch on


@dataclass(frozen=True)
class RetryPolicy:
    """``max_failures``: failed attempts a request's work may have before the request fails. An error
    of the user's code fails its requests at once, unless their study asked to retry those too
    (``CarriedRequest.retry_user_errors``)."""

    max_failures: int = 3

    def __post_init__(self) -> None:
        if self.max_failures < 1:
            raise ValueError(f"max_failures must be at least 1, got {self.max_failures}")


@dataclass(frozen=True)
class AttemptEnd:
    """One attempt of one batch ended with ``outcome`` (``error``: what the worker said, for failures)."""

    batch_id: int
    attempt: int
    outcome: Outcome
    error: str = ""


@dataclass(frozen=True)
class MetricPoint:
    """Metrics a batch attempt produced at a point (a canonical one once the master has placed it)."""

    node: int
    step: int
    values: Mapping[str, float]


@dataclass(frozen=True)
class CheckpointPoint:
    """A checkpoint a batch attempt saved at a point: where it is and how large."""

    node: int
    step: int
    uri: str
    bytes: int
    kind: str = "central"
    ranks: int = 1  # how many ranks' training wrote it (a batch on several slots saves once, on rank 0)


@dataclass(frozen=True)
class RankChange:
    """A batch attempt on ``to_ranks`` ranks resumed from a checkpoint (``uri``, at a point) written by
    ``from_ranks`` ranks: the trainer said it may (``rescalable``), and from that point on the plan's
    path is not the bit-exact run of one number of ranks. The worker reports it once its restore
    succeeded; the ledger keeps it as the plan's *path change*."""

    node: int
    step: int
    uri: str
    from_ranks: int
    to_ranks: int


@dataclass(frozen=True)
class AttemptTiming:
    """Where a batch attempt's worker spent its time, as the worker measured it: it was handed the batch at
    ``given_at`` (epoch seconds, its host's clock: its process start, or the spec's arrival for a worker
    started ahead), then ``startup_s`` before it could train (process start, imports, the trainer's init),
    ``checkpoint_s`` of checkpoint I/O that held training up (the restore, saves it waited for) and
    ``train_s`` training (steps and evaluations; none of the former)."""

    given_at: float
    startup_s: float
    checkpoint_s: float
    train_s: float


@dataclass(frozen=True)
class BatchHead:
    """What the ledger holds of a batch when an end arrives: its current attempt and that attempt's state."""

    attempt: int
    state: BatchState


@dataclass(frozen=True)
class CarriedRequest:
    """A request the batch still carries (SCHED on it), with its failed attempts so far, and whether its
    study retries errors of the user's code."""

    id: int
    failures: int = 0
    retry_user_errors: bool = False


@dataclass(frozen=True)
class AttemptDecision:
    """What an attempt's end changes. ``stale``: the report is for an attempt that is not the running one
    (lost, aborted or already reported) and changes nothing. Otherwise the batch (and its attempt) take
    ``batch_state``; ``counted`` requests get one more failure and ``error``; of the carried requests,
    ``failed`` become FAILED and ``requeued`` go back to NOT_SCHED. ``exclude_host``: the attempt's node
    manager cannot run the batch's plan (``error`` says why): the plan's next batches go elsewhere, and
    its requests fail with that reason once no node manager is left that can run it."""

    batch_id: int
    attempt: int
    stale: bool
    batch_state: BatchState | None = None
    failed: tuple[int, ...] = ()
    requeued: tuple[int, ...] = ()
    counted: tuple[int, ...] = ()
    error: str = ""
    exclude_host: bool = False


def failure_text(outcome: Outcome, error: str) -> str:
    """The error a failed attempt leaves on its requests: the worker's words, prefixed so an
    out-of-memory failure reads as one. A long one keeps its first line (what was raised) and its tail
    (where: a traceback's end says the most)."""
    error = error.replace("\x00", "")
    if outcome is Outcome.OUT_OF_MEMORY:
        error = f"out of memory: {error}" if error else "out of memory"
    elif not error:
        error = "the batch failed"
    if len(error) <= MAX_ERROR_CHARS:
        return error
    head = error.split("\n", 1)[0][:500]
    return f"{head}\n...\n{error[-(MAX_ERROR_CHARS - len(head) - 5) :]}"


def end_attempt(
    head: BatchHead | None, end: AttemptEnd, carried: Sequence[CarriedRequest], policy: RetryPolicy
) -> AttemptDecision:
    """Decide what ``end`` does to its batch (``head``; None when the batch does not exist) and to the
    requests it carries. Pure: the caller persists the decision."""
    if head is None or head.state is not BatchState.RUNNING or head.attempt != end.attempt:
        return AttemptDecision(end.batch_id, end.attempt, stale=True)
    if not end.outcome.counts_as_failure():
        host = end.outcome is Outcome.HOST_PROBLEM
        return AttemptDecision(
            end.batch_id,
            end.attempt,
            stale=False,
            batch_state=end.outcome.batch_state(),
            requeued=tuple(r.id for r in carried),
            error=failure_text(end.outcome, end.error) if host else "",
            exclude_host=host,
        )
    final = end.outcome is Outcome.USER_ERROR
    failed = tuple(
        r.id for r in carried if r.failures + 1 >= policy.max_failures or (final and not r.retry_user_errors)
    )
    gone = set(failed)
    return AttemptDecision(
        end.batch_id,
        end.attempt,
        stale=False,
        batch_state=end.outcome.batch_state(),
        failed=failed,
        requeued=tuple(r.id for r in carried if r.id not in gone),
        counted=tuple(r.id for r in carried),
        error=failure_text(end.outcome, end.error),
    )


def after(head: BatchHead | None, decision: AttemptDecision) -> BatchHead | None:
    """The batch's head once ``decision`` is applied (for a second end of the same batch in one group)."""
    if decision.stale or head is None or decision.batch_state is None:
        return head
    return BatchHead(head.attempt, decision.batch_state)
