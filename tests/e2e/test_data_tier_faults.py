"""The data tier's faults on the process cluster, with real training: PostgreSQL stopped mid-study (as a
crash) and started again; the Kafka broker killed mid-study and started again on durable storage. They
share a cluster of their own (``data_tier``): a throwaway PostgreSQL server, never the shared one, and
Tansu's S3 engine on a moto S3 server.

What must hold: the master and the aggregators ride it out (no service exits), clients see UNAVAILABLE
and retry (no eval is lost or fails), and nothing is applied twice (one metric row per point, no attempt
counted as failed, no FAILED batch)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stagetree.client.sdk import connect
from stagetree.cluster import ProcessCluster
from tests.e2e.conftest import E2E_CONFIG, require_platform
from tests.e2e.data_tier import broker_restart, data_tier_cluster, postgres_restart
from tests.e2e.helpers import LRS, diagnostics, new_study
from tests.e2e.throwaway_pg import ThrowawayPostgres, pg_bindir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProcessCluster, ThrowawayPostgres]]:
    require_platform()
    if pg_bindir() is None:
        pytest.skip("no initdb/pg_ctl (the postgresql package)")
    pytest.importorskip("moto.server")
    with data_tier_cluster(tmp_path_factory.mktemp("data-tier"), **E2E_CONFIG) as both:
        yield both


def _all_alive(cluster: ProcessCluster) -> None:
    for name in cluster.services:
        assert cluster.alive(name), diagnostics(cluster, name)


async def test_postgres_restarted_mid_study_nothing_lost_nothing_twice(
    faulty: tuple[ProcessCluster, ThrowawayPostgres],
) -> None:
    cluster, pg = faulty
    async with connect(cluster.target, token=cluster.token, reconnect_s=120) as client:
        out = await postgres_restart(cluster, pg, client, down_s=5.0)
        assert out.evals == 6 and out.lost == 0 and out.duplicated == 0 and not out.problems, out
        assert out.waited_s >= 5.0  # the call made during the outage waited it out, then was answered
        _all_alive(cluster)
        # the cluster goes on: a new study's eval after the restart
        fresh = await new_study(client, "after-pg")
        assert 0.0 <= (await fresh.eval({"lr": LRS[4]}, 5))["accuracy"] <= 1.0


async def test_broker_restarted_mid_study_on_durable_storage_delivers_what_was_produced_while_down(
    faulty: tuple[ProcessCluster, ThrowawayPostgres],
) -> None:
    cluster, _ = faulty
    async with connect(cluster.target, token=cluster.token, reconnect_s=120) as client:
        out = await broker_restart(cluster, client, down_s=6.0)
        assert out.evals == 6 and out.lost == 0 and out.duplicated == 0 and not out.problems, out
        assert out.produced_while_down > 0, out  # what the batch trained through the outage reached the broker after
        _all_alive(cluster)
