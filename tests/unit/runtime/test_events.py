"""The event wire form: the per-step fast path writes exactly what ``json.dumps`` writes."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from stagetree.nodemanager.runtime.events import decode_event, encode_event

ints = st.integers(min_value=-(2**63), max_value=2**63)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)


@given(batch=ints, attempt=ints, node=ints, step=ints, ts=times)
def test_fast_path_is_byte_identical_to_json(batch: int, attempt: int, node: int, step: int, ts: float) -> None:
    cases = {
        "progress": {"batch_id": batch, "attempt": attempt, "node": node, "step": step},
        "batch_started": {"batch_id": batch, "attempt": attempt},
        "batch_finished": {"batch_id": batch, "attempt": attempt, "steps": step},
    }
    for kind, payload in cases.items():
        line = encode_event(kind, payload, ts)
        assert line == json.dumps({"kind": kind, "ts": ts, "payload": payload}) + "\n"
        assert decode_event(line) == (kind, ts, payload)


def test_other_payloads_take_the_json_path() -> None:
    payload = {
        "batch_id": 1,
        "attempt": 1,
        "error": 'a "quoted"\nerror',
        "traceback": "",
        "oom": True,
        "user_error": False,
        "host_problem": False,
    }
    line = encode_event("batch_failed", payload, 2.0)
    assert decode_event(line) == ("batch_failed", 2.0, payload)
    assert encode_event("progress", {"batch_id": True, "attempt": 1, "node": 1, "step": 1}, 1.0).count("true") == 1
