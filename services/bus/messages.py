"""The versioned messages that travel on the metric/event bus, and their JSON wire form.

This module owns the schema (version 1) of everything a node manager publishes and an aggregator
consumes: the eleven batch events the worker runtime emits, GPU telemetry, which topic each kind goes
to, the key that keeps one batch's messages ordered, and validation. Validation runs on both ends:
constructing a message (and so encoding it) checks every field, and decoding checks the bytes the same
way, so a bad emitter fails at its own call site and a foreign or corrupt record never reaches the
database. The schema is the classes' type hints, checked by pydantic (strict: no string is taken for a
number, no float for an integer); everything that is wrong with a message is a :class:`MalformedMessage`.

Wire form: a message is one UTF-8 JSON object, ``{"v": 1, "type": "<kind>", <fields>...}``. Unknown
fields are rejected (a new field is a new version, not a silent extra). Metric values may be NaN or
infinite (a diverged run still reports its loss); they are written as the JSON extensions ``NaN`` /
``Infinity``, which Python and most Kafka tooling read. A record holds one message, or a *bundle* of
consecutive messages with the same key, ``{"v": 1, "type": "bundle", "messages": [<message>, ...]}``
(:func:`encode_many`, :func:`decode_many`): a node manager batches its workers' reports, and one record
per batch of points instead of one per point is what lets a Python producer and consumer keep up. Each
message of a bundle is validated on its own, so one bad message does not spoil its neighbours.

Topics and order: a topic per audience, every record keyed by batch id (telemetry by node manager).

- the metrics topic carries everything that decides a batch's outcome, in the order the batch produced
  it: ``progress``, ``metrics``, ``curve`` (learning-curve points), ``checkpoint_saved``, ``rescaled``
  (the batch resumed a checkpoint written by another number of ranks: the plan's path change),
  ``batch_timing`` (where its worker's time went) and the terminal ``batch_finished`` /
  ``batch_preempted`` / ``batch_failed``. Kafka keeps order within one
  partition only, and one key is one partition, so an aggregator always applies a batch's last
  ``metrics`` before (or in the same database transaction as) its ``batch_finished``. Were they on two
  topics, two aggregators could apply the finish first, and the finish would send the requests still
  waiting for those metrics back to the queue to be trained again;
- the events topic carries what has no effect on the outcome: the lifecycle notice ``batch_started``,
  and ``log_line``, a line of text the trainer logged (kept with its batch attempt, bounded by
  ``core.loglines``);
- the telemetry topic carries ``gpu_telemetry``.

Order still holds only per batch: a consumer must not infer from one batch's stream anything about
another's, and applies every message idempotently (by ``msg_id``), since delivery is at least once.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal

import pydantic
import pydantic_core
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from stagetree.core.errors import InvalidArgument
from stagetree.core.loglines import MAX_LINE_CHARS, MAX_LINES

SCHEMA_VERSION = 1

TOPIC_METRICS = "stagetree.metrics.v1"
TOPIC_EVENTS = "stagetree.events.v1"
TOPIC_TELEMETRY = "stagetree.telemetry.v1"
ALL_TOPICS: tuple[str, ...] = (TOPIC_METRICS, TOPIC_EVENTS, TOPIC_TELEMETRY)

CheckpointKind = Literal["central", "peripheral"]


class MalformedMessage(InvalidArgument):
    """Bytes or fields that are not a valid version-1 message.

    ``reason`` says what is wrong (the field and the problem). Consumers log, count and skip these;
    a producer that gets one has a bug in the code that builds the message.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"malformed bus message: {reason}")
        self.reason = reason


class UnsupportedVersion(MalformedMessage):
    """A message whose ``"v"`` this code does not read: upgrade the consumer to read ``version``."""

    def __init__(self, version: object) -> None:
        super().__init__(
            f"schema version {version!r} is not supported (this build reads v{SCHEMA_VERSION}); "
            "upgrade the aggregator to a release that reads it"
        )
        self.version = version


def make_msg_id(node_manager: str, batch_id: int, attempt: int, seq: int) -> str:
    """The id aggregators deduplicate on: unique per (node manager, batch, attempt, sequence number)."""
    return f"{node_manager}:{batch_id}:{attempt}:{seq}"


# Strict: a message is built from typed fields or from JSON, never from strings standing for numbers.
# Metric values may be NaN or infinite, written as NaN / Infinity.
_SCHEMA = ConfigDict(strict=True, extra="forbid", ser_json_inf_nan="constants")
NonEmpty = Annotated[str, Field(min_length=1)]
Count = Annotated[int, Field(ge=0)]
Ranks = Annotated[int, Field(ge=1, le=2**31 - 1)]


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class _Checked:
    """Validated on construction (pydantic); what is wrong is raised as a :class:`MalformedMessage`."""

    @model_validator(mode="wrap")
    @classmethod
    def _malformed(cls, value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError as e:
            if not isinstance(value, pydantic_core.ArgsKwargs):  # a field of another message: that one says
                raise
            # Not a ValueError, so pydantic lets it through to the constructor's caller as it is.
            raise MalformedMessage("; ".join(_describe(cls, error) for error in e.errors())) from None


def _describe(cls: type, error: Any) -> str:
    """``"<type>.<field>[<key>]: <what is wrong>, got <value>"`` for one pydantic error."""
    first, *rest = error["loc"] or ("",)
    where = f"{_type_name(cls)}.{first}" + "".join(f"[{part!r}]" for part in rest if part != "[key]")
    if error["type"] == "missing":
        return f"{where}: required field missing"
    if error["type"] == "unexpected_keyword_argument":
        return f"{where}: unknown field"
    return f"{where}: {error['msg']}, got {error['input']!r}"


def _type_name(cls: type) -> str:
    return str(getattr(cls, "TYPE", cls.__name__))


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class Message(_Checked, abc.ABC):
    """Fields every message carries. Subclasses set ``TYPE`` and ``TOPIC``."""

    TYPE: ClassVar[str]
    TOPIC: ClassVar[str]

    msg_id: NonEmpty
    node_manager: NonEmpty

    @property
    @abc.abstractmethod
    def key(self) -> str:
        """The partition key: every message of one batch (or one node's telemetry) lands in order."""

    def to_json(self) -> dict[str, Any]:
        """The wire form as a JSON object (a copy: changing it changes nothing here)."""
        return {"v": SCHEMA_VERSION, "type": self.TYPE, **_adapter(type(self)).dump_python(self)}


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class BatchMessage(Message):
    """A message about one attempt at one stage batch; keyed by the batch id."""

    batch_id: int
    attempt: Count
    plan_key: str | None = None

    @property
    def key(self) -> str:
        return str(self.batch_id)


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class BatchStarted(BatchMessage):
    TYPE: ClassVar[str] = "batch_started"
    TOPIC: ClassVar[str] = TOPIC_EVENTS

    # when the node manager saw the worker start (epoch seconds, its clock); None: not said. Optional and
    # added within version 1: an aggregator of before it counts such a message malformed and skips it,
    # which changes nothing, since it ignored batch_started anyway
    started_at: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = None


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class Progress(BatchMessage):
    TYPE: ClassVar[str] = "progress"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    node: Count
    step: Count


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class Metrics(BatchMessage):
    TYPE: ClassVar[str] = "metrics"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    node: Count
    step: Count
    metrics: dict[NonEmpty, float]


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class Curve(BatchMessage):
    """Learning-curve points of one plan node, in step order: ``values[i]`` are the step metrics the
    trainer reported after ``steps[i]`` steps (finite values only: a curve point is stored as JSON)."""

    TYPE: ClassVar[str] = "curve"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    node: Count
    steps: list[Annotated[int, Field(ge=1)]]
    values: list[dict[NonEmpty, Annotated[float, Field(allow_inf_nan=False)]]]

    def __post_init__(self) -> None:
        if not self.steps or len(self.steps) != len(self.values):
            raise MalformedMessage(
                f"curve.steps and curve.values must be non-empty and of one length, got {len(self.steps)} "
                f"and {len(self.values)}"
            )


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class CheckpointSaved(BatchMessage):
    TYPE: ClassVar[str] = "checkpoint_saved"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    node: Count
    step: Count
    uri: NonEmpty
    bytes: Count
    kind: CheckpointKind
    ranks: Ranks = 1  # how many ranks' training wrote it (absent from an older producer: one)


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class Rescaled(BatchMessage):
    """The batch, on ``to_ranks`` ranks, resumed the checkpoint at (node, step) that ``from_ranks`` ranks
    wrote (its trainer is ``rescalable``): the plan's path changed there. On the metrics topic, ahead of
    everything the batch then produced."""

    TYPE: ClassVar[str] = "rescaled"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    node: Count
    step: Count
    uri: NonEmpty
    from_ranks: Ranks
    to_ranks: Ranks

    def __post_init__(self) -> None:
        if self.from_ranks == self.to_ranks:
            raise MalformedMessage(f"rescaled: from_ranks and to_ranks are both {self.to_ranks}: nothing changed")


Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class BatchTiming(BatchMessage):
    """Where the attempt's worker spent its time (``core.lifecycle.AttemptTiming``), as it measured it: on
    the metrics topic just ahead of the attempt's terminal event. Added within version 1: an aggregator of
    before it counts it malformed and skips it, and the study's stats then count the attempt from its
    worker's start to its end."""

    TYPE: ClassVar[str] = "batch_timing"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    given_at: Seconds  # epoch seconds, the worker's host clock
    startup_s: Seconds
    checkpoint_s: Seconds
    train_s: Seconds


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class BatchFinished(BatchMessage):
    TYPE: ClassVar[str] = "batch_finished"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    steps: Count


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class BatchPreempted(BatchMessage):
    TYPE: ClassVar[str] = "batch_preempted"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    node: Count
    step: Count
    uri: NonEmpty
    ranks: Ranks = 1  # how many ranks' training wrote its checkpoint


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class BatchFailed(BatchMessage):
    TYPE: ClassVar[str] = "batch_failed"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    error: str
    traceback: str
    oom: bool
    user_error: bool = False  # the trainer's own code raised: a retry would raise again
    host_problem: bool = False  # this host cannot import the trainer: another node manager may


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class LogLine(BatchMessage):
    """One line of text the batch's trainer logged (``Trainer.log_text``): the attempt's ``seq``-th, at
    ``at`` (epoch seconds, the worker's clock) while the batch stood at (node, step). Bounded by
    ``core.loglines``: ``seq`` below ``MAX_LINES`` and ``line`` at most ``MAX_LINE_CHARS`` characters."""

    TYPE: ClassVar[str] = "log_line"
    TOPIC: ClassVar[str] = TOPIC_EVENTS

    seq: Annotated[int, Field(ge=0, lt=MAX_LINES)]
    node: Count
    step: Count
    at: Seconds
    line: Annotated[str, Field(max_length=MAX_LINE_CHARS)]


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class GpuProcess(_Checked):
    """One process on a GPU, as NVML reports it (memory in bytes)."""

    pid: Count
    memory: Count


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_SCHEMA)
class GpuTelemetry(Message):
    """One sample of one GPU; keyed by node manager so a node's samples stay ordered."""

    TYPE: ClassVar[str] = "gpu_telemetry"
    TOPIC: ClassVar[str] = TOPIC_TELEMETRY

    gpu_index: Count
    utilization: Annotated[float, Field(ge=0.0, le=100.0)]  # a percentage
    memory_used: Count
    memory_total: Count
    processes: tuple[GpuProcess, ...] = ()
    ts: Annotated[float, Field(allow_inf_nan=False)]

    @property
    def key(self) -> str:
        return self.node_manager


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        BatchStarted,
        Progress,
        Metrics,
        Curve,
        CheckpointSaved,
        Rescaled,
        BatchTiming,
        BatchFinished,
        BatchPreempted,
        BatchFailed,
        LogLine,
        GpuTelemetry,
    )
}
_ADAPTERS: dict[type, TypeAdapter[Any]] = {}


def _adapter(cls: type) -> TypeAdapter[Any]:
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


def route(message: Message) -> tuple[str, str]:
    """The (topic, key) a message is published under."""
    return message.TOPIC, message.key


def encode(message: Message) -> bytes:
    """The wire form of ``message``; validated again (a copy is built from its fields) because
    ``metrics`` is a mutable dict."""
    cls = type(message)
    if cls not in MESSAGE_TYPES.values():
        raise MalformedMessage(f"{cls.__name__} is not a bus message type")
    checked = dataclasses.replace(message)
    fields = _adapter(cls).dump_json(checked)  # b'{"msg_id":...}'
    return b'{"v":%d,"type":"%s",' % (SCHEMA_VERSION, cls.TYPE.encode()) + fields[1:]


BUNDLE_TYPE = "bundle"
MAX_RECORD_BYTES = 900 * 1024  # below Kafka's default 1 MiB limit on a record
_BUNDLE_HEAD = b'{"v":%d,"type":"%s","messages":[' % (SCHEMA_VERSION, BUNDLE_TYPE.encode())
_BUNDLE_TAIL = b"]}"


def encode_many(messages: Sequence[Message], max_bytes: int = MAX_RECORD_BYTES) -> list[bytes]:
    """Record values for ``messages``, in order: consecutive messages packed into bundles of at most
    ``max_bytes`` (a bundle of one is written as the bare message; a message over ``max_bytes`` is a
    record of its own, which the bus may then refuse)."""
    out: list[bytes] = []
    group: list[bytes] = []
    size = len(_BUNDLE_HEAD) + len(_BUNDLE_TAIL)
    for message in messages:
        part = encode(message)
        if group and size + len(part) + 1 > max_bytes:
            out.append(_join(group))
            group, size = [], len(_BUNDLE_HEAD) + len(_BUNDLE_TAIL)
        group.append(part)
        size += len(part) + 1
    if group:
        out.append(_join(group))
    return out


def _join(parts: list[bytes]) -> bytes:
    return parts[0] if len(parts) == 1 else _BUNDLE_HEAD + b",".join(parts) + _BUNDLE_TAIL


def decode_many(data: bytes | bytearray | memoryview | None) -> list[Message | MalformedMessage]:
    """The messages of one record value (one, or a bundle's), each validated on its own: an entry is a
    message or the :class:`MalformedMessage` saying why it is not one. Never raises for bad input."""
    try:
        obj = _parse(data)
    except MalformedMessage as e:
        return [e]
    if not (isinstance(obj, dict) and obj.get("type") == BUNDLE_TYPE):
        try:
            return [_from_json(obj)]
        except MalformedMessage as e:
            return [e]
    version = obj.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        return [UnsupportedVersion(version)]
    items = obj.get("messages")
    extra = sorted(set(obj) - {"v", "type", "messages"})
    if extra or not isinstance(items, list) or not items:
        return [MalformedMessage(f"bundle: expected only a non-empty list 'messages', got fields {sorted(obj)}")]
    out: list[Message | MalformedMessage] = []
    for item in items:
        try:
            out.append(_from_json(item))
        except MalformedMessage as e:
            out.append(e)
    return out


def _parse(data: bytes | bytearray | memoryview | None) -> object:
    if data is None:
        raise MalformedMessage("empty record value (tombstone)")
    try:
        return pydantic_core.from_json(bytes(data) if isinstance(data, memoryview) else data)  # NaN too
    except ValueError as e:  # also bad UTF-8, and nesting too deep
        raise MalformedMessage(f"not UTF-8 JSON: {e}") from None


def decode(data: bytes | bytearray | memoryview | None) -> Message:
    """Parse and validate one record value. Raises :class:`MalformedMessage` (or its subclass
    :class:`UnsupportedVersion`) for anything that is not a valid version-1 message."""
    return _from_json(_parse(data))


def from_json(obj: object) -> Message:
    """Validate a parsed JSON object and build the message it describes."""
    if isinstance(obj, dict) and not all(isinstance(k, str) for k in obj):
        raise MalformedMessage(f"expected a JSON object, got keys {sorted(map(repr, obj))}")
    return _from_json(dict(obj) if isinstance(obj, dict) else obj)


def _from_json(obj: object) -> Message:
    """:func:`from_json` on an object this module parsed itself (so it may take it apart)."""
    if type(obj) is not dict:
        raise MalformedMessage(f"expected a JSON object, got {type(obj).__name__}")
    if "v" not in obj:
        raise MalformedMessage('missing the version field "v"')
    version = obj["v"]
    if type(version) is not int or version != SCHEMA_VERSION:
        raise UnsupportedVersion(version)
    kind = obj.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedMessage(f"unknown type {kind!r}; known: {sorted(MESSAGE_TYPES)}")
    del obj["v"], obj["type"]
    return _build(cls, obj)


def _build(cls: type[Message], fields: dict[str, Any]) -> Message:
    processes = fields.get("processes")
    if cls is GpuTelemetry and isinstance(processes, list):  # JSON has neither tuples nor GpuProcess objects
        fields["processes"] = tuple(GpuProcess(**p) if isinstance(p, dict) else p for p in processes)
    return cls(**fields)
