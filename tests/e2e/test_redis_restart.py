"""Redis restarted mid-study: nothing is lost. Redis holds only liveness, the leader lease and wake-ups,
so an empty Redis coming back must cost at most some re-run work, never a result.

This test brings its own redis-server on a free port (and so its own cluster): restarting the shared
one would disturb every other test on the machine.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from stagetree.bus.tansu import free_loopback_port
from stagetree.client.sdk import Client, connect
from stagetree.cluster import ClusterConfig, ProcessCluster
from tests.e2e.conftest import E2E_CONFIG, require_platform
from tests.e2e.helpers import LRS, diagnostics, new_study, requests, study_batches, wait_for

pytestmark = pytest.mark.slow

LEASE_UNCHECKED = "leader lease cannot be checked"  # the master's scheduling loop, each try while Redis is away


class RedisServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = redis.Redis(port=self.port)
            try:
                if r.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
            finally:
                r.close()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture(scope="module")
def private_redis() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary to run a private Redis")
    server = RedisServer(free_loopback_port())
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def own_cluster(private_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    require_platform()
    root: Path = tmp_path_factory.mktemp("redis-cluster")
    config = ClusterConfig(
        root=root,
        redis_url=f"redis://127.0.0.1:{private_redis.port}",
        aggregators=1,
        **E2E_CONFIG,  # type: ignore[arg-type]
    )
    with ProcessCluster(config) as c:
        yield c


@pytest.fixture
async def own_client(own_cluster: ProcessCluster) -> AsyncIterator[Client]:
    async with connect(own_cluster.target, token=own_cluster.token) as c:
        yield c


async def test_redis_restarted_mid_study_loses_nothing(
    own_cluster: ProcessCluster, own_client: Client, private_redis: RedisServer
) -> None:
    cluster = own_cluster
    study = await new_study(own_client, "redis-restart", sleep_s=0.1)
    evals = [asyncio.ensure_future(study.eval({"lr": lr}, 30)) for lr in LRS[:4]]
    await wait_for(lambda: any(b.state == "RUNNING" for b in study_batches(cluster, study)), 60, "a running batch")

    gone = cluster.log("master").count(LEASE_UNCHECKED)
    private_redis.kill()
    # Redis stays away until the master has found it gone (a fixed outage can end, on a loaded machine,
    # before any service tried it)
    await wait_for(lambda: cluster.log("master").count(LEASE_UNCHECKED) > gone, 60, "the master to miss Redis")
    await asyncio.to_thread(private_redis.start)  # empty: no heartbeat keys, no lease, no subscriptions

    results = await asyncio.wait_for(asyncio.gather(*evals), 120)
    assert len(results) == 4 and all("accuracy" in r for r in results)
    rows = requests(cluster, study)
    assert len(rows) == 4 and {r.state for r in rows} == {"DONE"}, rows
    for name in cluster.services:  # every service rode it out
        assert cluster.alive(name), diagnostics(cluster, name)
    # and the platform still schedules and wakes: a new eval after the restart is served
    more = await asyncio.wait_for(study.eval({"lr": LRS[4]}, 10), 60)
    assert "accuracy" in more
