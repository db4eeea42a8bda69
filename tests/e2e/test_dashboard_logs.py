"""A batch attempt's worker log as the dashboard reads it in cluster mode (master and node managers separate
processes, ``ProcessCluster``): the master does not read the node manager's files, so it says where the
log is (the node manager's host and the file's path there: a file that is there), and shows the lines
the trainer logged, which it keeps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from stagetree.client.sdk import Client, EvalFailed
from stagetree.cluster import ProcessCluster
from tests.e2e.helpers import new_study, study_batches

pytestmark = pytest.mark.slow


async def test_a_worker_log_is_located_and_its_trainer_lines_shown_in_cluster_mode(
    cluster: ProcessCluster, client: Client
) -> None:
    ok_study = await new_study(client, "log-ok", log_every=2)
    await asyncio.wait_for(ok_study.eval({"lr": 0.1}, 6), 120)
    bad_study = await new_study(client, "log-bad", log_every=2, fault="raise", fault_step=3)
    with pytest.raises(EvalFailed):
        await asyncio.wait_for(bad_study.eval({"lr": 0.1}, 6), 120)

    auth = {"authorization": f"Bearer {cluster.token}"}
    async with httpx.AsyncClient(base_url=cluster.rest_url, headers=auth, timeout=30) as http:
        for study, logged in ((ok_study, ["step 2", "step 4", "step 6"]), (bad_study, ["step 2"])):
            (b,) = await asyncio.to_thread(study_batches, cluster, study)
            ((attempt,),) = cluster.query("SELECT max(attempt) FROM batch_attempts WHERE batch_id = :b", b=b.id)
            r = await http.get(f"/dashboard/studies/{study.id}/batches/{b.id}/log", params={"attempt": attempt})
            assert r.status_code == 200, r.text
            got = r.json()
            assert not got["readable"] and got["files"] == []
            name = next(n for n in cluster.node_manager_names() if cluster.node_manager_id(n) == got["node_manager"])
            assert got["host"] == name  # what the node manager registered as its address
            assert name in got["where"] and got["path"] in got["where"]
            # the path it names is where the node manager keeps the log: the whole path for a failed
            # attempt (its error noted it), else under the node manager's work directory
            path = Path(got["path"]) if got["path"].startswith("/") else cluster.root / name / got["path"]
            assert path.is_file(), (got, sorted((cluster.root / name).rglob("*.log")))
            assert path.name == f"batch-{b.id}-a{attempt}.log"
            # the trainer's own lines, from the master's database
            assert [x["line"].split(" train_loss ")[0] for x in got["lines"]] == logged, got["lines"]
