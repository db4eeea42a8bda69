"""SQLAlchemy 2 models of the master's database: the search plans and everything hung on them.

Owns the table layout only; the queries live in the store's role modules and the schema history in ``migrations/``
(a test checks that the migrations produce exactly these models). The same models serve Postgres
(cluster mode) and SQLite (embedded mode), so only portable types are used.

Uniqueness is what makes concurrent masters safe: a node is unique per
(plan, parent-or-0, start, digest of the config's segments at the branch step), a request per
(study, client request id), a batch attempt per (batch, attempt).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy import false as sa_false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Explicit constraint names so that Alembic migrations are stable across dialects.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments INTEGER PRIMARY KEY; Postgres wants BIGINT for large tables.
Id = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Study(Base):
    __tablename__ = "studies"
    __table_args__ = (UniqueConstraint("owner", "name"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(String(256))
    fixed_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    # retry its requests' work when the user's code raised (off: such a failure is final at once)
    retry_user_errors: Mapped[bool] = mapped_column(Boolean, default=False, server_default=sa_false())
    # how its learning curves are sampled (NULL: the master's defaults)
    curve_every_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    curve_max_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)


class Plan(Base):
    __tablename__ = "plans"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(32), unique=True)  # FixedPart.key(scope)
    fixed_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    # whose studies share it: "owner:<name>" or "team:<name>" ("" for plans of before 0006: unscoped)
    scope: Mapped[str] = mapped_column(String(160), default="", server_default="")


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (UniqueConstraint("plan_id", "parent_key", "start", "branch_digest"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    plan_id: Mapped[int] = mapped_column(ForeignKey("plans.id"), index=True)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id"), nullable=True)
    parent_key: Mapped[int] = mapped_column(BigInteger)  # parent id, or 0 for a root (NULLs are never equal)
    start: Mapped[int] = mapped_column(Integer)
    branch_digest: Mapped[str] = mapped_column(String(32))
    config_json: Mapped[str] = mapped_column(Text)


class Batch(Base):
    __tablename__ = "batches"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    plan_id: Mapped[int] = mapped_column(ForeignKey("plans.id"), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)  # RUNNING, DONE, FAILED, LOST, ABORTED
    attempt: Mapped[int] = mapped_column(Integer)
    spec_json: Mapped[str] = mapped_column(Text)
    node_manager_id: Mapped[str | None] = mapped_column(String(128), nullable=True)  # its slots' (``BatchSlot``)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class BatchSlot(Base):
    """The slots a batch holds on its node manager, one row per data-parallel rank (rank 0 first)."""

    __tablename__ = "batch_slots"

    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    slot_id: Mapped[str] = mapped_column(String(128))


class BatchAttempt(Base):
    __tablename__ = "batch_attempts"
    # what a node manager's stream has still to send: its few unsent attempts, not its whole history
    # (every assignment stream's look scanned every attempt the node manager ever ran)
    __table_args__ = (
        Index(
            "ix_batch_attempts_unsent",
            "node_manager_id",
            postgresql_where=text("sent_at IS NULL"),
            sqlite_where=text("sent_at IS NULL"),
        ),
        # the attempts that ran out of memory, which every round looks for: a handful among all attempts
        Index(
            "ix_batch_attempts_oom",
            "finished_at",
            postgresql_where=text("state = 'OUT_OF_MEMORY'"),
            sqlite_where=text("state = 'OUT_OF_MEMORY'"),
        ),
        # the running attempts of a node manager, which its every heartbeat checks (requeue_unknown)
        Index(
            "ix_batch_attempts_running",
            "node_manager_id",
            postgresql_where=text("state = 'RUNNING'"),
            sqlite_where=text("state = 'RUNNING'"),
        ),
    )

    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_manager_id: Mapped[str] = mapped_column(String(128), index=True)
    slot_id: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16))
    dispatched_at: Mapped[float] = mapped_column(Float)
    sent_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # set once: never sent twice
    # when its worker started: the node manager's time in batch_started (else when the aggregator heard it,
    # never later); NULL: not heard, see migration 0013
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    # the furthest step its worker said it trained to (progress, metrics, checkpoints): what an attempt that
    # did not run to its end trained; NULL: nothing heard (see migration 0014)
    reached_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # where its worker's time went, as the worker measured it (its batch_timing event; NULL: not reported):
    # handed the batch at (the node manager's host clock), then start-up (process, imports, trainer init),
    # checkpoint I/O that held training up (restore, saves waited for) and training (steps, evaluations)
    given_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    startup_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    checkpoint_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    train_s: Mapped[float | None] = mapped_column(Float, nullable=True)


class Request(Base):
    __tablename__ = "requests"
    __table_args__ = (
        UniqueConstraint("study_id", "client_request_id"),
        Index("ix_requests_plan_id_state", "plan_id", "state"),
        Index("ix_requests_node_id_step", "node_id", "step"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    study_id: Mapped[str] = mapped_column(ForeignKey("studies.id"))
    plan_id: Mapped[int] = mapped_column(ForeignKey("plans.id"))
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"))
    step: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), index=True)  # each round reads the NOT_SCHED ones
    batch_id: Mapped[int | None] = mapped_column(ForeignKey("batches.id"), nullable=True, index=True)
    client_request_id: Mapped[str] = mapped_column(String(128))
    label: Mapped[str] = mapped_column(String(128), default="", server_default="")  # the tuner's trial
    created_at: Mapped[float] = mapped_column(Float)
    done_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # failed batch attempts that carried it
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    error: Mapped[str | None] = mapped_column(Text, nullable=True)  # the last failure, shown when FAILED


class RequeuedRequest(Base):
    """A batch that carried a request which went back to the queue when the batch's attempt ended without
    running to its end (lost, preempted, failed and retried): the request's ``batch_id`` moves on to the
    next batch, and this row keeps what the earlier one trained counted in the study's stats."""

    __tablename__ = "requeued_requests"

    request_id: Mapped[int] = mapped_column(ForeignKey("requests.id"), primary_key=True)
    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id"), primary_key=True)


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    uri: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(16))
    refcount: Mapped[int] = mapped_column(Integer, default=0)
    last_used: Mapped[float] = mapped_column(Float)
    # how many ranks' training wrote it (a batch on n slots saves once, on rank 0; 1 for rows of before 0010)
    ranks: Mapped[int] = mapped_column(Integer, default=1, server_default="1")


class PathChange(Base):
    """A batch attempt on ``to_ranks`` ranks resumed the checkpoint at (node, step) that ``from_ranks``
    ranks wrote (its trainer is ``rescalable``): what the plan computed from that point on is a valid run
    but not the bit-exact one of a single number of ranks. One row per attempt (a redelivered report
    records nothing more)."""

    __tablename__ = "path_changes"

    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"), index=True)  # the canonical resume point
    step: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    from_ranks: Mapped[int] = mapped_column(Integer)
    to_ranks: Mapped[int] = mapped_column(Integer)
    node_manager_id: Mapped[str] = mapped_column(String(128))
    recorded_at: Mapped[float] = mapped_column(Float)


class LogLineRow(Base):
    """A line of text a batch attempt's trainer logged (the bus message ``LogLine``): the attempt's
    ``seq``-th, at (node, step) as its worker said (not checked against the plan: a line is the
    attempt's, not a point's). At most ``core.loglines.MAX_LINES`` per attempt (``seq`` is below it),
    each at most ``MAX_LINE_CHARS`` characters; a redelivered line is the same row."""

    __tablename__ = "log_lines"

    batch_id: Mapped[int] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Float)  # when the trainer logged it (epoch seconds, the worker's clock)
    line: Mapped[str] = mapped_column(Text)


class Metric(Base):
    __tablename__ = "metrics"

    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
    recorded_at: Mapped[float] = mapped_column(Float)


class CurvePointRow(Base):
    """A learning-curve point: the step metrics a trainer reported after ``step`` steps, stored once at
    its canonical node (a trial's curve is its path's points: shared prefixes are never copied)."""

    __tablename__ = "curve_points"

    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
    recorded_at: Mapped[float] = mapped_column(Float, index=True)


class GpuSample(Base):
    """The latest telemetry sample of one GPU of one node manager (utilization, memory, processes), as
    an aggregator last saw it on the telemetry topic: what the dashboard's cluster page shows."""

    __tablename__ = "gpu_telemetry"

    node_manager: Mapped[str] = mapped_column(String(128), primary_key=True)
    gpu_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    sample: Mapped[dict[str, Any]] = mapped_column(JSON)
    ts: Mapped[float] = mapped_column(Float, index=True)


class NodeManager(Base):
    __tablename__ = "node_managers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    address: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16))  # ALIVE, LOST
    registered_at: Mapped[float] = mapped_column(Float)
    last_heartbeat: Mapped[float] = mapped_column(Float)


class HostProblem(Base):
    """A node manager that cannot run a plan's trainer (its module, or one the module imports, is not
    installed on that host), with its worker's words. The plan's batches avoid it until it registers
    again (a restart may bring the module); with every live node manager here, the plan's requests fail."""

    __tablename__ = "host_problems"

    plan_id: Mapped[int] = mapped_column(ForeignKey("plans.id"), primary_key=True)
    node_manager_id: Mapped[str] = mapped_column(String(128), primary_key=True, index=True)
    error: Mapped[str] = mapped_column(Text)
    at: Mapped[float] = mapped_column(Float)


class SlotRow(Base):
    __tablename__ = "slots"

    node_manager_id: Mapped[str] = mapped_column(ForeignKey("node_managers.id"), primary_key=True)
    slot_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    gpu_type: Mapped[str] = mapped_column(String(64))
    # server defaults (here and on requests.failures) as the migration that added the columns set them:
    # an empty database's tables come from these models (store.schema)
    memory_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    compute_capability: Mapped[str] = mapped_column(String(16), default="", server_default="")
    share: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    cpu_cores: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    gpu_index: Mapped[int] = mapped_column(Integer, default=-1, server_default="-1")


class NodeManagerAction(Base):
    """The outbox of control actions for a node manager (abort, preempt, delete checkpoints), sent once
    on its assignment stream in id order."""

    __tablename__ = "node_manager_actions"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    node_manager_id: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[str] = mapped_column(String(32))  # ABORT, PREEMPT, DELETE_CHECKPOINTS
    batch_id: Mapped[int] = mapped_column(BigInteger, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)
    sent_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class AppliedMessage(Base):
    """Bus message ids an aggregator has applied, written in the same transaction as their effects, so
    a redelivered message changes nothing."""

    __tablename__ = "applied_messages"

    msg_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    applied_at: Mapped[float] = mapped_column(Float)


class PolicyState(Base):
    """Per study, the soft state of its scheduling policies (``core.policies.state`` snapshot: Hermes
    quanta, POP curves and kills), saved by the leading master and restored by the next one."""

    __tablename__ = "policy_states"

    study_id: Mapped[str] = mapped_column(ForeignKey("studies.id"), primary_key=True)
    state: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[float] = mapped_column(Float)
