"""Bus message codec benchmark, one process: ``python -m tests.bench.messages [--runs 15]``.

A realistic stream (16 batches of 250 steps: a ``metrics`` message per step, ``progress`` every 10,
``checkpoint_saved`` every 100, start and finish, some GPU telemetry), packed as a node manager packs
it (records of up to 100 messages of one key). Per message, in microseconds:

* ``construct``: building it from keyword fields, validated (what a node manager does per event);
* ``encode``: ``encode_many`` (validated again: ``metrics`` is a mutable dict), the producer's side;
* ``decode``: ``decode_many`` of the records, validated, the aggregator's side.

Side by side, interleaved run by run (medians over ``--runs``), three implementations of the same
schema, checks and wire form (``{"v": 1, "type": ...}``, bundles, NaN and Infinity written as such):

* ``stagetree``: ``stagetree.bus.messages`` as shipped (pydantic dataclasses; the envelope, version
  and bundle checks in Python, each message built from its fields);
* ``typeadapter``: pydantic dataclasses that also declare ``v`` and ``type``, so that a whole bundle is
  read in one ``TypeAdapter.validate_json`` call (pydantic's JSON reads and writes NaN/Infinity);
* ``msgspec`` (when installed): ``msgspec.Struct`` classes; its JSON reader refuses NaN/Infinity and its
  writer turns them into ``null``, so the wire form is read with ``json.loads`` + ``msgspec.convert``
  and written with ``msgspec.to_builtins`` + ``json``. Its native JSON decode, which would change the
  wire form, is printed beside it for reference.

The mirrors leave out the envelope's details (a version error, a bad message spoiling only itself in
a bundle), which only flatters them. Last line: ``stagetree_us=<t> typeadapter_us=<p> msgspec_us=<m>``,
each construct + encode + decode per message (see the lines above it for the parts). What the codec
is worth end to end is ``python -m tests.bench.pipeline`` (``cpu_us_per_point`` beside the rate).
"""

# No `from __future__ import annotations`: msgspec reads the annotations of the classes defined in
# msgspec_codec() at run time, where string annotations could not be resolved.
import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pydantic
from pydantic import ConfigDict, Field, StrictFloat, StrictInt, StrictStr, TypeAdapter

from stagetree.bus import messages as m
from tests.bench.record import record

BATCHES, STEPS, PER_RECORD = 16, 250, 100

# -- the stream, as keyword fields per message class ---------------------------------------------------


def stream() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for b in range(BATCHES):
        nm, batch_id = f"nm{b % 2}", 1000 + b
        batch: list[tuple[str, dict[str, Any]]] = [("batch_started", {})]
        for s in range(1, STEPS + 1):
            loss = 2.0 / math.sqrt(s)
            batch.append(("metrics", {"node": b, "step": s, "metrics": {"loss": loss, "acc": 1 - loss / 3}}))
            if s % 10 == 0:
                batch.append(("progress", {"node": b, "step": s}))
            if s % 100 == 0:
                ckpt = {"uri": f"file:///ckpt/{b}/{s}", "bytes": 123456, "kind": "peripheral", "ranks": 1}
                batch.append(("checkpoint_saved", {"node": b, "step": s, **ckpt}))
        batch.append(("batch_finished", {"steps": STEPS}))
        for seq, (kind, fields) in enumerate(batch):
            ids = {"msg_id": m.make_msg_id(nm, batch_id, 1, seq), "node_manager": nm, "batch_id": batch_id}
            out.append((kind, {**ids, "attempt": 1, "plan_key": "p", **fields}))
    for i in range(BATCHES):
        gpu = {"gpu_index": i % 8, "utilization": 87.5, "memory_used": 2**33, "memory_total": 2**35, "ts": 1.7e9}
        out.append(("gpu_telemetry", {"msg_id": f"nm0:t:{i}", "node_manager": "nm0", **gpu}))
    return out


def by_key(msgs: list[Any], key: Callable[[Any], str]) -> list[list[Any]]:
    """Runs of consecutive messages of one key, at most PER_RECORD each (one record each)."""
    runs: list[list[Any]] = []
    for msg in msgs:
        if runs and key(runs[-1][0]) == key(msg) and len(runs[-1]) < PER_RECORD:
            runs[-1].append(msg)
        else:
            runs.append([msg])
    return runs


@dataclass
class Codec:
    """One implementation: build a message from (type, fields); records from messages; messages back."""

    construct: Callable[[str, dict[str, Any]], Any]
    encode: Callable[[list[Any]], bytes]
    decode: Callable[[bytes], list[Any]]
    key: Callable[[Any], str]


def shipped() -> Codec:
    def encode(run: list[Any]) -> bytes:
        (record,) = m.encode_many(run)
        return record

    return Codec(lambda t, f: m.MESSAGE_TYPES[t](**f), encode, m.decode_many, lambda x: x.key)


# -- pydantic: dataclasses validated by pydantic, its JSON both ways -----------------------------------

_PD = ConfigDict(extra="forbid", revalidate_instances="always")
_Id = Annotated[StrictStr, Field(min_length=1)]
_Count = Annotated[StrictInt, Field(ge=0)]


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_PD)
class _PBatch:
    v: Literal[1] = 1
    msg_id: _Id
    node_manager: _Id
    batch_id: StrictInt
    attempt: _Count
    plan_key: StrictStr | None = None


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_PD)
class _PStarted(_PBatch):
    type: Literal["batch_started"] = "batch_started"


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_PD)
class _PProgress(_PBatch):
    type: Literal["progress"] = "progress"
    node: _Count
    step: _Count


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_PD)
class _PMetrics(_PBatch):
    type: Literal["metrics"] = "metrics"
    node: _Count
    step: _Count
    metrics: dict[_Id, StrictFloat]


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_PD)
class _PCheckpoint(_PBatch):
    type: Literal["checkpoint_saved"] = "checkpoint_saved"
    node: _Count
    step: _Count
    uri: _Id
    bytes: _Count
    kind: Literal["central", "peripheral"]
    ranks: Annotated[StrictInt, Field(ge=1)] = 1


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_PD)
class _PFinished(_PBatch):
    type: Literal["batch_finished"] = "batch_finished"
    steps: _Count


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_PD)
class _PGpuProcess:
    pid: _Count
    memory: _Count


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_PD)
class _PTelemetry:
    v: Literal[1] = 1
    type: Literal["gpu_telemetry"] = "gpu_telemetry"
    msg_id: _Id
    node_manager: _Id
    gpu_index: _Count
    utilization: Annotated[StrictFloat, Field(ge=0, le=100, allow_inf_nan=False)]
    memory_used: _Count
    memory_total: _Count
    processes: tuple[_PGpuProcess, ...] = ()
    ts: Annotated[StrictFloat, Field(allow_inf_nan=False)]


_PTYPES: dict[str, Any] = {c.type: c for c in (_PStarted, _PProgress, _PMetrics, _PCheckpoint, _PFinished, _PTelemetry)}
_PAny = Annotated[
    _PStarted | _PProgress | _PMetrics | _PCheckpoint | _PFinished | _PTelemetry, Field(discriminator="type")
]


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=_PD)
class _PBundle:
    v: Literal[1]
    type: Literal["bundle"]
    messages: list[_PAny]


def typeadapter() -> Codec:
    one = TypeAdapter(_PAny, config=ConfigDict(ser_json_inf_nan="constants"))
    bundle = TypeAdapter(_PBundle)
    head, tail = b'{"v":1,"type":"bundle","messages":[', b"]}"

    def encode(run: list[Any]) -> bytes:
        parts = [one.dump_json(one.validate_python(msg)) for msg in run]  # validated again, as shipped
        return parts[0] if len(parts) == 1 else head + b",".join(parts) + tail

    def decode(record: bytes) -> list[Any]:
        if record.startswith(head):
            return bundle.validate_json(record).messages
        return [one.validate_json(record)]

    def key(msg: Any) -> str:
        return msg.node_manager if msg.type == "gpu_telemetry" else str(msg.batch_id)

    return Codec(lambda t, f: _PTYPES[t](**f), encode, decode, key)


# -- msgspec -------------------------------------------------------------------------------------------


def msgspec_codec() -> tuple[Codec, Callable[[bytes], Any]] | None:
    try:
        import msgspec
    except ImportError:
        return None
    from msgspec import Meta, Struct

    ident = Annotated[str, Meta(min_length=1)]
    count = Annotated[int, Meta(ge=0)]

    class Batch(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
        msg_id: ident
        node_manager: ident
        batch_id: int
        attempt: count
        plan_key: str | None = None

    class Started(Batch, frozen=True, kw_only=True, tag="batch_started"):
        pass

    class Progress(Batch, frozen=True, kw_only=True, tag="progress"):
        node: count
        step: count

    class Metrics(Batch, frozen=True, kw_only=True, tag="metrics"):
        node: count
        step: count
        metrics: dict[ident, float]

    class Checkpoint(Batch, frozen=True, kw_only=True, tag="checkpoint_saved"):
        node: count
        step: count
        uri: ident
        bytes: count
        kind: Literal["central", "peripheral"]
        ranks: Annotated[int, Meta(ge=1)] = 1

    class Finished(Batch, frozen=True, kw_only=True, tag="batch_finished"):
        steps: count

    class GpuProcess(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        pid: count
        memory: count

    class Telemetry(
        Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="gpu_telemetry"
    ):
        msg_id: ident
        node_manager: ident
        gpu_index: count
        utilization: Annotated[float, Meta(ge=0, le=100)]
        memory_used: count
        memory_total: count
        processes: tuple[GpuProcess, ...] = ()
        ts: float

    types: dict[str, Any] = {
        "batch_started": Started,
        "progress": Progress,
        "metrics": Metrics,
        "checkpoint_saved": Checkpoint,
        "batch_finished": Finished,
        "gpu_telemetry": Telemetry,
    }
    writer = json.JSONEncoder(separators=(",", ":"), allow_nan=True)

    def build(kind: str, fields: dict[str, Any]) -> Any:
        return msgspec.convert(fields, types[kind])  # a Struct's own __init__ checks nothing

    def encode(run: list[Any]) -> bytes:
        out = []
        for msg in run:
            obj = msgspec.to_builtins(msg)
            msgspec.convert(obj, type(msg))  # validated again, as shipped
            out.append({"v": 1, **obj})
        text = writer.encode(out[0] if len(out) == 1 else {"v": 1, "type": "bundle", "messages": out})
        return text.encode()

    def one(obj: dict[str, Any]) -> Any:
        del obj["v"]
        return msgspec.convert(obj, types[obj.pop("type")])  # per class: a tagged-union convert is 8x slower

    def decode(record: bytes) -> list[Any]:
        obj = json.loads(record)
        return [one(x) for x in obj["messages"]] if obj["type"] == "bundle" else [one(obj)]

    def key(msg: Any) -> str:
        return msg.node_manager if isinstance(msg, Telemetry) else str(msg.batch_id)

    class Envelope(Struct, frozen=True):
        type: str
        messages: list[Started | Progress | Metrics | Checkpoint | Finished | Telemetry]

    native = msgspec.json.Decoder(Envelope)

    def decode_native(record: bytes) -> Any:  # a bundle, its "v" fields dropped (no Struct declares one)
        return native.decode(record.replace(b'"v":1,"type":"', b'"type":"')).messages

    return Codec(build, encode, decode, key), decode_native


# -- the measurement -----------------------------------------------------------------------------------


def per_message_us(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    fields = stream()
    n = len(fields)
    codecs: dict[str, Codec] = {"stagetree": shipped(), "typeadapter": typeadapter()}
    ms = msgspec_codec()
    if ms is not None:
        codecs["msgspec"] = ms[0]
    prepared = {}
    for name, c in codecs.items():
        msgs = [c.construct(t, dict(f)) for t, f in fields]
        runs = by_key(msgs, c.key)
        records = [c.encode(r) for r in runs]
        back = [x for rec in records for x in c.decode(rec)]
        assert back == msgs, f"{name}: the round trip changed the messages"
        prepared[name] = (msgs, runs, records)
    wire = prepared["stagetree"][2]
    assert json.loads(b"[" + b",".join(wire) + b"]") == json.loads(
        b"[" + b",".join(prepared["typeadapter"][2]) + b"]"
    ), "typeadapter: not the same wire form"
    times: dict[tuple[str, str], list[float]] = {(c, p): [] for c in codecs for p in ("construct", "encode", "decode")}
    native: list[float] = []
    for _ in range(args.runs):
        for name, c in codecs.items():
            msgs, runs, records = prepared[name]
            times[name, "construct"].append(per_message_us(lambda: [c.construct(t, f) for t, f in fields], n))  # noqa: B023
            times[name, "encode"].append(per_message_us(lambda: [c.encode(r) for r in runs], n))  # noqa: B023
            times[name, "decode"].append(per_message_us(lambda: [c.decode(r) for r in records], n))  # noqa: B023
        if ms is not None:
            bundles = [r for r in prepared["msgspec"][2] if r.startswith(b'{"v":1,"type":"bundle"')]
            count = sum(len(json.loads(r)["messages"]) for r in bundles)
            native.append(per_message_us(lambda: [ms[1](r) for r in bundles], count))  # noqa: B023
    totals = {}
    for name in codecs:
        parts = {p: statistics.median(times[name, p]) for p in ("construct", "encode", "decode")}
        totals[name] = sum(parts.values())
        print(f"{name:12s} messages={n} " + " ".join(f"{p}_us={v:.2f}" for p, v in parts.items()), flush=True)
    if native:
        print(f"msgspec native JSON decode (no NaN/Infinity on the wire): decode_us={statistics.median(native):.2f}")
    print(
        record(
            "messages",
            " ".join(f"{name}_us={totals.get(name, math.nan):.2f}" for name in ("stagetree", "typeadapter", "msgspec")),
        )
    )


if __name__ == "__main__":
    main()
