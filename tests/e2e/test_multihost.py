"""Off one host: node managers in their own network namespaces, checkpoints in S3 (moto), real digits
training. A study completes and resumes across hosts with the metrics of an uninterrupted run; a host
partitioned longer than the heartbeat TTL mid-batch has its work requeued and finished elsewhere, and
what it reports for the lost attempt when its link returns is refused (fencing by attempt), so nothing
is applied twice; a partition shorter than the TTL requeues nothing; latency and loss where the kernel
has netem. Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from stagetree.client.sdk import Client, connect
from tests.e2e import netns
from tests.e2e.conftest import require_platform
from tests.e2e.helpers import (
    LRS,
    BatchRow,
    batches,
    checkpoint_steps,
    diagnostics,
    new_study,
    plan_of,
    query,
    requests,
    study_batches,
    wait_for,
)
from tests.e2e.multihost import HEARTBEAT_TTL_S, MultiHost, duplicated_metrics, lost_requests, multihost

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STUDY_TIMEOUT_S = 120
HEARTBEAT_INTERVAL_S = HEARTBEAT_TTL_S / 3  # what the master tells a registering node manager
REGISTERED = "registered with the master"


@pytest.fixture(scope="module")
def mh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiHost]:
    require_platform()
    why = netns.unavailable()
    if why:
        pytest.skip(f"cannot make network namespaces: {why}")
    with multihost(tmp_path_factory.mktemp("multihost")) as m:
        yield m


@pytest.fixture
async def client(mh: MultiHost) -> AsyncIterator[Client]:
    async with connect(mh.cluster.target, token=mh.cluster.token) as c:
        yield c


@pytest.fixture(autouse=True)
def healed(mh: MultiHost) -> Iterator[None]:
    """Every host is reachable and its node manager running before the next test."""
    yield
    for name, host in mh.hosts.items():
        mh.lab.heal(host)
        if not mh.cluster.alive(name):
            mh.cluster.restart(name, timeout_s=90)


def _running_anywhere(mh: MultiHost, study: object, max_step: int) -> object:
    return next(
        (
            b
            for n in mh.cluster.node_manager_names()
            if (b := _running_on(mh, study, mh.cluster.node_manager_id(n), max_step))
        ),
        None,
    )


def _running_on(mh: MultiHost, study: object, nm: str, max_step: int) -> object:
    """A batch of the study running on ``nm`` with a checkpoint, not yet past ``max_step``: neither its
    checkpoints nor its curve (the worker's live progress, stored sooner than a checkpoint is uploaded and
    recorded) reach beyond it."""
    for b in study_batches(mh.cluster, study):  # type: ignore[arg-type]
        if b.state == "RUNNING" and b.node_manager_id == nm:
            steps = checkpoint_steps(mh.cluster, b.nodes)
            if steps and max(steps) <= max_step and _curve_step(mh, b.nodes) <= max_step:
                return b
    return None


def _curve_step(mh: MultiHost, nodes: set[int]) -> int:
    rows = query(mh.cluster, "SELECT node_id, max(step) FROM curve_points GROUP BY node_id")
    return max((int(st) for n, st in rows if int(n) in nodes), default=0)


async def test_a_study_resumes_across_hosts_from_s3_with_the_metrics_of_a_straight_run(
    mh: MultiHost, client: Client
) -> None:
    c = mh.cluster
    study = await new_study(client, "mh-resume", sleep_s=0.1)
    evals = [asyncio.ensure_future(study.eval({"lr": lr}, 40)) for lr in LRS[:2]]
    name = c.node_manager_names()[0]
    nm = c.node_manager_id(name)
    moved = await wait_for(lambda: _running_on(mh, study, nm, 25), 90, f"a batch on {name} with a checkpoint")
    stopped_at = time.time()
    c.stop_service(name)  # a graceful stop: its workers save to s3 and exit; the other host resumes
    try:
        results = await asyncio.wait_for(asyncio.gather(*evals), STUDY_TIMEOUT_S)
    except TimeoutError:
        raise AssertionError(diagnostics(c)) from None

    def again() -> list[BatchRow]:  # its metrics answered the evals; its end can be recorded a moment later
        after = batches(c, plan_of(c, study))
        return [b for b in after if b.created_at > stopped_at and b.nodes & moved.nodes and b.state == "DONE"]  # type: ignore[attr-defined]

    resumed = await wait_for(again, 60, "the moved batch's work to end on the other host")
    assert resumed[0].node_manager_id != nm, resumed
    assert resumed[0].spec["source"]["uri"].startswith(f"s3://{mh.bucket}/"), resumed[0].spec
    assert lost_requests(c, study) == 0 and duplicated_metrics(c, plan_of(c, study)) == 0
    # the same configurations trained straight through (a study of its own: nothing shared) agree exactly
    straight = await new_study(client, "mh-straight", sleep_s=0.0)
    assert await asyncio.gather(*(straight.eval({"lr": lr}, 40) for lr in LRS[:2])) == results


async def test_a_host_partitioned_past_the_ttl_has_its_work_finished_elsewhere_and_its_late_report_refused(
    mh: MultiHost, client: Client
) -> None:
    c = mh.cluster
    study = await new_study(client, "mh-partition", sleep_s=0.12)
    # 120 steps: cut at a checkpoint <= 60, the worker is still far from its end (with 50, a batch still
    # RUNNING in the database had at times already finished, its results on their way: nothing to redo).
    # The window is wide: on a loaded machine a checkpoint is recorded seconds after the curve passed it.
    evals = [asyncio.ensure_future(study.eval({"lr": lr}, 120)) for lr in LRS[2:3]]
    cut = await wait_for(lambda: _running_anywhere(mh, study, 60), 90, "a running batch with a checkpoint", every_s=0.1)
    nm = cut.node_manager_id  # type: ignore[attr-defined]
    name = next(n for n in c.node_manager_names() if c.node_manager_id(n) == nm)
    host = mh.hosts[name]
    stale_before = mh.stale_reports()
    registered = c.log(name, since_start=True).count(REGISTERED)
    cut_at = mh.lab.partition(host)
    cut_step = _curve_step(mh, cut.nodes)  # type: ignore[attr-defined]
    await wait_for(
        lambda: next(b for b in batches(c, plan_of(c, study)) if b.id == cut.id).state == "LOST",  # type: ignore[attr-defined]
        HEARTBEAT_TTL_S * 4,
        "the partitioned host's batch to be declared lost",
    )

    try:  # finished on the other host while this one is still cut off (its worker runs on, unheard)
        await asyncio.wait_for(asyncio.gather(*evals), STUDY_TIMEOUT_S)
    except TimeoutError:
        raise AssertionError(diagnostics(c)) from None
    mh.lab.heal(host)
    plan = plan_of(c, study)

    def done_elsewhere() -> bool:  # an eval is answered by its metrics; its batch's end can be applied a moment later
        return any(
            b.created_at > cut_at and b.nodes & cut.nodes and b.state == "DONE" and b.node_manager_id != nm  # type: ignore[attr-defined]
            for b in batches(c, plan)
        )

    try:
        await wait_for(done_elsewhere, 60, "the lost batch's work to end on another host")
    except TimeoutError:
        raise AssertionError((batches(c, plan), f"curve at {cut_step} when cut", diagnostics(c))) from None
    assert lost_requests(c, study) == 0 and duplicated_metrics(c, plan) == 0
    assert all(r.failures == 0 for r in requests(c, study))  # a lost attempt is no failure
    # the host is back: its node manager registers again, and the lost attempt's report was refused
    await wait_for(lambda: c.log(name, since_start=True).count(REGISTERED) > registered, 60, f"{name} to re-register")
    await wait_for(lambda: _state(mh, nm) == "ALIVE", 60, f"{name} to be alive again")
    await wait_for(lambda: mh.stale_reports() > stale_before, 60, "the lost attempt's late report to be refused")


async def test_a_partition_shorter_than_the_ttl_requeues_nothing(mh: MultiHost, client: Client) -> None:
    c = mh.cluster
    study = await new_study(client, "mh-blip", sleep_s=0.1)
    evals = [asyncio.ensure_future(study.eval({"lr": lr}, 30)) for lr in LRS[4:6]]
    name = c.node_manager_names()[-1]
    host, nm = mh.hosts[name], c.node_manager_id(name)
    await wait_for(lambda: _running_on(mh, study, nm, 20), 90, f"a batch on {name} with a checkpoint")
    # Cut the host off just after the master heard it, and bring it back once its next heartbeat is overdue:
    # the partition is felt, and the master's silence (the cut, then the link's recovery, slower on a loaded
    # machine) stays well under the TTL however long the test itself takes to notice.
    before = _last_heartbeat(mh, nm)
    await wait_for(lambda: _last_heartbeat(mh, nm) > before, 30, f"a heartbeat from {name}", every_s=0.05)
    mh.lab.partition(host)
    await wait_for(
        lambda: time.time() - _last_heartbeat(mh, nm) > HEARTBEAT_INTERVAL_S * 1.25, 30, "a heartbeat overdue"
    )
    healed_at = mh.lab.heal(host)
    await wait_for(lambda: _last_heartbeat(mh, nm) > healed_at, 30, f"{name} heard again")
    await asyncio.wait_for(asyncio.gather(*evals), STUDY_TIMEOUT_S)
    plan = plan_of(c, study)
    # an eval is answered by its metrics; its batch's end can be applied a moment later
    ended = await wait_for(
        lambda: (states := [b.state for b in batches(c, plan)]) and "RUNNING" not in states and states,
        60,
        "the study's batches to end",
    )
    assert set(ended) == {"DONE"}  # nothing lost, nothing requeued
    assert lost_requests(c, study) == 0 and duplicated_metrics(c, plan) == 0


async def test_latency_and_loss_on_a_hosts_link(mh: MultiHost, client: Client) -> None:
    name = mh.cluster.node_manager_names()[-1]
    why = mh.lab.netem(mh.hosts[name], delay_ms=30, loss_pct=2.0)
    if why:
        pytest.skip(why)
    study = await new_study(client, "mh-netem", sleep_s=0.02)
    await asyncio.wait_for(asyncio.gather(*(study.eval({"lr": lr}, 20) for lr in LRS[:4])), STUDY_TIMEOUT_S)
    plan = plan_of(mh.cluster, study)
    assert lost_requests(mh.cluster, study) == 0 and duplicated_metrics(mh.cluster, plan) == 0


def _last_heartbeat(mh: MultiHost, nm: str) -> float:
    """When the master last heard the node manager (its clock: this machine's)."""
    ((at,),) = mh.cluster.query("SELECT last_heartbeat FROM node_managers WHERE id = :n", n=nm)
    return float(at)


def _state(mh: MultiHost, nm: str) -> str | None:
    rows = mh.cluster.query("SELECT state FROM node_managers WHERE id = :n", n=nm)
    return str(rows[0][0]) if rows else None
