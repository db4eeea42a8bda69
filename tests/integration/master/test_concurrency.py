"""Many concurrent submitters (each its own engine and plan cache, as separate masters are) against
Postgres: every configuration ends on one node, and retried client request ids never duplicate."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter

from stagetree.core.config import Config, FixedPart
from stagetree.core.searchplan import SearchPlan
from stagetree.master.auth import Principal
from stagetree.master.service import MasterService, SubmitItem
from stagetree.master.settings import LimitSettings
from stagetree.master.store.store import Store, make_engine
from tests.integration.master.helpers import fixed, unique

THREADS = 12


def _configs() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for lr in (0.1, 0.05):
        for m in (20, 40, 60):
            for g in (0.5, 0.1):
                out.append({"lr": {"kind": "multistep", "init": lr, "milestones": [m], "gamma": g}, "bs": 32})
    return out


def test_concurrent_submitters_make_one_node_per_configuration(pg_url: str) -> None:
    fixed_part = fixed()
    who = Principal(unique("owner"))
    setup = Store.open(make_engine(pg_url))
    study = MasterService(setup, LimitSettings()).create_study(who, "concurrency")
    configs = _configs()
    items = [
        SubmitItem(f"c{i}-s{step}", json.dumps({"fixed": fixed_part, "tuned": cfg}), step)
        for i, cfg in enumerate(configs)
        for step in (10, 50, 100)
    ]
    barrier = threading.Barrier(THREADS)
    results: list[list[int]] = []
    errors: list[BaseException] = []

    def submitter(seed: int) -> None:
        store = Store.open(make_engine(pg_url, pool_size=2))
        svc = MasterService(store, LimitSettings())
        mine = items[:]
        random.Random(seed).shuffle(mine)
        try:
            barrier.wait()
            for i in range(0, len(mine), 7):
                recs = svc.submit(who, study.id, mine[i : i + 7])
                results.append([r.id for r in recs])
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            store.dispose()

    threads = [threading.Thread(target=submitter, args=(s,)) for s in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors

    reqs = setup.requests.get_requests(study.id)
    assert len(reqs) == len(items)
    assert Counter(r.client_request_id for r in reqs).most_common(1)[0][1] == 1
    assert sum(len(r) for r in results) == THREADS * len(items)

    expected = SearchPlan()
    for it in items:
        obj = json.loads(it.config_json)
        expected.locate(Config.of(obj["tuned"]), it.step)
    key = FixedPart.from_json(fixed_part).key(who.scope)  # plans are scoped by owner
    plan_id = setup.plans.plan_ids_by_key([key])[key]
    nodes = setup.plans.load_nodes(plan_id)
    assert len(nodes) == len(expected.nodes)
    assert Counter((n.start, n.parent is None) for n in nodes) == Counter(
        (n.start, n.parent is None) for n in expected.nodes.values()
    )
    setup.dispose()
