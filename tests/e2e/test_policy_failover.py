"""The studies' policy state across a master crash, on the process cluster with real training: a Hermes
study and a POP study run, the master is killed with SIGKILL mid-study and started again, and the new
master goes on from the state the old one saved (``policy_states``): every Hermes job keeps the quanta
it had (new ones come on top), POP keeps its curves, its clock and its kills, kills a trial submitted after
the restart, and no trial is killed twice."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from stagetree.client.sdk import Client, EvalCancelled, Study
from stagetree.cluster import ProcessCluster
from stagetree.nodemanager.examples.faults import ENTRY_POINT
from tests.e2e.helpers import diagnostics, plan_of, query, requests, wait_for

pytestmark = pytest.mark.slow

HERMES = {"time_share": "hermes", "time_share_params": {"quantum_s": 1.0, "growth": 1.0, "eval_every": 5}}
POP = {
    "search": "pop",
    "search_params": {
        "metric": "accuracy",
        "target": 0.5,
        "kill_threshold": 0.3,  # an untrained net is at ~0.1
        "report_every": 5,
        "eval_every": 2,  # a boundary every 10 steps
        "t_max_s": 600,
    },
}
POOR_LR = 1e-6
KILL_LINE = re.compile(r"trial (\S+) killed by its study's search policy")


@pytest.fixture(autouse=True)
def restored(cluster: ProcessCluster) -> Iterator[None]:
    yield
    if not cluster.alive("master"):
        cluster.restart("master")


async def _study(client: Client, name: str, policies: dict[str, Any]) -> Study:
    tag = f"{name}-{uuid.uuid4().hex[:6]}"
    return await Study.create(
        client,
        tag,
        trainer=ENTRY_POINT,
        dataset="sklearn-digits",
        values={"tag": tag, "sleep_s": 0.1},
        tuned=["lr"],
        policies=policies,
    )


def saved(cluster: ProcessCluster, study: Study) -> tuple[dict[str, Any], float] | None:
    rows = query(cluster, "SELECT state, updated_at FROM policy_states WHERE study_id = :s", s=study.id)
    return (rows[0][0], float(rows[0][1])) if rows else None


def _quanta(state: dict[str, Any]) -> dict[str, list[Any]]:
    return {j: d["quanta"] for j, d in state["hermes"]["jobs"].items()}


async def test_a_restarted_master_goes_on_from_the_saved_policy_state(cluster: ProcessCluster, client: Client) -> None:
    pop_study = await _study(client, "pop-failover", POP)
    hermes_study = await _study(client, "hermes-failover", HERMES)
    pop_evals = [asyncio.ensure_future(pop_study.eval({"lr": lr}, 40)) for lr in (POOR_LR, 0.2)]
    await wait_for(lambda: (got := saved(cluster, pop_study)) and got[0]["killed"], 60, "a POP kill saved")
    # then Hermes' trials, and the crash soon after their first quantum: most of their work is left
    hermes_evals = [asyncio.ensure_future(hermes_study.eval({"lr": lr}, 50)) for lr in (0.02, 0.05, 0.1)]

    def both_learnt() -> tuple[dict[str, Any], dict[str, Any]] | None:
        h, p = saved(cluster, hermes_study), saved(cluster, pop_study)
        return (h[0], p[0]) if h is not None and p is not None and any(_quanta(h[0]).values()) else None

    before_h, before_p = await wait_for(both_learnt, 60, "a Hermes quantum saved")
    killed_at = cluster.kill("master")
    await asyncio.sleep(1.0)
    await asyncio.to_thread(cluster.restart, "master")
    late_poor = asyncio.ensure_future(pop_study.eval({"lr": POOR_LR / 2}, 40))  # for the new master to kill

    seen: list[dict[str, Any]] = []  # Hermes states the new master saved (a job is dropped once it is done)
    evals = asyncio.gather(*hermes_evals, *pop_evals, late_poor, return_exceptions=True)
    while not evals.done():
        got = await asyncio.to_thread(saved, cluster, hermes_study)
        if got is not None and got[1] > killed_at and (not seen or got[0] != seen[-1]):
            seen.append(got[0])
        await asyncio.sleep(0.25)
    results = await asyncio.wait_for(evals, 120)
    after_p = saved(cluster, pop_study)
    assert after_p is not None
    log_now = cluster.log("master", since_start=True)
    assert log_now.count("policy state restored") >= 2, diagnostics(cluster, "master")

    # Hermes: every job the new master kept has the quanta the old one measured, and more came on top
    for cfg_result in results[:3]:
        assert isinstance(cfg_result, dict), cfg_result  # every Hermes trial ran to its end
    assert seen, diagnostics(cluster, "master")
    grew = False
    for state in seen:
        for job, quanta in _quanta(state).items():
            old = _quanta(before_h).get(job, [])
            assert quanta[: len(old)] == old, (job, old, quanta)  # not restarted from zero
            grew |= bool(old) and len(quanta) > len(old)
    assert grew, (before_h, seen)

    # POP: its clock, curves and kills go on; the trial submitted after the restart is killed by the new master
    state = after_p[0]
    assert state["search"]["started"] == before_p["search"]["started"]
    for job, d in before_p["search"]["policy"]["jobs"].items():
        after_epochs = state["search"]["policy"]["jobs"][job]["hist"]["epochs"]
        assert after_epochs[: len(d["hist"]["epochs"])] == d["hist"]["epochs"], job
    assert set(before_p["killed"]) < set(state["killed"]) and state["pending"]["kills"] == []
    assert isinstance(results[3], EvalCancelled) and isinstance(results[5], EvalCancelled), results
    plan = plan_of(cluster, pop_study)
    kills = Counter(j for j in KILL_LINE.findall(cluster.log("master")) if j.startswith(f"{plan}:"))
    assert set(kills) == set(state["killed"]) and set(kills.values()) == {1}, kills  # none killed twice
    assert any(j not in before_p["killed"] for j in KILL_LINE.findall(log_now)), "the new master killed none"
    poor = [r for r in requests(cluster, pop_study) if r.state == "CANCELLED"]
    assert len(poor) >= 2 and all("poor trial" in (r.error or "") for r in poor), poor
