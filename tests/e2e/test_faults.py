"""Fault tolerance on the process cluster, each fault with real training of the digits MLP: a node
manager, an aggregator or the master killed with SIGKILL mid-study, a node manager joining mid-study,
and a worker that keeps failing with a user error."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest

from stagetree.client.sdk import Client, EvalFailed
from stagetree.cluster import ProcessCluster
from tests.e2e.helpers import (
    LRS,
    BatchRow,
    batches,
    checkpoint_steps,
    diagnostics,
    new_study,
    plan_of,
    plan_or_none,
    query,
    requests,
    study_batches,
    wait_for,
)

pytestmark = pytest.mark.slow

STUDY_TIMEOUT_S = 120


@pytest.fixture(autouse=True)
def restored(cluster: ProcessCluster) -> Iterator[None]:
    """Whatever a test killed runs again before the next test (they share the cluster)."""
    yield
    for name in list(cluster.services):
        if not cluster.alive(name):
            cluster.restart(name)


def _all_done(cluster: ProcessCluster, study: object, n: int) -> None:
    rows = requests(cluster, study)  # type: ignore[arg-type]
    assert len(rows) == n, rows
    assert {r.state for r in rows} == {"DONE"}, rows


async def test_node_manager_killed_mid_batch_work_restarts_elsewhere_from_its_latest_checkpoint(
    cluster: ProcessCluster, client: Client
) -> None:
    study = await new_study(client, "nm-kill", sleep_s=0.15)
    evals = [asyncio.ensure_future(study.eval({"lr": lr}, 40)) for lr in LRS[:4]]
    victim = cluster.node_manager_id("nm-1")

    def running_with_checkpoint() -> object:
        for b in study_batches(cluster, study):
            steps = checkpoint_steps(cluster, b.nodes) if b.state == "RUNNING" and b.node_manager_id == victim else []
            if steps and max(steps) <= 25:  # well before its end (the kill must find work left to do)
                return b
        return None

    lost = await wait_for(running_with_checkpoint, 60, "a batch on nm-1 with a peripheral checkpoint")
    saved = max(checkpoint_steps(cluster, lost.nodes))
    killed_at = cluster.kill("nm-1")

    results = await asyncio.wait_for(asyncio.gather(*evals), STUDY_TIMEOUT_S)
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in results)
    _all_done(cluster, study, 4)
    after = batches(cluster, plan_of(cluster, study))
    assert next(b for b in after if b.id == lost.id).state == "LOST"
    again = [b for b in after if b.created_at > killed_at and b.nodes & lost.nodes]
    assert again, (killed_at, lost, after)  # the work the kill cut short ran again
    assert again[0].node_manager_id != victim  # elsewhere: nm-1 is still down
    assert again[0].source_step >= saved > 0  # from the latest checkpoint, not from scratch


async def test_node_manager_restarted_at_once_gets_its_lost_work_requeued(
    cluster: ProcessCluster, client: Client
) -> None:
    """Back before its heartbeat lapsed, the new process registers under the same id: the master must
    not wait for a batch the old process ran (it would wait forever)."""
    study = await new_study(client, "nm-restart", sleep_s=0.15)
    evals = [asyncio.ensure_future(study.eval({"lr": lr}, 25)) for lr in LRS[:2]]
    victim = cluster.node_manager_id("nm-1")

    def running_on_victim() -> object:
        running = [b for b in study_batches(cluster, study) if b.state == "RUNNING"]
        return next((b for b in running if b.node_manager_id == victim), None)

    lost = await wait_for(running_on_victim, 60, "a batch running on nm-1")
    cluster.kill("nm-1")
    await asyncio.to_thread(cluster.restart, "nm-1")
    await asyncio.wait_for(asyncio.gather(*evals), STUDY_TIMEOUT_S)
    _all_done(cluster, study, 2)
    assert next(b for b in batches(cluster, plan_of(cluster, study)) if b.id == lost.id).state == "LOST"


async def test_aggregator_killed_the_other_takes_its_partitions_nothing_lost_or_applied_twice(
    cluster: ProcessCluster, client: Client
) -> None:
    study = await new_study(client, "agg-kill", sleep_s=0.05)
    evals = [asyncio.ensure_future(study.eval({"lr": lr}, step)) for lr in LRS[:4] for step in (10, 20, 30, 40)]
    before = cluster.log("aggregator-2", since_start=True).count(" owns ")
    await asyncio.wait(evals, return_when=asyncio.FIRST_COMPLETED)  # metrics are flowing
    cluster.kill("aggregator-1")

    results = await asyncio.wait_for(asyncio.gather(*evals), STUDY_TIMEOUT_S)
    assert len(results) == 16
    _all_done(cluster, study, 16)
    plan = plan_of(cluster, study)
    rows = requests(cluster, study)
    points = {(r.node_id, r.step) for r in rows}
    sql = "SELECT m.node_id, m.step FROM metrics m JOIN nodes n ON n.id = m.node_id WHERE n.plan_id = :p"
    metrics = [(n, s) for n, s in query(cluster, sql, p=plan)]
    assert set(metrics) >= points and len(metrics) == len(set(metrics))  # none lost
    # nothing applied twice: a redelivered batch end would count a failure or end a batch a second time
    assert all(r.failures == 0 for r in rows), rows
    assert {b.state for b in batches(cluster, plan)} == {"DONE"}
    assert all(e.done() and not e.exception() for e in evals)  # each eval answered, once
    # the survivor was given the dead member's partitions (the study may finish first: wait for it)
    every = 3 * cluster.config.topic_partitions

    def took_over() -> bool:
        owns = re.findall(r" owns (\d+) partitions", cluster.log("aggregator-2", since_start=True))
        return len(owns) > before and int(owns[-1]) == every

    await wait_for(took_over, 30, f"aggregator-2 owning all {every} partitions")


async def test_master_killed_and_restarted_recovers_from_postgres_and_answers_the_eval_in_flight(
    cluster: ProcessCluster, client: Client
) -> None:
    study = await new_study(client, "master-kill", sleep_s=0.1)
    evals = [asyncio.ensure_future(study.eval({"lr": lr}, 30)) for lr in LRS[:4]]
    plan = await wait_for(lambda: plan_or_none(cluster, study), 30, "the study's plan")
    await wait_for(lambda: any(b.state == "RUNNING" for b in batches(cluster, plan)), 60, "a running batch")
    registrations = {n: cluster.log(n).count("registered with the master") for n in cluster.node_manager_names()}

    cluster.kill("master")
    await asyncio.sleep(1.0)
    await asyncio.to_thread(cluster.restart, "master")

    results = await asyncio.wait_for(asyncio.gather(*evals), STUDY_TIMEOUT_S)  # answered after the restart
    assert len(results) == 4
    _all_done(cluster, study, 4)
    for name, count in registrations.items():  # every node manager came back to the new master
        assert cluster.log(name).count("registered with the master") > count, diagnostics(cluster, name)
    # the node managers kept their work: the new master waited for them rather than requeue it
    assert not [b for b in batches(cluster, plan) if b.state == "LOST"], diagnostics(cluster, "master")
    assert await asyncio.wait_for(study.eval({"lr": LRS[0]}, 30), 30) == results[0]  # same client, new master


async def test_a_restarted_master_dispatches_waiting_work_in_its_first_round_while_a_long_batch_runs(
    cluster: ProcessCluster, client: Client
) -> None:
    """A new master holds no plan in its cache while batches of them still run: its rounds must read the
    plans they need (the lookahead costs the running batch before anything else), or the slot freed while
    it was down waits for the long batch to end."""
    study = await new_study(client, "takeover", sleep_s=0.1)
    try:
        await asyncio.wait_for(study.eval({"lr": LRS[0]}, 3), STUDY_TIMEOUT_S)  # the plan's step cost is learnt
        plan = plan_of(cluster, study)
        long_eval = study.submit({"lr": LRS[1]}, 2000)  # 200 s of training at least
        medium = study.submit({"lr": LRS[2]}, 60)

        def both_running() -> dict[int, BatchRow] | None:
            running = {b.spec["stages"][-1]["end"]: b for b in batches(cluster, plan) if b.state == "RUNNING"}
            return running if {2000, 60} <= set(running) else None

        running = await wait_for(both_running, 60, "the long and the medium batch running")
        long_batch = running[2000]
        waiting = study.submit({"lr": LRS[3]}, 5)
        await wait_for(lambda: waiting.request_id is not None, 30, "the waiting eval recorded")
        cluster.kill("master")
        state = query(cluster, "SELECT state FROM requests WHERE id = :r", r=waiting.request_id)[0][0]
        assert state == "NOT_SCHED", "the medium batch ended (or was sent ahead) before the kill"
        await wait_for(
            lambda: next(b for b in batches(cluster, plan) if b.id == running[60].id).state == "DONE",
            60,
            "the medium batch done while the master is down (its slot free)",
        )
        await asyncio.to_thread(cluster.restart, "master")

        def dispatched() -> int | None:
            rows = query(cluster, "SELECT batch_id FROM requests WHERE id = :r", r=waiting.request_id)
            return int(rows[0][0]) if rows and rows[0][0] is not None else None

        await wait_for(dispatched, 60, "the waiting work dispatched", every_s=0.1)
        # each round of the new master found the free slot and the work: the first one that did not fail
        # dispatched it, and none failed
        log_now = cluster.log("master", since_start=True)
        assert "scheduling round failed" not in log_now, diagnostics(cluster, "master")
        assert next(b for b in batches(cluster, plan) if b.id == long_batch.id).state == "RUNNING"
        assert (await asyncio.wait_for(waiting.result(), STUDY_TIMEOUT_S)).state == "DONE"
        assert (await asyncio.wait_for(medium.result(), STUDY_TIMEOUT_S)).state == "DONE"
        assert not long_eval.done()
    finally:
        await study.delete()  # the long batch is aborted: the cluster is shared


async def test_node_manager_joining_mid_study_gets_work_at_once(cluster: ProcessCluster, client: Client) -> None:
    study = await new_study(client, "join", sleep_s=0.1)
    evals = [asyncio.ensure_future(study.eval({"lr": lr}, 25)) for lr in LRS[:6]]
    plan = await wait_for(lambda: plan_or_none(cluster, study), 30, "the study's plan")
    busy = {cluster.node_manager_id(n) for n in cluster.node_manager_names()}
    await wait_for(
        lambda: {b.node_manager_id for b in batches(cluster, plan) if b.state == "RUNNING"} >= busy,
        60,
        "both node managers busy",
    )
    name = await asyncio.to_thread(cluster.add_node_manager)
    newcomer = cluster.node_manager_id(name)
    try:
        first = await wait_for(
            lambda: min((b.created_at for b in batches(cluster, plan) if b.node_manager_id == newcomer), default=None),
            60,
            "work on the newcomer",
        )
        # Timed by the master's own clock, from its registration to the batch the master created for it (not
        # by this process, which a loaded machine delays in starting the newcomer and in polling): rounds
        # run every second, and the registration wakes one, so 5 s means it was passed over.
        ((registered_at,),) = query(cluster, "SELECT registered_at FROM node_managers WHERE id = :n", n=newcomer)
        assert first - registered_at < 5, "the newcomer waited for work while requests were queued"
        await asyncio.wait_for(asyncio.gather(*evals), STUDY_TIMEOUT_S)
        _all_done(cluster, study, 6)
    finally:
        await asyncio.to_thread(cluster.stop_service, name)
        del cluster.services[name]


async def test_a_user_error_fails_on_its_first_attempt_unless_the_study_retries_it(
    cluster: ProcessCluster, client: Client
) -> None:
    study = await new_study(client, "user-error", fault="raise", fault_step=2)
    with pytest.raises(EvalFailed, match="injected fault in user code") as err:
        await asyncio.wait_for(study.eval({"lr": 0.1}, 5), STUDY_TIMEOUT_S)
    assert "Traceback" in err.value.message or "File " in err.value.message
    assert "worker log: " in err.value.message  # where the whole traceback is, over the Kafka path too
    ((_, state, failures, error, _, _),) = requests(cluster, study)
    assert state == "FAILED" and failures == 1 and "ValueError" in error
    assert [b.state for b in batches(cluster, plan_of(cluster, study))] == ["FAILED"]

    retried = await new_study(client, "user-error-retried", fault="raise", fault_step=2, retry_user_errors=True)
    with pytest.raises(EvalFailed, match="injected fault in user code"):
        await asyncio.wait_for(retried.eval({"lr": 0.1}, 5), STUDY_TIMEOUT_S)
    ((_, state, failures, _, _, _),) = requests(cluster, retried)
    assert state == "FAILED" and failures == cluster.config.max_attempts
    tries = batches(cluster, plan_of(cluster, retried))
    assert [b.state for b in tries] == ["FAILED"] * cluster.config.max_attempts
