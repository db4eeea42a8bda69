"""The researcher's loop against a live master (Postgres, gRPC and REST, a no-op node manager): trial
labels, loading by name, stats, deleting a study, forgetting a plan, code versions, owner scopes."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest

import stagetree
from stagetree.client import cli
from stagetree.core import errors as e
from stagetree.core.sequences import Constant, MultiStep
from tests.integration.client.conftest import TOKENS
from tests.integration.client.harness import CHECKPOINT_BYTES, Platform

ALICE, BOB = TOKENS["alice"], TOKENS["bob"]
CONFIGS = [{"lr": MultiStep(0.1, [5], g)} for g in (0.1, 0.5, 2.0)]


def _name() -> str:
    return f"s-{uuid.uuid4().hex[:10]}"


def rest(p: Platform, method: str, path: str, token: str = ALICE, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{p.http_url}/api/v1{path}", data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


async def _labelled_study(client: stagetree.Client, trainer: str, **kw: Any) -> stagetree.Study:
    study = await stagetree.Study.create(client, _name(), trainer=trainer, tuned=["lr"], **kw)
    await asyncio.gather(*(study.eval(c, 10, label=f"trial-{i}") for i, c in enumerate(CONFIGS)))
    await study.eval(CONFIGS[0], 5, label="trial-0")  # a second eval of trial 0, earlier on its path
    return study


async def test_labels_loading_by_name_best_and_stats(http_platform: Platform) -> None:
    p = http_platform
    trainer = f"pkg.train:Net{uuid.uuid4().hex[:6]}"
    async with stagetree.connect(p.grpc_target, token=ALICE) as client:
        study = await _labelled_study(client, trainer)
        stats = await study.stats()
    # [0, 5) once, then three branches of 5 steps; trial by trial: 3 trials to step 10
    assert (stats.steps_executed, stats.unique_steps, stats.trial_by_trial_steps) == (20, 20, 30)
    assert stats.merge_rate == pytest.approx(1.5) and stats.saved_steps == 10
    assert stats.requests == {"DONE": 4} and stats.compute_seconds >= 0

    status, reqs = rest(p, "GET", f"/studies/{study.id}/requests")
    assert status == 200 and sorted(r["label"] for r in reqs) == ["trial-0", "trial-0", "trial-1", "trial-2"]
    status, rest_stats = rest(p, "GET", f"/studies/{study.id}/stats")
    assert status == 200 and rest_stats["merge_rate"] == 1.5 and rest_stats["unique_steps"] == 20
    times = ("compute_seconds", "queue_seconds", "startup_seconds", "checkpoint_seconds")
    assert {k: rest_stats[k] for k in times} == {k: round(getattr(stats, k), 3) for k in times}  # as gRPC says
    shown_stats = await asyncio.to_thread(cli.run, cli._parser().parse_args(["study", "stats", study.id]), _rest(p))
    assert "queued" in shown_stats[1] and "checkpoint I/O" in shown_stats[1]
    shown = await asyncio.to_thread(cli.run, cli._parser().parse_args(["study", "show", study.id]), _rest(p))
    assert sorted((t["label"], t["evals"], t["last_step"]) for t in shown[0]["trials"]) == [
        ("trial-0", 2, 10),
        ("trial-1", 1, 10),
        ("trial-2", 1, 10),
    ]
    assert "TRIAL" in shown[1] and "trial-2" in shown[1]

    async with stagetree.connect(p.grpc_target, token=ALICE) as other:  # a new process, as it were
        loaded = await stagetree.Study.load(other, study.name)
        assert loaded.id == study.id
        best = await loaded.best("acc")  # over every request of the study, not only this object's
        assert best is not None and best.label.startswith("trial-") and best.config is not None
        again = await stagetree.Study.create(other, study.name, trainer=trainer, tuned=["lr"], load_if_exists=True)
        assert again.id == study.id
        with pytest.raises(e.AlreadyExists):
            await stagetree.Study.create(other, study.name, trainer=trainer, tuned=["lr"])
    async with stagetree.connect(p.grpc_target, token=BOB) as bob:
        with pytest.raises(e.NotFound):
            await stagetree.Study.load(bob, study.name)  # alice's study, by name, is not bob's
        with pytest.raises(e.NotFound):
            await stagetree.Study.load(bob, study.id)


async def test_deleting_a_study_keeps_its_plan_and_forgetting_the_plan_retrains(http_platform: Platform) -> None:
    p = http_platform
    nm = p.node_manager
    trainer = f"pkg.train:Net{uuid.uuid4().hex[:6]}"
    async with stagetree.connect(p.grpc_target, token=ALICE) as client:
        first = await _labelled_study(client, trainer)
        nm.pause()  # keep one request live: forgetting its plan is refused while it is
        hold = first.submit({"lr": Constant(0.3)}, 10)
        while hold.request_id is None:
            await asyncio.sleep(0.01)
        status, refused = rest(p, "POST", f"/studies/{first.id}/plan/forget")
        assert status == 412 and "live request" in refused["message"]
        nm.resume()
        await hold
        second = await stagetree.Study.create(client, _name(), trainer=trainer, tuned=["lr"])

        # delete the first study: its requests go, its plan stays and still answers the owner
        status, deleted = rest(p, "DELETE", f"/studies/{first.id}")
        assert status == 200 and deleted["requests_deleted"] == 5 and deleted["plans"].startswith("kept")
        assert rest(p, "GET", f"/studies/{first.id}")[0] == 404
        before = len(nm.batches)
        assert await second.eval(CONFIGS[1], 10) and len(nm.batches) == before  # answered from stored metrics

        ckpt_points = sum(len(b.saves) for b in nm.batches if b.fixed.trainer == trainer)
        out = await second.forget_plan()
        assert out["bytes_freed"] == out["checkpoints"] * CHECKPOINT_BYTES and out["checkpoints"] >= 1
        assert out["checkpoints"] <= ckpt_points and out["metrics"] >= 4 and out["requests"] == 1
        assert await second.metrics(CONFIGS[1], 10) is None
        await second.eval(CONFIGS[1], 10)
        (retrained,) = nm.batches[before:]
        assert retrained.source.uri is None and retrained.steps == 10  # nothing left to start from


async def test_a_new_code_version_is_a_new_plan(http_platform: Platform) -> None:
    p = http_platform
    nm = p.node_manager
    trainer = f"pkg.train:Net{uuid.uuid4().hex[:6]}"
    async with stagetree.connect(p.grpc_target, token=ALICE) as client:
        v1 = await stagetree.Study.create(client, _name(), trainer=trainer, tuned=["lr"], code_version="v1")
        await v1.eval(CONFIGS[0], 10)
        same = await stagetree.Study.create(client, _name(), trainer=trainer, tuned=["lr"], code_version="v1")
        before = len(nm.batches)
        assert await same.eval(CONFIGS[0], 10) and len(nm.batches) == before
        v2 = await stagetree.Study.create(client, _name(), trainer=trainer, tuned=["lr"], code_version="v2")
        assert await v2.metrics(CONFIGS[0], 10) is None
        await v2.eval(CONFIGS[0], 10)
        assert len(nm.batches) == before + 1 and nm.batches[-1].fixed.code_version == "v2"
        assert (await v2.plan())["key"] != (await v1.plan())["key"]


async def test_bad_labels_and_versions_are_refused_and_write_nothing(http_platform: Platform) -> None:
    p = http_platform
    async with stagetree.connect(p.grpc_target, token=ALICE) as client:
        study = await stagetree.Study.create(client, _name(), trainer="pkg.t:N", tuned=["lr"])
        with pytest.raises(e.InvalidArgument, match="label"):
            study.submit(CONFIGS[0], 10, label="x" * 129)
        with pytest.raises(e.InvalidArgument, match="code_version"):
            await stagetree.Study.create(client, _name(), trainer="pkg.t:N", tuned=["lr"], code_version="v" * 200)
    item = {"client_request_id": "a", "config": {"tuned": {"lr": 0.1}}, "step": 3, "label": "y" * 200}
    status, body = rest(p, "POST", f"/studies/{study.id}/requests", body={"items": [item]})
    assert status == 422
    assert rest(p, "GET", f"/studies/{study.id}/requests") == (200, [])
    fixed = {"trainer": "pkg.t:N", "code_version": 7}
    status, body = rest(p, "POST", "/studies", body={"name": _name(), "fixed": fixed})
    assert status == 422 and "code_version" in body["message"]


def _rest(p: Platform) -> cli.RestClient:
    return cli.RestClient(p.http_url or "", ALICE)
