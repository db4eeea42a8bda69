"""The SDK against an in-memory master: batching of concurrent evals, retries, error mapping, validation,
cancellation and the results stream."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import grpc
import pytest

from stagetree.client.sdk import (
    EvalCancelled,
    EvalFailed,
    Study,
    error_of,
    parse_target,
)
from stagetree.core import errors as e
from stagetree.core.config import Config
from stagetree.core.sequences import Constant, MultiStep
from stagetree.status import TABLE, error_class_of
from tests.unit.client.fakes import FakeMaster, FakeRpcError, fake_client


async def _study(master: FakeMaster, **kwargs: object) -> Study:
    client = fake_client(master, **kwargs)  # type: ignore[arg-type]
    return await Study.create(client, "s", trainer="pkg.mod:Net", dataset="d", tuned=["lr"])


# -- error mapping ---------------------------------------------------------------------------------


def test_the_one_status_table_reads_both_ways() -> None:
    for cls, st in TABLE.items():
        if cls is e.StagetreeError:
            continue
        assert error_class_of(st.grpc) is cls, cls
    assert error_class_of(grpc.StatusCode.DEADLINE_EXCEEDED) is e.Unavailable
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS):
        cls = error_class_of(code)  # a bug: never mistaken for something a retry fixes
        assert cls is e.StagetreeError and not cls.retriable


@pytest.mark.parametrize(
    ("code", "cls", "retriable"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, e.InvalidArgument, False),
        (grpc.StatusCode.NOT_FOUND, e.NotFound, False),
        (grpc.StatusCode.ABORTED, e.Conflict, True),
        (grpc.StatusCode.UNAVAILABLE, e.Unavailable, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, e.ResourceExhausted, False),
    ],
)
def test_error_of_maps_status_codes_back_to_the_error_tree(
    code: grpc.StatusCode, cls: type[e.StagetreeError], retriable: bool
) -> None:
    err = error_of(FakeRpcError(code, "what happened; do this"), "GetStudy", "host:1")
    assert type(err) is cls and err.retriable is retriable
    assert err.message.startswith("GetStudy: what happened; do this")


def test_error_messages_say_what_to_do() -> None:
    unauth = error_of(FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token"), "ListStudies", "h:1")
    assert isinstance(unauth, e.Unauthenticated) and "token=" in unauth.message and "STAGETREE_TOKEN" in unauth.message
    down = error_of(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect"), "GetStudy", "h:1")
    assert "h:1" in down.message and "running" in down.message
    internal = error_of(FakeRpcError(grpc.StatusCode.INTERNAL, "boom"), "GetPlan", "h:1")
    assert type(internal) is e.StagetreeError and "master's log" in internal.message


def test_parse_target() -> None:
    assert parse_target("grpc://127.0.0.1:50051/") == "127.0.0.1:50051"
    assert parse_target("localhost:9") == "localhost:9"
    with pytest.raises(e.InvalidArgument, match="HTTP URL"):
        parse_target("http://127.0.0.1:8080")
    with pytest.raises(e.InvalidArgument, match="no port"):
        parse_target("localhost")


# -- batching --------------------------------------------------------------------------------------


async def test_concurrent_evals_go_out_in_one_submit_and_one_stream() -> None:
    master = FakeMaster()
    study = await _study(master)
    before = study.client.rpc_count
    configs = [{"lr": MultiStep(0.001 * (i + 1), [5], 0.5)} for i in range(500)]
    results = await asyncio.gather(*(study.eval(c, 10) for c in configs))
    assert study.client.rpc_count - before == 2
    assert study.client.rpcs["SubmitRequests"] == 1 and study.client.rpcs["StreamResults"] == 1
    (req,) = master.calls["SubmitRequests"]
    assert len(req.items) == 500 and len({it.client_request_id for it in req.items}) == 500
    for c, r in zip(configs, results, strict=True):  # each caller gets its own eval's metrics
        assert r == master.metrics_of(Config.of(c), 10)


async def test_batches_are_cut_at_max_batch() -> None:
    master = FakeMaster()
    study = await _study(master, max_batch=100)
    await asyncio.gather(*(study.eval({"lr": 0.001 * i + 0.001}, 5) for i in range(250)))
    assert [len(r.items) for r in master.calls["SubmitRequests"]] == [100, 100, 50]


async def test_a_smaller_server_limit_is_learned_and_the_batch_resent() -> None:
    master = FakeMaster()
    master.max_items = 40
    study = await _study(master)
    results = await asyncio.gather(*(study.eval({"lr": 0.001 * i + 0.001}, 5) for i in range(100)))
    assert len(results) == 100 and study.client.max_batch == 40
    sizes = [len(r.items) for r in master.calls["SubmitRequests"]]
    assert sizes[0] == 100 and sorted(sizes[1:]) == [20, 40, 40]


async def test_retry_after_unavailable_resends_the_same_client_ids() -> None:
    master = FakeMaster()
    master.errors["SubmitRequests"].append(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection reset"))
    study = await _study(master)
    assert await study.eval({"lr": 0.03}, 3) == master.metrics_of(Config.of({"lr": 0.03}), 3)
    first, second = master.calls["SubmitRequests"]
    assert [i.client_request_id for i in first.items] == [i.client_request_id for i in second.items]


async def test_one_invalid_item_fails_alone() -> None:
    master = FakeMaster()
    study = await _study(master)
    handles = [study.submit({"lr": 0.01 * (i + 1)}, 4) for i in range(5)]
    master.bad_items.add(handles[2].client_request_id)
    outcomes = await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
    assert isinstance(outcomes[2], e.InvalidArgument) and "rejected by the fake" in outcomes[2].message
    assert all(not isinstance(o, BaseException) for i, o in enumerate(outcomes) if i != 2)


async def test_a_non_retriable_error_fails_every_eval_of_the_batch() -> None:
    master = FakeMaster()
    study = await _study(master)
    master.errors["SubmitRequests"].append(FakeRpcError(grpc.StatusCode.NOT_FOUND, "study 'x' does not exist"))
    outcomes = await asyncio.gather(*(study.eval({"lr": 0.1 * (i + 1)}, 1) for i in range(3)), return_exceptions=True)
    assert all(isinstance(o, e.NotFound) for o in outcomes)


# -- validation ------------------------------------------------------------------------------------


async def test_bad_configs_fail_before_any_rpc() -> None:
    master = FakeMaster()
    study = await _study(master)
    n = study.client.rpc_count
    with pytest.raises(e.SequenceError, match="lr"):
        study.submit({"lr": {"kind": "multistep", "init": 0.1, "milestones": [0], "gamma": 0.1}}, 5)
    with pytest.raises(e.InvalidArgument, match="missing"):
        study.submit({"momentum": 0.9}, 5)
    with pytest.raises(e.InvalidArgument, match="step"):
        study.submit({"lr": 0.1}, -1)
    with pytest.raises(e.InvalidArgument):
        study.submit({}, 5)
    await asyncio.sleep(0.01)
    assert study.client.rpc_count == n


async def test_create_validates_the_fixed_part_and_tuned_names() -> None:
    client = fake_client(FakeMaster())
    with pytest.raises(e.InvalidArgument, match="trainer"):
        await Study.create(client, "s", trainer="", tuned=["lr"])
    with pytest.raises(e.InvalidArgument, match="tuned"):
        await Study.create(client, "s", trainer="m:T", tuned="lr")
    with pytest.raises(e.InvalidArgument, match="both fixed"):
        await Study.create(client, "s", trainer="m:T", values={"lr": 0.1}, tuned=["lr"])
    assert client.rpc_count == 0


async def test_loaded_study_without_tuned_names_accepts_any_names() -> None:
    master = FakeMaster()
    client = fake_client(master)
    study = await Study.load(client, "abc")
    assert study.fixed is not None and study.fixed.trainer == "m:T"
    assert (await study.eval({"lr": 0.03, "bs": 32}, 2))["acc"] > 0
    sent = json.loads(master.calls["SubmitRequests"][0].items[0].config_json)
    assert sent == {"tuned": {"bs": {"kind": "constant", "value": 32}, "lr": {"kind": "constant", "value": 0.03}}}


# -- outcomes --------------------------------------------------------------------------------------


async def test_failed_and_immediately_done_requests() -> None:
    master = FakeMaster()
    study = await _study(master)
    ok, bad = study.submit({"lr": 0.03}, 5), study.submit({"lr": 0.5}, 5)
    master.failing.add(bad.client_request_id)
    assert (await ok)["acc"] > 0
    with pytest.raises(EvalFailed, match="boom"):
        await bad
    cached = study.submit({"lr": 0.02}, 5)
    master.done_now.add(cached.client_request_id)
    n = study.client.rpcs["StreamResults"]
    assert (await cached)["acc"] > 0
    assert study.client.rpcs["StreamResults"] == n  # answered by the submit itself


async def test_cancel_before_and_after_sending() -> None:
    master = FakeMaster()
    master.hold = True
    study = await _study(master)
    early = study.submit({"lr": 0.1}, 5)
    assert await study.cancel(early) is None
    with pytest.raises(EvalCancelled):
        await early
    late = study.submit({"lr": 0.2}, 5)
    while late.request_id is None:
        await asyncio.sleep(0.001)
    res = await study.cancel(late)
    assert res is not None and res.state == "CANCELLED"
    with pytest.raises(EvalCancelled):
        await late
    assert all(len(r.items) == 1 for r in master.calls["SubmitRequests"])  # the early one never went out


async def test_cancelling_the_awaiting_task_cancels_the_request() -> None:
    master = FakeMaster()
    master.hold = True
    study = await _study(master)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(study.eval({"lr": 0.1}, 5), 0.05)
    for _ in range(100):
        if master.calls["CancelRequest"]:
            break
        await asyncio.sleep(0.005)
    (cancel,) = master.calls["CancelRequest"]
    assert cancel.study_id == study.id


async def test_results_stream_and_best() -> None:
    master = FakeMaster()
    study = await _study(master)
    seen = []

    async def listen() -> None:
        async for r in study.results():
            seen.append(r)
            if len(seen) == 4:
                return

    listener = asyncio.create_task(listen())
    await asyncio.sleep(0)
    lrs = [0.001, 0.03, 0.1, 0.3]
    await asyncio.gather(*(study.eval({"lr": lr}, 20) for lr in lrs))
    await asyncio.wait_for(listener, 1)
    assert sorted(r.step for r in seen) == [20] * 4 and {r.state for r in seen} == {"DONE"}
    best = await study.best("acc", "max")
    assert best is not None and best.config == {"lr": Constant(0.03)}
    worst = await study.best("acc", "min")
    assert worst is not None and worst.config == {"lr": Constant(0.3)}
    assert await study.best("nope") is None
    replay = study.results(replay=True)
    assert [(await anext(replay)).request_id for _ in range(4)] == [r.request_id for r in seen]
    await replay.aclose()


async def test_closing_the_client_fails_outstanding_evals() -> None:
    master = FakeMaster()
    master.hold = True
    study = await _study(master)
    pending = study.submit({"lr": 0.1}, 5)
    while pending.request_id is None:
        await asyncio.sleep(0.001)
    await study.client.close()
    with pytest.raises(e.Unavailable, match="closed"):
        await pending
    with pytest.raises(e.FailedPrecondition, match="closed"):
        study.submit({"lr": 0.1}, 5)


async def test_one_result_stream_per_study_widened_for_new_batches() -> None:
    master = FakeMaster()
    master.hold = True
    study = await _study(master)
    first = [study.submit({"lr": 0.01 * (i + 1)}, 5) for i in range(3)]
    while master.calls["StreamResults"] == []:
        await asyncio.sleep(0.001)
    second = [study.submit({"lr": 0.1 * (i + 1)}, 5) for i in range(2)]
    while len(master.calls["StreamResults"]) < 2:
        await asyncio.sleep(0.001)
    one, two = master.calls["StreamResults"]
    assert len(one.request_ids) == 3 and sorted(two.request_ids) == sorted(e.request_id for e in first + second)
    master.hold = False
    master.finish()
    results = await asyncio.gather(*first, *second)
    assert len(results) == 5 and study.client.rpcs["StreamResults"] == 2


async def test_create_checks_the_trainer_entry_point_before_any_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    master = FakeMaster()
    client = fake_client(master)
    (tmp_path / "firsthour_trainer.py").write_text("class Net:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(e.InvalidArgument, match=re.escape("did you mean 'firsthour_trainer:Net'")):
        await Study.create(client, "s", trainer="firsthour_trainer.Net", tuned=["lr"])
    with pytest.raises(e.InvalidArgument, match=re.escape("defines no 'Missing'; the classes it defines: Net")):
        await Study.create(client, "s", trainer="firsthour_trainer:Missing", tuned=["lr"])
    with pytest.raises(e.InvalidArgument, match="__main__"):
        await Study.create(client, "s", trainer="__main__:Local", tuned=["lr"])
    assert not master.calls["CreateStudy"]
    study = await Study.create(client, "s", trainer="firsthour_trainer:Net", tuned=["lr"])
    assert study.code_version.startswith("src-")


async def test_a_study_loaded_by_other_code_trains_on_that_code_s_plan(caplog: pytest.LogCaptureFixture) -> None:
    master = FakeMaster()
    master.errors["CreateStudy"].append(FakeRpcError(grpc.StatusCode.ALREADY_EXISTS, "study 's' exists"))
    client = fake_client(master)
    study = await Study.create(client, "s", trainer="m:T", code_version="v2", tuned=["lr"], load_if_exists=True)
    assert study.code_version == "v2" and study.info.fixed is not None and study.info.fixed.code_version == ""
    assert "new plan for the new code" in caplog.text
    await study.eval({"lr": 0.1}, 3)
    sent = json.loads(master.calls["SubmitRequests"][-1].items[0].config_json)
    assert sent["fixed"]["code_version"] == "v2" and sent["fixed"]["trainer"] == "m:T"  # the new code's plan
    same = await Study.create(client, "s", trainer="m:T", code_version="", tuned=["lr"], load_if_exists=True)
    assert same.fixed == same.info.fixed  # the study's own version: its own plan, no fixed part sent
