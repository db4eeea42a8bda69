"""The versioned messages that travel on the metric/event bus, and their JSON wire form.

This module owns the schema (version 1) of everything a node manager publishes and an aggregator
consumes: the seven batch events the worker runtime emits, GPU telemetry, which topic each kind goes
to, the key that keeps one batch's messages ordered, and validation. Validation runs on both ends:
constructing a message (and so encoding it) checks every field, and decoding checks the bytes the same
way, so a bad emitter fails at its own call site and a foreign or corrupt record never reaches the
database. Everything that is wrong with a message is a :class:`MalformedMessage`.

Wire form: one UTF-8 JSON object per record, ``{"v": 1, "type": "<kind>", <fields>...}``. Unknown
fields are rejected (a new field is a new version, not a silent extra). Metric values may be NaN or
infinite (a diverged run still reports its loss); they are written as the JSON extensions ``NaN`` /
``Infinity``, which Python and most Kafka tooling read.

Topics and order: ``progress`` and ``metrics`` go to the metrics topic, the other batch events to the
events topic, telemetry to its own; all keyed by batch id (telemetry by node manager). Order holds
within one topic only, so a consumer of both may see ``batch_finished`` before that batch's last
``metrics``: apply each message on its own (idempotently, by ``msg_id``), never infer from one
stream what the other has delivered.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar, Union

from stagetree.core.errors import InvalidArgument

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


@dataclass(frozen=True, kw_only=True)
class Message(abc.ABC):
    """Fields every message carries. Subclasses set ``TYPE`` and ``TOPIC``."""

    TYPE: ClassVar[str]
    TOPIC: ClassVar[str]

    msg_id: str
    node_manager: str

    def __post_init__(self) -> None:
        _validate(self)

    @property
    @abc.abstractmethod
    def key(self) -> str:
        """The partition key: every message of one batch (or one node's telemetry) lands in order."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": SCHEMA_VERSION, "type": self.TYPE}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = [dataclasses.asdict(v) if isinstance(v, GpuProcess) else v for v in value]
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        return out


@dataclass(frozen=True, kw_only=True)
class BatchMessage(Message):
    """A message about one attempt at one stage batch; keyed by the batch id."""

    batch_id: int
    attempt: int
    plan_key: str | None = None

    @property
    def key(self) -> str:
        return str(self.batch_id)


@dataclass(frozen=True, kw_only=True)
class BatchStarted(BatchMessage):
    TYPE: ClassVar[str] = "batch_started"
    TOPIC: ClassVar[str] = TOPIC_EVENTS


@dataclass(frozen=True, kw_only=True)
class Progress(BatchMessage):
    TYPE: ClassVar[str] = "progress"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    node: int
    step: int


@dataclass(frozen=True, kw_only=True)
class Metrics(BatchMessage):
    TYPE: ClassVar[str] = "metrics"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    node: int
    step: int
    metrics: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class CheckpointSaved(BatchMessage):
    TYPE: ClassVar[str] = "checkpoint_saved"
    TOPIC: ClassVar[str] = TOPIC_EVENTS

    node: int
    step: int
    uri: str
    bytes: int
    kind: CheckpointKind


@dataclass(frozen=True, kw_only=True)
class BatchFinished(BatchMessage):
    TYPE: ClassVar[str] = "batch_finished"
    TOPIC: ClassVar[str] = TOPIC_EVENTS

    steps: int


@dataclass(frozen=True, kw_only=True)
class BatchPreempted(BatchMessage):
    TYPE: ClassVar[str] = "batch_preempted"
    TOPIC: ClassVar[str] = TOPIC_EVENTS

    node: int
    step: int
    uri: str


@dataclass(frozen=True, kw_only=True)
class BatchFailed(BatchMessage):
    TYPE: ClassVar[str] = "batch_failed"
    TOPIC: ClassVar[str] = TOPIC_EVENTS

    error: str
    traceback: str
    oom: bool


@dataclass(frozen=True, kw_only=True)
class GpuProcess:
    """One process on a GPU, as NVML reports it (memory in bytes)."""

    pid: int
    memory: int

    def __post_init__(self) -> None:
        _validate(self)


@dataclass(frozen=True, kw_only=True)
class GpuTelemetry(Message):
    """One sample of one GPU; keyed by node manager so a node's samples stay ordered."""

    TYPE: ClassVar[str] = "gpu_telemetry"
    TOPIC: ClassVar[str] = TOPIC_TELEMETRY

    gpu_index: int
    utilization: float
    memory_used: int
    memory_total: int
    processes: tuple[GpuProcess, ...] = field(default=())
    ts: float

    @property
    def key(self) -> str:
        return self.node_manager


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        BatchStarted,
        Progress,
        Metrics,
        CheckpointSaved,
        BatchFinished,
        BatchPreempted,
        BatchFailed,
        GpuTelemetry,
    )
}

T = TypeVar("T")


def route(message: Message) -> tuple[str, str]:
    """The (topic, key) a message is published under."""
    return message.TOPIC, message.key


def encode(message: Message) -> bytes:
    """The wire form of ``message``; re-validates because ``metrics`` is a mutable dict."""
    if type(message) not in MESSAGE_TYPES.values():
        raise MalformedMessage(f"{type(message).__name__} is not a bus message type")
    _validate(message)
    return json.dumps(message.to_json(), separators=(",", ":"), allow_nan=True).encode()


def decode(data: bytes | bytearray | memoryview | None) -> Message:
    """Parse and validate one record value. Raises :class:`MalformedMessage` (or its subclass
    :class:`UnsupportedVersion`) for anything that is not a valid version-1 message."""
    if data is None:
        raise MalformedMessage("empty record value (tombstone)")
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MalformedMessage(f"not UTF-8 JSON: {e!r}") from None
    return from_json(obj)


def from_json(obj: object) -> Message:
    """Validate a parsed JSON object and build the message it describes."""
    if not isinstance(obj, dict):
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
    return _build(cls, {k: v for k, v in obj.items() if k not in ("v", "type")})


def _build(cls: type[T], fields: dict[str, Any]) -> T:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # always a dataclass
    unknown = sorted(set(fields) - names)
    if unknown:
        raise MalformedMessage(f"{_type_name(cls)}: unknown fields {unknown}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in fields.items():
        hint = hints[name]
        if hint == tuple[GpuProcess, ...]:
            if not isinstance(value, list):
                raise MalformedMessage(f"{_type_name(cls)}.{name}: expected a list")
            value = tuple(_build(GpuProcess, p) if isinstance(p, dict) else p for p in value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a missing required field
        raise MalformedMessage(f"{_type_name(cls)}: {e}") from None


# --- validation --------------------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = {k: v for k, v in typing.get_type_hints(cls).items() if typing.get_origin(v) is not ClassVar}
    return _HINTS[cls]


def _type_name(cls: type) -> str:
    return str(getattr(cls, "TYPE", cls.__name__))


def _validate(obj: object) -> None:
    cls = type(obj)
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        where = f"{_type_name(cls)}.{f.name}"
        normalized = _check(where, _hints(cls)[f.name], value)
        if normalized is not value:
            # Frozen dataclass: accept JSON's 1 for a float field, and store the float.
            object.__setattr__(obj, f.name, normalized)
    _check_ranges(obj)


def _check(where: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if hint is str:
        if not isinstance(value, str):
            raise MalformedMessage(f"{where}: expected a string, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise MalformedMessage(f"{where}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MalformedMessage(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MalformedMessage(f"{where}: expected a number, got {value!r}")
        return value if type(value) is float else float(value)
    if origin in (Union, types.UnionType):  # only `X | None` is used
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _check(where, inner, value)
    if origin is Literal:
        if value not in typing.get_args(hint) or not isinstance(value, str):
            raise MalformedMessage(f"{where}: expected one of {list(typing.get_args(hint))}, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise MalformedMessage(f"{where}: expected an object, got {value!r}")
        _, vhint = typing.get_args(hint)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or not k:
                raise MalformedMessage(f"{where}: keys must be non-empty strings, got {k!r}")
            out[k] = _check(f"{where}[{k!r}]", vhint, v)
        return value if all(out[k] is value[k] for k in value) else out
    if origin is tuple:
        if not isinstance(value, tuple):
            raise MalformedMessage(f"{where}: expected a list, got {value!r}")
        (inner, _) = typing.get_args(hint)
        for i, item in enumerate(value):
            if not isinstance(item, inner):
                raise MalformedMessage(f"{where}[{i}]: expected {inner.__name__}, got {item!r}")
        return value
    raise AssertionError(f"{where}: no validator for {hint!r}")  # a schema bug, caught by the unit tests


def _check_ranges(obj: object) -> None:
    where = _type_name(type(obj))
    for name in ("msg_id", "node_manager", "uri"):
        if getattr(obj, name, "x") == "":
            raise MalformedMessage(f"{where}.{name}: must not be empty")
    for name in ("attempt", "node", "step", "steps", "bytes", "gpu_index", "memory_used", "memory_total"):
        value = getattr(obj, name, 0)
        if value < 0:
            raise MalformedMessage(f"{where}.{name}: must be >= 0, got {value}")
    if isinstance(obj, GpuProcess) and (obj.pid < 0 or obj.memory < 0):
        raise MalformedMessage(f"gpu process: pid and memory must be >= 0, got {obj}")
    if isinstance(obj, GpuTelemetry):
        if not (math.isfinite(obj.utilization) and 0.0 <= obj.utilization <= 100.0):
            raise MalformedMessage(f"{where}.utilization: a percentage in [0, 100], got {obj.utilization}")
        if not math.isfinite(obj.ts):
            raise MalformedMessage(f"{where}.ts: must be finite, got {obj.ts}")
