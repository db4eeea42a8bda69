"""The scheduling loop with studies whose batches take several slots, against real databases: a batch on
n slots holds n slots of one node manager (its spec names them, the busy slots count them all, its end
frees them all), and with a QoS class GENIE picks the width."""

from __future__ import annotations

import json
from typing import Any

from stagetree.core.batch import BatchSpec
from stagetree.master.app import MasterApp
from stagetree.master.service import SubmitItem
from tests.integration.master.helpers import config_json, fixed, unique
from tests.integration.master.test_scheduling import ADMIN, ALICE, _node_manager
from tests.reports import attempt_report


def _study(app: MasterApp, policies: dict[str, Any], n: int) -> None:
    f = fixed()
    study = app.service.create_study(ALICE, unique("s"), json.dumps({**f, "policies": policies}))
    items = [SubmitItem(f"r{i}", config_json(f, lr=0.01 * (i + 1)), 10) for i in range(n)]
    app.service.submit(ALICE, study.id, items)


def test_a_batch_on_two_slots_holds_two_slots_of_one_node_manager_until_it_ends(app: MasterApp) -> None:
    _study(app, {"slots": 2}, 2)
    small, big = _node_manager(app, 1), _node_manager(app, 3)
    first = app.scheduler.run_round()
    # 2 slots of `big`; what is left (1 on each) cannot hold the second batch
    assert len(first.dispatched) == 1 and first.queued == 1
    assert app.service.take_assignments(ADMIN, small) == []
    (a,) = app.service.take_assignments(ADMIN, big)
    spec = BatchSpec.from_json(json.loads(a.spec_json))
    assert a.slot_id == "g0" and spec.slots == 2 and spec.extra["slot_ids"] == ["g0", "g1"]
    assert app.store.rounds.busy_slots() == {(big, "g0"), (big, "g1")}
    assert app.scheduler.run_round().dispatched == []
    app.service.report_batch(ADMIN, attempt_report(spec.batch_id, 1, ok=True, metrics=[]))
    assert app.store.rounds.busy_slots() == set()
    assert len(app.scheduler.run_round().dispatched) == 1  # both slots free again


def test_genie_gives_a_prior_batch_the_width_with_the_best_cost_effective_ratio(app: MasterApp) -> None:
    """With no data yet, time per step on n slots is the ideal 1/n of one: wider is cheaper per unit of
    work by Eq. 5, and meets the deadline sooner, so GENIE takes the widest the study allows."""
    _study(app, {"qos": "prior", "slots": 2}, 1)
    nm = _node_manager(app, 4)
    (bid,) = app.scheduler.run_round().dispatched
    (a,) = app.service.take_assignments(ADMIN, nm)
    spec = BatchSpec.from_json(json.loads(a.spec_json))
    assert spec.batch_id == bid and spec.slots == 2 and len(app.store.rounds.busy_slots()) == 2
