"""The versioned messages that travel on the metric/event bus, and their JSON wire form.

This module owns the schema (version 1) of everything a node manager publishes and an aggregator
consumes: the seven batch events the worker runtime emits, GPU telemetry, which topic each kind goes
to, the key that keeps one batch's messages ordered, and validation. Validation runs on both ends:
constructing a message (and so encoding it) checks every field, and decoding checks the bytes the same
way, so a bad emitter fails at its own call site and a foreign or corrupt record never reaches the
database. Everything that is wrong with a message is a :class:`MalformedMessage`.

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
  it: ``progress``, ``metrics``, ``checkpoint_saved`` and the terminal ``batch_finished`` /
  ``batch_preempted`` / ``batch_failed``. Kafka keeps order within one partition only, and one key is one
  partition, so an aggregator always applies a batch's last ``metrics`` before (or in the same database
  transaction as) its ``batch_finished``. Were they on two topics, two aggregators could apply the
  finish first, and the finish would send the requests still waiting for those metrics back to the
  queue to be trained again;
- the events topic carries lifecycle notices with no effect on the outcome (``batch_started``), for
  observers;
- the telemetry topic carries ``gpu_telemetry``.

Order still holds only per batch: a consumer must not infer from one batch's stream anything about
another's, and applies every message idempotently (by ``msg_id``), since delivery is at least once.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable, Sequence
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
        plan = _plan(type(self))
        out: dict[str, Any] = {"v": SCHEMA_VERSION, "type": self.TYPE}
        out.update(self.__dict__)
        for name in plan.dicts:
            out[name] = dict(out[name])
        if plan.nested:
            out[plan.nested] = [dataclasses.asdict(v) if isinstance(v, GpuProcess) else v for v in out[plan.nested]]
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
    TOPIC: ClassVar[str] = TOPIC_METRICS

    node: int
    step: int
    uri: str
    bytes: int
    kind: CheckpointKind


@dataclass(frozen=True, kw_only=True)
class BatchFinished(BatchMessage):
    TYPE: ClassVar[str] = "batch_finished"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    steps: int


@dataclass(frozen=True, kw_only=True)
class BatchPreempted(BatchMessage):
    TYPE: ClassVar[str] = "batch_preempted"
    TOPIC: ClassVar[str] = TOPIC_METRICS

    node: int
    step: int
    uri: str


@dataclass(frozen=True, kw_only=True)
class BatchFailed(BatchMessage):
    TYPE: ClassVar[str] = "batch_failed"
    TOPIC: ClassVar[str] = TOPIC_METRICS

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
    return _ENCODER.encode(message.to_json()).encode()


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=True)  # json.dumps with options builds one per call


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
        return json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MalformedMessage(f"not UTF-8 JSON: {e!r}") from None


def decode(data: bytes | bytearray | memoryview | None) -> Message:
    """Parse and validate one record value. Raises :class:`MalformedMessage` (or its subclass
    :class:`UnsupportedVersion`) for anything that is not a valid version-1 message."""
    return _from_json(_parse(data))


def from_json(obj: object) -> Message:
    """Validate a parsed JSON object and build the message it describes."""
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


def _build(cls: type[T], fields: dict[str, Any]) -> T:
    plan = _plan(cls)
    if not plan.names.issuperset(fields):
        unknown = [name for name in fields if name not in plan.names]
        raise MalformedMessage(f"{plan.type_name}: unknown fields {sorted(unknown)}")
    if plan.nested and plan.nested in fields:
        value = fields[plan.nested]
        if not isinstance(value, list):
            raise MalformedMessage(f"{plan.type_name}.{plan.nested}: expected a list")
        fields[plan.nested] = tuple(_build(GpuProcess, p) if isinstance(p, dict) else p for p in value)
    missing = [name for name in plan.required if name not in fields]
    if missing:
        raise MalformedMessage(f"{plan.type_name}: missing {len(missing)} required field(s): {missing}")
    return cls(**fields)  # __post_init__ validates


# --- validation --------------------------------------------------------------------------------------
#
# Each message class is read once into a _Plan: one checker per field, built from its type hint, plus
# the range checks that apply to it; validating a message walks that plan.

_Checker = Callable[[str, Any], Any]  # (where, value) -> the value, normalized; raises MalformedMessage

_NOT_EMPTY = ("msg_id", "node_manager", "uri")
_NON_NEGATIVE = ("attempt", "node", "step", "steps", "bytes", "gpu_index", "memory_used", "memory_total")


@dataclass(frozen=True)
class _Plan:
    type_name: str
    names: frozenset[str]
    fields: tuple[tuple[str, str, _Checker], ...]  # (name, "type.name" for errors, checker)
    not_empty: tuple[str, ...]
    non_negative: tuple[str, ...]
    nested: str | None  # the field holding GpuProcess objects, if any
    dicts: tuple[str, ...]  # fields holding a dict (copied on the way out)
    required: tuple[str, ...]  # fields without a default


_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        type_name = _type_name(cls)
        hints = {k: v for k, v in typing.get_type_hints(cls).items() if typing.get_origin(v) is not ClassVar}
        fields = dataclasses.fields(cls)
        names = [f.name for f in fields]
        plan = _PLANS[cls] = _Plan(
            type_name=type_name,
            names=frozenset(names),
            fields=tuple((n, f"{type_name}.{n}", _compile(hints[n])) for n in names),
            not_empty=tuple(n for n in _NOT_EMPTY if n in names),
            non_negative=tuple(n for n in _NON_NEGATIVE if n in names),
            nested=next((n for n in names if hints[n] == tuple[GpuProcess, ...]), None),
            dicts=tuple(n for n in names if typing.get_origin(hints[n]) is dict),
            required=tuple(
                f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            ),
        )
    return plan


def _type_name(cls: type) -> str:
    return str(getattr(cls, "TYPE", cls.__name__))


def _validate(obj: object) -> None:
    """Check every field of ``obj`` (a message or a ``GpuProcess``); a value a checker normalizes (JSON's
    1 for a float field) is stored back, as a frozen dataclass's ``__post_init__`` may."""
    plan = _plan(type(obj))
    for name, where, check in plan.fields:
        value = getattr(obj, name)
        checked = check(where, value)
        if checked is not value:
            object.__setattr__(obj, name, checked)
    for name in plan.not_empty:
        if getattr(obj, name) == "":
            raise MalformedMessage(f"{plan.type_name}.{name}: must not be empty")
    for name in plan.non_negative:
        if getattr(obj, name) < 0:
            raise MalformedMessage(f"{plan.type_name}.{name}: must be >= 0, got {getattr(obj, name)}")
    if isinstance(obj, GpuProcess | GpuTelemetry):
        _check_gpu(obj)


def _check_str(where: str, value: Any) -> Any:
    if type(value) is not str and not isinstance(value, str):
        raise MalformedMessage(f"{where}: expected a string, got {value!r}")
    return value


def _check_bool(where: str, value: Any) -> Any:
    if not isinstance(value, bool):
        raise MalformedMessage(f"{where}: expected true/false, got {value!r}")
    return value


def _check_int(where: str, value: Any) -> Any:
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, int)):
        raise MalformedMessage(f"{where}: expected an integer, got {value!r}")
    return value


def _check_float(where: str, value: Any) -> Any:
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedMessage(f"{where}: expected a number, got {value!r}")
    return float(value)


_SCALARS: dict[Any, _Checker] = {str: _check_str, bool: _check_bool, int: _check_int, float: _check_float}


def _compile(hint: Any) -> _Checker:
    """The checker for one type hint; the schema uses only the forms below."""
    if hint in _SCALARS:
        return _SCALARS[hint]
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):  # only `X | None` is used
        (inner_hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        inner = _compile(inner_hint)

        def check_optional(where: str, value: Any) -> Any:
            return None if value is None else inner(where, value)

        return check_optional
    if origin is Literal:
        allowed = typing.get_args(hint)

        def check_literal(where: str, value: Any) -> Any:
            if not isinstance(value, str) or value not in allowed:
                raise MalformedMessage(f"{where}: expected one of {list(allowed)}, got {value!r}")
            return value

        return check_literal
    if origin is dict:
        _, value_hint = typing.get_args(hint)
        check_value = _compile(value_hint)

        def check_dict(where: str, value: Any) -> Any:
            if not isinstance(value, dict):
                raise MalformedMessage(f"{where}: expected an object, got {value!r}")
            changed = False
            out = {}
            for k, v in value.items():
                if type(k) is not str or not k:
                    raise MalformedMessage(f"{where}: keys must be non-empty strings, got {k!r}")
                nv = check_value(f"{where}[{k!r}]", v) if type(v) is not float else v
                changed = changed or nv is not v
                out[k] = nv
            return out if changed else value

        return check_dict
    if origin is tuple:
        item_type, _ = typing.get_args(hint)

        def check_tuple(where: str, value: Any) -> Any:
            if not isinstance(value, tuple):
                raise MalformedMessage(f"{where}: expected a list, got {value!r}")
            for i, item in enumerate(value):
                if not isinstance(item, item_type):
                    raise MalformedMessage(f"{where}[{i}]: expected {item_type.__name__}, got {item!r}")
            return value

        return check_tuple
    raise AssertionError(f"no validator for {hint!r}")  # a schema bug, caught by the unit tests


def _check_gpu(obj: GpuProcess | GpuTelemetry) -> None:
    if isinstance(obj, GpuProcess):
        if obj.pid < 0 or obj.memory < 0:
            raise MalformedMessage(f"gpu process: pid and memory must be >= 0, got {obj}")
        return
    where = _type_name(type(obj))
    if not (math.isfinite(obj.utilization) and 0.0 <= obj.utilization <= 100.0):
        raise MalformedMessage(f"{where}.utilization: a percentage in [0, 100], got {obj.utilization}")
    if not math.isfinite(obj.ts):
        raise MalformedMessage(f"{where}.ts: must be finite, got {obj.ts}")
