"""The SDK against a real master (Postgres; one test on SQLite) with a no-op node manager: batching,
typed errors, cancellation, results, sharing between studies, and tuners driven live."""

from __future__ import annotations

import asyncio
import uuid

import pytest

import stagetree
from stagetree.client.sdk import EvalCancelled, EvalFailed, Study
from stagetree.client.spaces import GridSearchSpace, LogUniform, RandomSearchSpace
from stagetree.client.tuners import ASHA, PBT
from stagetree.core import errors as e
from stagetree.core.config import Config
from stagetree.core.sequences import Constant, MultiStep
from tests.integration.client.conftest import TOKENS
from tests.integration.client.harness import Platform, free_port, noop_metrics
from tests.sim.asha_check import check_asha_trace

ALICE, BOB, CAROL, DAVE = TOKENS["alice"], TOKENS["bob"], TOKENS["carol"], TOKENS["dave"]


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


async def _study(client: stagetree.Client, trainer: str | None = None, tuned: tuple[str, ...] = ("lr",)) -> Study:
    return await Study.create(client, _unique("study"), trainer=trainer or _unique("pkg.train:Net"), tuned=tuned)


async def _eval_batching(p: Platform) -> None:
    async with stagetree.connect(p.grpc_target, token=ALICE) as client:
        study = await _study(client)
        configs = [{"lr": MultiStep(0.01 * (1 + i % 10), [3], 0.5)} for i in range(120)]
        steps = [2 + i // 10 for i in range(120)]
        before = client.rpc_count
        results = await asyncio.gather(*(study.eval(c, s) for c, s in zip(configs, steps, strict=True)))
        for c, s, r in zip(configs, steps, results, strict=True):
            assert r == noop_metrics(Config.of(c), s)
        # the master's limit here is 50 items: learned from the first answer, then 3 batches
        assert client.max_batch == 50
        assert client.rpcs["SubmitRequests"] == 4 and client.rpcs["StreamResults"] <= 3
        assert (client.rpc_count - before) / len(configs) <= 0.1


async def test_concurrent_evals_are_batched_postgres(platform: Platform) -> None:
    await _eval_batching(platform)


async def test_concurrent_evals_are_batched_sqlite(sqlite_platform: Platform) -> None:
    await _eval_batching(sqlite_platform)


async def test_errors_are_typed_and_say_what_to_do(platform: Platform) -> None:
    async with stagetree.connect(platform.grpc_target, token="wrong") as client:
        with pytest.raises(e.Unauthenticated, match="token="):
            await client.list_studies()
    async with stagetree.connect(platform.grpc_target, token=ALICE) as alice:
        study = await _study(alice)
        with pytest.raises(e.AlreadyExists, match="pick another name"):
            await Study.create(alice, study.name, trainer="pkg:T", tuned=["lr"])
        with pytest.raises(e.NotFound):
            await Study.load(alice, "no-such-study")
        assert study.id in {s.id for s in await alice.list_studies()}
    async with stagetree.connect(platform.grpc_target, token=BOB) as bob:
        with pytest.raises(e.NotFound):  # another owner's study is invisible
            await Study.load(bob, study.id)
    async with stagetree.connect(f"127.0.0.1:{free_port()}", token=ALICE, retries=2, timeout_s=2) as down:
        with pytest.raises(e.Unavailable, match="running"):
            await down.list_studies()


async def test_cancel_and_results(platform: Platform) -> None:
    async with stagetree.connect(platform.grpc_target, token=ALICE) as client:
        study = await _study(client)
        received: list[stagetree.EvalResult] = []

        async def listen() -> None:
            async for r in study.results():
                received.append(r)
                if len(received) == 4:
                    return

        listener = asyncio.create_task(listen())
        platform.node_manager.pause()
        held = study.submit({"lr": 0.5}, 50)
        while held.request_id is None:
            await asyncio.sleep(0.01)
        cancelled = await study.cancel(held)
        assert cancelled is not None and cancelled.state == "CANCELLED"
        with pytest.raises(EvalCancelled):
            await held
        platform.node_manager.resume()
        lrs = [0.003, 0.03, 0.3]
        metrics = await asyncio.gather(*(study.eval({"lr": lr}, 10) for lr in lrs))
        await asyncio.wait_for(listener, 10)
        assert sorted(r.state for r in received) == ["CANCELLED", "DONE", "DONE", "DONE"]
        best = await study.best("acc")
        assert best is not None and best.config == {"lr": Constant(0.03)}
        assert best.metrics == metrics[1]
        assert await study.metrics({"lr": 0.03}, 10) == metrics[1]  # stored, found without a request
        assert await study.metrics({"lr": 0.03}, 11) is None


async def test_a_team_mates_study_reuses_the_first_studies_checkpoints_and_metrics(platform: Platform) -> None:
    nm = platform.node_manager
    trainer = _unique("pkg.train:Net")
    shared, other = {"lr": MultiStep(0.1, [5], 0.5)}, {"lr": Constant(0.1)}
    async with stagetree.connect(platform.grpc_target, token=CAROL) as carol:
        first = await _study(carol, trainer)
        a = await asyncio.gather(first.eval(shared, 10), first.eval(other, 10))
    first_batches = list(nm.batches)
    assert sum(b.steps for b in first_batches if b.fixed.trainer == trainer) == 15  # [0, 5) once, then 5 + 5
    async with stagetree.connect(platform.grpc_target, token=DAVE) as dave:
        second = await _study(dave, trainer)  # carol's team mate, the same fixed part: the same search plan
        again = await second.eval(shared, 10)
        assert again == a[0]
        assert dave.rpcs["StreamResults"] == 0  # answered from stored metrics by the submit itself
        assert len(nm.batches) == len(first_batches)  # nothing trained
        branch = {"lr": MultiStep(0.1, [5], 0.2)}
        await second.eval(branch, 10)
        (new,) = nm.batches[len(first_batches) :]
        assert new.source.point.step == 5 and new.source.uri is not None  # from the first study's checkpoint
        assert new.steps == 5
        plan = await second.plan()
        roots = [n for n in plan["nodes"] if n["parent"] is None]
        assert len(roots) == 1 and len(plan["nodes"]) == 3  # the first config's path and two branches at step 5
        assert {n["start"] for n in plan["nodes"] if n["parent"] is not None} == {5}


async def test_owners_outside_a_team_share_nothing(platform: Platform) -> None:
    nm = platform.node_manager
    trainer = _unique("pkg.train:Net")
    cfg = {"lr": MultiStep(0.1, [5], 0.5)}
    async with stagetree.connect(platform.grpc_target, token=ALICE) as alice:
        first = await _study(alice, trainer)
        await first.eval(cfg, 10)
        alice_plan = await first.plan()
    before = len(nm.batches)
    async with stagetree.connect(platform.grpc_target, token=BOB) as bob:
        second = await _study(bob, trainer)  # the same fixed part, another owner: another plan
        assert await second.metrics(cfg, 10) is None  # alice's metrics are not visible
        await second.eval(cfg, 10)
        (trained,) = nm.batches[before:]
        assert trained.source.uri is None and trained.steps == 10  # from scratch: no checkpoint of alice's
        bob_plan = await second.plan()
    assert bob_plan["key"] != alice_plan["key"]
    assert all(sum(n["requests"].values()) == 1 for n in bob_plan["nodes"] if n["requests"])  # bob's request only


async def test_asha_driven_live_matches_the_reference(platform: Platform) -> None:
    async with stagetree.connect(platform.grpc_target, token=ALICE) as client:
        study = await _study(client)
        space = RandomSearchSpace({"lr": LogUniform(1e-3, 1.0)}, seed=7)
        tuner = ASHA(space, metric="acc", eta=3, min_step=1, max_step=9, max_concurrent=4, max_trials=12)
        run = await stagetree.drive(study, tuner)
        assert tuner.finished and len(run.jobs) > 12
        problems = check_asha_trace(
            run.trace, metric="acc", mode="max", eta=3, min_step=1, max_step=9, max_concurrent=4, max_trials=12
        )
        assert problems == []


async def test_pbt_exploit_is_a_branch_trained_from_the_source_checkpoint(platform: Platform) -> None:
    nm = platform.node_manager
    trainer = _unique("pkg.train:Net")
    async with stagetree.connect(platform.grpc_target, token=ALICE) as client:
        study = await _study(client, trainer)
        space = GridSearchSpace({"lr": [0.001, 0.01, 0.03, 0.3]})
        tuner = PBT(space, metric="acc", population=4, interval=5, max_step=15, seed=3)
        await stagetree.drive(study, tuner)
        assert tuner.exploits
        plan = await study.plan()
    mine = [b for b in nm.batches if b.fixed.trainer == trainer]
    nodes = {n["id"]: n for n in plan["nodes"]}
    # no step trained twice: the batches' steps add up to the steps the plan's nodes cover
    covered = sum(max([n["start"], *n["metric_steps"], *n["checkpoint_steps"]]) - n["start"] for n in nodes.values())
    assert sum(b.steps for b in mine) == covered
    exploit_steps = {step for _, _, step in tuner.exploits}
    branched = [n for n in nodes.values() if n["parent"] is not None]
    assert branched and {n["start"] for n in branched} <= exploit_steps
    for n in branched:  # each exploit continues from its source's checkpoint at the branch step
        first = min((b for b in mine if b.stages[0].node == n["id"]), key=lambda b: b.source.point.step)
        assert first.source.point.step == n["start"] and first.source.uri is not None


async def test_an_eval_whose_training_keeps_failing_raises_eval_failed(platform: Platform) -> None:
    platform.node_manager.fail_if = lambda c: "RuntimeError: loss is NaN" if c.values_at(0)["lr"] == 13.0 else None
    async with stagetree.connect(platform.grpc_target, token=ALICE) as client:
        study = await _study(client)
        good, bad = study.submit({"lr": 0.03}, 3), study.submit({"lr": 13.0}, 3)
        assert (await good)["acc"] > 0
        with pytest.raises(EvalFailed, match="loss is NaN"):
            await asyncio.wait_for(bad.result(), 30)
        assert (await study.best("acc")) is not None
