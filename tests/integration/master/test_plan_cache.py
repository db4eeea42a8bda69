"""The master's plan cache holds each hyper-parameter sequence once: nodes written by this master and
nodes read back from the database (another master's, or after a restart) share equal sequences, and the
configs keep their meaning (same JSON, same digests)."""

from __future__ import annotations

from stagetree.core.config import Config
from stagetree.core.sequences import MultiStep
from stagetree.master.plans import PlanCache
from stagetree.master.store.store import Store
from tests.integration.master.helpers import unique


def test_equal_sequences_are_one_object_in_the_cache(store: Store) -> None:
    plan_id = store.plans.ensure_plan(unique("plan"), "{}")
    configs = [Config.of({"lr": MultiStep(0.1, [10], g), "wd": 0.01, "bs": 32}) for g in (0.5, 0.2, 0.1)]
    writer = PlanCache(store.plans)
    points = writer.locate_many(plan_id, [(c, 30) for c in configs])
    reader = PlanCache(store.plans)  # another master: reads every node from the database
    for cache in (writer, reader):
        plan = cache.refresh(plan_id)
        nodes = [plan.nodes[p.node] for p in points]
        assert len({n.id for n in nodes}) == 3
        for name in ("wd", "bs"):  # the same in every node: one object
            assert len({id(dict(n.config.items)[name]) for n in nodes}) == 1
        assert len({id(dict(n.config.items)["lr"]) for n in nodes}) == 3  # each child's own
        assert [n.config.to_json() for n in nodes] == [c.to_json() for c in configs]
    # the two caches agree on where each config goes, whoever wrote the nodes
    assert reader.locate_many(plan_id, [(c, 30) for c in configs]) == points


def test_every_reader_of_a_cache_that_never_saw_the_plan_loads_it(store: Store) -> None:
    # a master that takes over holds no plan while batches of them still run: asking for the plan as it
    # is cached (no node named) must not answer with an empty plan, nor a named node with a KeyError
    plan_id = store.plans.ensure_plan(unique("plan"), "{}")
    configs = [Config.of({"lr": lr, "bs": 32}) for lr in (0.1, 0.2)]
    writer = PlanCache(store.plans)
    first, second = writer.locate_many(plan_id, [(c, 30) for c in configs])
    written = set(writer.refresh(plan_id).nodes)
    assert PlanCache(store.plans).ensure(plan_id, ()).nodes.keys() == written
    assert PlanCache(store.plans).canonical(plan_id, first) == first
    assert PlanCache(store.plans).find(plan_id, configs[1], 30) == second
    # a node written by the other master after this one loaded the plan is read when it is named
    reader = PlanCache(store.plans)
    reader.ensure(plan_id, ())
    (third,) = writer.locate_many(plan_id, [(Config.of({"lr": 0.3, "bs": 32}), 30)])
    assert third.node not in reader.ensure(plan_id, ()).nodes
    assert third.node in reader.ensure(plan_id, (third.node,)).nodes
