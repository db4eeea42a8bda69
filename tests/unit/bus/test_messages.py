"""Bus message schema: round trips, routing, and every way a message can be malformed."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagetree.bus.messages import (
    BUNDLE_TYPE,
    MESSAGE_TYPES,
    TOPIC_EVENTS,
    TOPIC_METRICS,
    TOPIC_TELEMETRY,
    BatchFailed,
    BatchFinished,
    BatchPreempted,
    BatchStarted,
    BatchTiming,
    CheckpointSaved,
    Curve,
    GpuProcess,
    GpuTelemetry,
    LogLine,
    MalformedMessage,
    Message,
    Metrics,
    Progress,
    Rescaled,
    UnsupportedVersion,
    decode,
    decode_many,
    encode,
    encode_many,
    from_json,
    make_msg_id,
    route,
)
from stagetree.core.errors import InvalidArgument
from stagetree.core.loglines import MAX_LINE_CHARS, MAX_LINES

ids = st.text(min_size=1, max_size=20)
counts = st.integers(min_value=0, max_value=2**53)
batch_fields: dict[str, Any] = {
    "msg_id": ids,
    "node_manager": ids,
    "batch_id": counts,
    "attempt": st.integers(min_value=0, max_value=100),
    "plan_key": st.none() | ids,
}
finite = st.floats(allow_nan=False, allow_infinity=False)
at: dict[str, Any] = {"node": counts, "step": counts}

messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(BatchStarted, **batch_fields),
    st.builds(Progress, **batch_fields, **at),
    st.builds(Metrics, **batch_fields, **at, metrics=st.dictionaries(ids, finite, max_size=5)),
    st.builds(
        CheckpointSaved,
        **batch_fields,
        **at,
        uri=ids,
        bytes=counts,
        kind=st.sampled_from(["central", "peripheral"]),
        ranks=st.integers(1, 64),
    ),
    st.tuples(st.integers(1, 64), st.integers(1, 63)).flatmap(
        lambda r: st.builds(
            Rescaled,
            **batch_fields,
            **at,
            uri=ids,
            from_ranks=st.just(r[0]),
            to_ranks=st.just(r[1] if r[1] < r[0] else r[1] + 1),  # never equal
        )
    ),
    st.lists(
        st.tuples(st.integers(1, 2**31), st.dictionaries(ids, finite, max_size=3)), min_size=1, max_size=4
    ).flatmap(
        lambda pts: st.builds(
            Curve, **batch_fields, node=counts, steps=st.just([s for s, _ in pts]), values=st.just([v for _, v in pts])
        )
    ),
    st.builds(
        BatchTiming,
        **batch_fields,
        given_at=st.floats(0, 4e9),
        startup_s=st.floats(0, 1e6),
        checkpoint_s=st.floats(0, 1e6),
        train_s=st.floats(0, 1e6),
    ),
    st.builds(BatchFinished, **batch_fields, steps=counts),
    st.builds(BatchPreempted, **batch_fields, **at, uri=ids, ranks=st.integers(1, 64)),
    st.builds(BatchFailed, **batch_fields, error=st.text(), traceback=st.text(), oom=st.booleans()),
    st.builds(
        LogLine,
        **batch_fields,
        **at,
        seq=st.integers(0, MAX_LINES - 1),
        at=st.floats(0, 4e9),
        line=st.text(max_size=MAX_LINE_CHARS),
    ),
    st.builds(
        GpuTelemetry,
        msg_id=ids,
        node_manager=ids,
        gpu_index=st.integers(0, 15),
        utilization=st.floats(0, 100),
        memory_used=counts,
        memory_total=counts,
        processes=st.lists(st.builds(GpuProcess, pid=counts, memory=counts), max_size=3).map(tuple),
        ts=finite,
    ),
)


@given(messages)
def test_every_message_survives_encode_and_decode(message: Message) -> None:
    wire = encode(message)
    obj = json.loads(wire)
    assert obj["v"] == 1
    assert obj["type"] == message.TYPE
    assert decode(wire) == message


@given(messages)
def test_a_message_is_keyed_by_its_batch_or_its_node_manager(message: Message) -> None:
    topic, key = route(message)
    if isinstance(message, GpuTelemetry):
        assert (topic, key) == (TOPIC_TELEMETRY, message.node_manager)
    else:
        assert key == str(message.batch_id)  # type: ignore[attr-defined]
        assert topic == (TOPIC_EVENTS if isinstance(message, (BatchStarted, LogLine)) else TOPIC_METRICS)


def test_everything_that_decides_a_batch_outcome_shares_one_topic_so_one_partition_orders_it() -> None:
    # A finish applied before that batch's last metrics would requeue work that is already done.
    outcome = {Metrics, CheckpointSaved, Rescaled, BatchTiming, BatchFinished, BatchPreempted, BatchFailed}
    assert {cls.TOPIC for cls in outcome} == {TOPIC_METRICS}
    assert [cls.TYPE for cls in MESSAGE_TYPES.values() if cls.TOPIC == TOPIC_EVENTS] == ["batch_started", "log_line"]


@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_malformed(data: bytes) -> None:
    try:
        result = decode(data)
    except MalformedMessage:
        return
    assert isinstance(result, Message)  # and no other exception type ever escapes


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@given(
    messages, st.sampled_from(sorted({"msg_id", "batch_id", "attempt", "node", "step", "ts", "metrics"})), json_values
)
def test_a_field_replaced_by_any_json_value_is_valid_or_malformed(message: Message, name: str, value: object) -> None:
    obj = message.to_json()
    if name not in obj:
        return
    obj[name] = value
    try:
        decoded = from_json(json.loads(json.dumps(obj)))
    except MalformedMessage:
        return
    assert decoded.to_json()[name] == value  # accepted, so it was a valid value, and kept as given


def _valid() -> dict[str, Any]:
    return json.loads(
        encode(
            CheckpointSaved(
                msg_id="nm:1:0:3",
                node_manager="nm",
                batch_id=1,
                attempt=0,
                plan_key="p",
                node=2,
                step=10,
                uri="s3://ckpt/1",
                bytes=1024,
                kind="central",
            )
        )
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda o: o.pop("step"), "checkpoint_saved.step: required field missing"),
        (lambda o: o.update(step="10"), "checkpoint_saved.step: Input should be a valid integer"),
        (lambda o: o.update(step=True), "checkpoint_saved.step: Input should be a valid integer"),
        (lambda o: o.update(step=1.5), "checkpoint_saved.step: Input should be a valid integer"),
        (lambda o: o.update(step=-1), "checkpoint_saved.step: Input should be greater than or equal to 0"),
        (lambda o: o.update(kind="cold"), "checkpoint_saved.kind: Input should be 'central' or 'peripheral'"),
        (lambda o: o.update(uri=""), "checkpoint_saved.uri: String should have at least 1 character"),
        (lambda o: o.update(msg_id=None), "checkpoint_saved.msg_id: Input should be a valid string"),
        (lambda o: o.update(extra=1), "checkpoint_saved.extra: unknown field"),
        (lambda o: o.update(type="checkpoint_deleted"), "unknown type 'checkpoint_deleted'"),
        (lambda o: o.pop("type"), "unknown type None"),
        (lambda o: o.pop("v"), 'missing the version field "v"'),
    ],
)
def test_malformed_fields_are_named(change: Any, reason: str) -> None:
    obj = _valid()
    change(obj)
    with pytest.raises(MalformedMessage) as err:
        decode(json.dumps(obj).encode())
    assert reason in err.value.reason


@pytest.mark.parametrize("version", [0, 2, "1", 1.0, None, True])
def test_other_versions_are_unsupported(version: object) -> None:
    obj = _valid()
    obj["v"] = version
    with pytest.raises(UnsupportedVersion) as err:
        decode(json.dumps(obj).encode())
    assert err.value.version == version
    assert "upgrade" in err.value.message


@pytest.mark.parametrize("data", [None, b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"{", b"[" * 100_000])
def test_non_objects_are_malformed(data: bytes | None) -> None:
    with pytest.raises(MalformedMessage):
        decode(data)


def test_the_error_tree() -> None:
    assert issubclass(UnsupportedVersion, MalformedMessage)
    assert issubclass(MalformedMessage, InvalidArgument)
    assert not MalformedMessage("x").retriable


def test_construction_validates_so_a_bad_emitter_fails_at_its_call_site() -> None:
    with pytest.raises(MalformedMessage, match=r"progress\.step: Input should be a valid integer"):
        Progress(msg_id="m", node_manager="nm", batch_id=1, attempt=0, node=0, step="3")  # type: ignore[arg-type]
    with pytest.raises(MalformedMessage, match="utilization"):
        GpuTelemetry(msg_id="m", node_manager="nm", gpu_index=0, utilization=101, memory_used=0, memory_total=0, ts=0)
    with pytest.raises(MalformedMessage, match=r"metrics\['loss'\]: Input should be a valid number"):
        Metrics(msg_id="m", node_manager="nm", batch_id=1, attempt=0, node=0, step=0, metrics={"loss": "low"})  # type: ignore[dict-item]
    with pytest.raises(MalformedMessage, match=r"gpu_telemetry\.processes"):
        GpuTelemetry(
            msg_id="m",
            node_manager="nm",
            gpu_index=0,
            utilization=1,
            memory_used=0,
            memory_total=0,
            processes=({"pid": 1, "memory": 2},),  # type: ignore[arg-type]
            ts=0,
        )


def test_encode_checks_again_because_the_metrics_dict_can_change() -> None:
    m = Metrics(msg_id="m", node_manager="nm", batch_id=1, attempt=0, node=0, step=0, metrics={"loss": 1.0})
    m.metrics["acc"] = "high"  # type: ignore[assignment]
    with pytest.raises(MalformedMessage, match="metrics"):
        encode(m)


def test_integers_are_accepted_where_numbers_are_expected_and_stored_as_floats() -> None:
    m = Metrics(msg_id="m", node_manager="nm", batch_id=1, attempt=0, node=0, step=0, metrics={"loss": 1})
    assert type(m.metrics["loss"]) is float
    t = decode(
        b'{"v":1,"type":"gpu_telemetry","msg_id":"m","node_manager":"nm","gpu_index":0,'
        b'"utilization":50,"memory_used":1,"memory_total":2,"processes":[{"pid":3,"memory":4}],"ts":7}'
    )
    assert isinstance(t, GpuTelemetry)
    assert t.utilization == 50.0 and type(t.ts) is float
    assert t.processes == (GpuProcess(pid=3, memory=4),)


def test_a_diverged_run_can_still_report_nan_and_infinite_metrics() -> None:
    m = Metrics(
        msg_id="m",
        node_manager="nm",
        batch_id=1,
        attempt=0,
        node=0,
        step=5,
        metrics={"loss": math.nan, "grad_norm": math.inf},
    )
    back = decode(encode(m))
    assert isinstance(back, Metrics)
    assert math.isnan(back.metrics["loss"]) and back.metrics["grad_norm"] == math.inf


def test_plan_key_is_optional_on_the_wire() -> None:
    obj = _valid()
    del obj["plan_key"]
    assert decode(json.dumps(obj).encode()).plan_key is None  # type: ignore[attr-defined]


def test_the_registry_has_the_twelve_kinds() -> None:
    assert sorted(MESSAGE_TYPES) == sorted(
        [
            "batch_started",
            "progress",
            "metrics",
            "curve",
            "checkpoint_saved",
            "rescaled",
            "batch_timing",
            "batch_finished",
            "batch_preempted",
            "batch_failed",
            "log_line",
            "gpu_telemetry",
        ]
    )


def test_a_checkpoint_without_ranks_was_written_by_one_and_a_rescale_must_change_the_count() -> None:
    """An older node manager's checkpoint_saved has no ranks: one rank wrote it. A rescaled message
    whose counts agree says nothing changed, which no worker emits: malformed."""
    obj = _valid()
    del obj["ranks"]
    assert decode(json.dumps(obj).encode()).ranks == 1  # type: ignore[attr-defined]
    with pytest.raises(MalformedMessage, match="both 2"):
        Rescaled(
            msg_id="m", node_manager="nm", batch_id=1, attempt=1, node=1, step=2, uri="u", from_ranks=2, to_ranks=2
        )
    with pytest.raises(MalformedMessage, match="from_ranks"):
        Rescaled(
            msg_id="m", node_manager="nm", batch_id=1, attempt=1, node=1, step=2, uri="u", from_ranks=0, to_ranks=2
        )


def test_msg_id_is_stable_and_distinct_per_sequence_number() -> None:
    assert make_msg_id("nm-1", 42, 2, 7) == "nm-1:42:2:7"
    assert make_msg_id("nm-1", 42, 2, 7) != make_msg_id("nm-1", 42, 2, 8)


# -- bundles: several messages of one key in one record -------------------------------------------------


@given(st.lists(messages, min_size=1, max_size=20), st.integers(min_value=200, max_value=5000))
def test_bundles_keep_every_message_in_order_within_the_size_limit(batch: list[Message], max_bytes: int) -> None:
    records = encode_many(batch, max_bytes)
    decoded = [m for r in records for m in decode_many(r)]
    assert decoded == batch
    for r in records:
        bundled = json.loads(r).get("type") == BUNDLE_TYPE
        assert len(r) <= max_bytes or not bundled  # only a lone message may exceed the limit


def test_a_bundle_of_one_is_the_bare_message() -> None:
    m = _metrics_msg(1)
    assert encode_many([m]) == [encode(m)]
    assert decode_many(encode(m)) == [m]


def test_a_bad_message_in_a_bundle_spoils_only_itself() -> None:
    good = [_metrics_msg(0), _metrics_msg(2)]
    obj = json.loads(encode_many([good[0], _metrics_msg(1), good[1]])[0])
    obj["messages"][1]["step"] = -1
    out = decode_many(json.dumps(obj).encode())
    assert out[0] == good[0] and out[2] == good[1]
    assert isinstance(out[1], MalformedMessage) and "step" in out[1].reason


@pytest.mark.parametrize(
    ("envelope", "error"),
    [
        ({"v": 2, "type": "bundle", "messages": []}, UnsupportedVersion),
        ({"v": 1, "type": "bundle", "messages": []}, MalformedMessage),
        ({"v": 1, "type": "bundle", "messages": {}}, MalformedMessage),
        ({"v": 1, "type": "bundle", "messages": [1], "extra": 0}, MalformedMessage),
        ({"v": 1, "type": "bundle", "messages": [{"v": 1, "type": "bundle", "messages": []}]}, MalformedMessage),
    ],
)
def test_a_bad_envelope_is_one_malformed_entry(envelope: dict[str, Any], error: type[MalformedMessage]) -> None:
    (out,) = decode_many(json.dumps(envelope).encode())
    assert isinstance(out, error)


@given(st.binary(max_size=200))
def test_decode_many_never_raises(data: bytes) -> None:
    out = decode_many(data)
    assert out and all(isinstance(x, Message | MalformedMessage) for x in out)


def _metrics_msg(step: int) -> Metrics:
    return Metrics(msg_id=f"nm:1:1:{step}", node_manager="nm", batch_id=1, attempt=1, node=0, step=step, metrics={})


def test_a_curve_needs_aligned_finite_points() -> None:
    base = {"msg_id": "m", "node_manager": "nm", "batch_id": 1, "attempt": 0, "node": 3}
    ok = Curve(**base, steps=[1, 2], values=[{"loss": 1.0}, {"loss": 0.5}])
    assert decode(encode(ok)) == ok and route(ok) == (TOPIC_METRICS, "1")
    for steps, values in (([1], []), ([], []), ([0], [{"loss": 1.0}]), ([1], [{"loss": math.nan}])):
        with pytest.raises(MalformedMessage):
            Curve(**base, steps=steps, values=values)


def test_a_log_line_is_bounded_in_length_and_in_number_per_attempt() -> None:
    """A line over ``MAX_LINE_CHARS`` characters, or a ``seq`` at or past ``MAX_LINES``, is malformed: the
    message itself bounds what an attempt can store."""
    fields: dict[str, Any] = dict(msg_id="m", node_manager="nm", batch_id=1, attempt=1, node=1, step=2, at=1.0)
    assert LogLine(**fields, seq=MAX_LINES - 1, line="x" * MAX_LINE_CHARS).line == "x" * MAX_LINE_CHARS
    with pytest.raises(MalformedMessage, match=r"log_line\.line"):
        LogLine(**fields, seq=0, line="x" * (MAX_LINE_CHARS + 1))
    with pytest.raises(MalformedMessage, match=r"log_line\.seq"):
        LogLine(**fields, seq=MAX_LINES, line="x")
