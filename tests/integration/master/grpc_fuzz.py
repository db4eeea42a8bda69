"""Hypothesis strategies for the master's gRPC request messages, and a fuzz loop over them, shared by
``test_fuzz_grpc.py`` and ``tests.bench.faults``: every unary client call (and the node managers'
registration and reports) with hostile strings (NUL, newlines, 100 kB, non-ASCII), int64 edges, NaN and
infinities, and JSON texts that are, or nearly are, trial configs. A status outside the error table
(INTERNAL, UNKNOWN, ...) is a server error: a bug, whatever the input."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagetree.proto.stagetree.v1 import master_pb2 as pb
from tests.integration.master.fuzz import FuzzReport

BUGS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED}
INT64 = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 10_000_001]),
)
DOUBLE = st.floats(allow_nan=True, allow_infinity=True)
_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)  # protobuf refuses lone surrogates
HOSTILE = st.sampled_from(["", " ", "\x00", "a\x00b", "a\nb", "\x7f", "é" * 200, "x" * 100_000, "🙂", "null"])
NUMBER = st.one_of(DOUBLE, st.integers(-(10**30), 10**30), st.sampled_from([0, -0.0, 1e308, 5e-324]))
JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBER, _TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_TEXT, inner, max_size=4)),
    max_leaves=12,
)
FAMILY = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["constant", "linear", "exponential", "step", "multistep", "cosine", "warmup", "x"]),
        "init": NUMBER,
        "value": NUMBER,
        "gamma": NUMBER,
        "slope": NUMBER,
        "step_size": INT64,
        "period": INT64,
        "milestones": st.lists(INT64, max_size=3),
        "min_value": NUMBER,
        "then": st.one_of(NUMBER, st.just({"kind": "constant", "value": 0.1})),
    }
)


def _config_text(fixed: dict[str, Any]) -> st.SearchStrategy[str]:
    tuned = st.dictionaries(st.one_of(_TEXT, HOSTILE), st.one_of(NUMBER, _TEXT, FAMILY, JSONISH), max_size=3)
    near = st.builds(lambda t, f: {"fixed": f, "tuned": t}, tuned, st.one_of(st.just(fixed), JSONISH))
    small = st.integers(1, 50)
    sane = st.one_of(
        st.floats(1e-4, 1.0),
        st.builds(lambda i, g: {"kind": "exponential", "init": i, "gamma": g}, st.floats(1e-4, 1), st.floats(0.5, 1)),
        st.builds(
            lambda i, m: {"kind": "multistep", "init": i, "milestones": m, "gamma": 0.5}, NUMBER, st.lists(small)
        ),
        st.builds(lambda p, t: {"kind": "warmup", "init": 0.0, "period": p, "then": t}, small, FAMILY),
    )
    return st.one_of(
        st.dictionaries(st.sampled_from(["lr", "bs", "m"]), sane, min_size=1).map(lambda t: json.dumps({"tuned": t})),
        near.map(lambda o: json.dumps(o, allow_nan=True)),
        JSONISH.map(lambda o: json.dumps(o, allow_nan=True)),
        _TEXT,
        HOSTILE,
    )


def calls(study: str, fixed: dict[str, Any]) -> dict[str, tuple[st.SearchStrategy[Any], bool]]:
    """RPC name -> (a strategy for its request message, whether it goes with the admin token)."""
    sid = st.one_of(st.just(study), st.just(study), _TEXT, HOSTILE)
    cfg = _config_text(fixed)
    item = st.builds(
        pb.SubmitItem,
        client_request_id=st.one_of(st.uuids().map(str), st.uuids().map(str), _TEXT, HOSTILE),
        config_json=cfg,
        step=st.one_of(st.integers(0, 100), INT64),
    )
    slot = st.builds(
        pb.Slot,
        id=st.one_of(_TEXT, HOSTILE),
        gpu_type=st.one_of(_TEXT, st.just("cpu")),
        memory_bytes=INT64,
        share=DOUBLE,
        cpu_cores=st.integers(-(2**31), 2**31 - 1),
        gpu_index=st.integers(-(2**31), 2**31 - 1),
    )
    point = st.builds(pb.MetricPoint, node=INT64, step=INT64, values=st.dictionaries(_TEXT, DOUBLE, max_size=3))
    return {
        "CreateStudy": (st.builds(pb.CreateStudyRequest, name=st.one_of(_TEXT, HOSTILE), fixed_json=cfg), False),
        "GetStudy": (st.builds(pb.GetStudyRequest, study_id=sid, name=st.one_of(_TEXT, HOSTILE)), False),
        "GetStudyStats": (st.builds(pb.GetStudyStatsRequest, study_id=sid), False),
        "SubmitRequests": (
            st.builds(pb.SubmitRequestsRequest, study_id=sid, items=st.lists(item, min_size=1, max_size=3)),
            False,
        ),
        "CancelRequest": (st.builds(pb.CancelRequestRequest, study_id=sid, request_id=INT64), False),
        "GetMetrics": (
            st.builds(pb.GetMetricsRequest, study_id=sid, config_json=cfg, step=st.one_of(st.integers(0, 100), INT64)),
            False,
        ),
        "GetPlan": (st.builds(pb.GetPlanRequest, study_id=sid, plan_key=st.one_of(_TEXT, HOSTILE)), False),
        "ForgetPlan": (st.builds(pb.ForgetPlanRequest, study_id=sid, plan_key=st.one_of(_TEXT, HOSTILE)), False),
        "ListRequests": (
            st.builds(pb.ListRequestsRequest, study_id=sid, request_ids=st.lists(INT64, max_size=4)),
            False,
        ),
        "RegisterNodeManager": (
            st.builds(
                pb.RegisterNodeManagerRequest,
                node_manager_id=st.one_of(_TEXT, HOSTILE),
                address=_TEXT,
                slots=st.lists(slot, max_size=3),
            ),
            True,
        ),
        "ReportBatch": (
            st.builds(
                pb.ReportBatchRequest,
                batch_id=INT64,
                attempt=INT64,
                ok=st.booleans(),
                metrics=st.lists(point, max_size=3),
                error=st.one_of(_TEXT, HOSTILE),
            ),
            True,
        ),
    }


Call = Callable[[str, Any, bool], grpc.StatusCode]


def fuzz_grpc(call: Call, study: str, fixed: dict[str, Any], *, examples_per_call: int = 60) -> FuzzReport:
    """Send ``examples_per_call`` generated messages to each call through ``call(method, message,
    as_admin) -> status code``; server errors are the answers with a status of ``BUGS``."""
    report = FuzzReport()
    for method, (strategy, as_admin) in calls(study, fixed).items():
        _fuzz_call(call, method, strategy, as_admin, examples_per_call, report)
    return report


def _fuzz_call(call: Call, method: str, strategy: Any, as_admin: bool, examples: int, report: FuzzReport) -> None:
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(msg=strategy)
    def run(msg: Any) -> None:
        code = call(method, msg, as_admin)
        report.requests += 1
        report.statuses[code.value[0]] += 1
        report.by_method.setdefault(method, set()).add(code.name)
        if code in BUGS:
            report.server_errors += 1
            if len(report.failures) < 20:
                report.failures.append(f"{method}({str(msg)[:300]!r}) -> {code.name}")

    run()
