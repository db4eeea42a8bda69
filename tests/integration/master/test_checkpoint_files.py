"""The master's checkpoint eviction deletes ``s3://`` checkpoints from the object store itself (a real
moto S3 server), with no node manager alive; the ones it keeps stay readable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagetree.core.batch import BatchSpec
from stagetree.core.lifecycle import CheckpointPoint, MetricPoint
from stagetree.master.app import MasterApp
from stagetree.master.checkpoint_files import ObjectStoreCheckpointFiles
from stagetree.nodemanager.runtime.checkpoints import open_checkpoint_store
from tests.checkpoint_contract import writer
from tests.integration.master.test_scheduling import ADMIN, _node_manager, _submit
from tests.reports import attempt_report
from tests.s3server import S3Server


@pytest.mark.parametrize("fresh_db_url", ["sqlite"], indirect=True)
def test_eviction_deletes_s3_checkpoints_from_the_object_store(
    app: MasterApp, s3: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    store = open_checkpoint_store(f"s3://{s3_bucket}/ck", s3_endpoint_url=s3.url, cache_dir=tmp_path / "cache")
    _submit(app, 1, step=30)
    nm = _node_manager(app, 1)
    app.scheduler.run_round()
    (a,) = app.service.take_assignments(ADMIN, nm)
    spec = BatchSpec.from_json(json.loads(a.spec_json))
    node = spec.stages[-1].node
    stored = {s: store.put(f"p/n{node}/s{s}", writer({"w": b"x" * 1000})) for s in (10, 20, 30)}
    ckpts = [CheckpointPoint(node, s, c.uri, c.bytes, "peripheral") for s, c in stored.items()]
    report = attempt_report(
        spec.batch_id, 1, ok=True, metrics=[MetricPoint(node, 30, {"loss": 0.1})], checkpoints=ckpts
    )
    app.service.report_batch(ADMIN, report)
    app.store.ledger.mark_lost(nm)  # no node manager is alive to delete the files
    files = ObjectStoreCheckpointFiles(s3.url)
    app.scheduler.files = files
    app.scheduler.settings.checkpoint_budget_bytes = 1500
    try:
        decided = app.scheduler.decide()  # the round chooses; only its evictions are carried out here
        evicted = decided.decision.evictions
        app.scheduler.applier.evict(evicted, decided.read, files)
    finally:
        app.scheduler.settings.checkpoint_budget_bytes = None
        files.close()  # waits for the background deletes
    assert len(evicted) == 2
    gone = {stored[p.step].uri for p in evicted}
    for uri in (c.uri for c in stored.values()):
        assert store.exists(uri) == (uri not in gone), uri
        if uri in gone:  # no object of it left behind
            assert store.fs.find(uri.removeprefix("s3://")) == []
