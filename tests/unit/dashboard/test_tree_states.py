"""A stage-tree node's colour is what happened to the node itself, not to the trials that pass it."""

from __future__ import annotations

from stagetree.core.config import Config
from stagetree.core.lifecycle import RequestState
from stagetree.core.searchplan import SearchPlan
from stagetree.core.sequences import MultiStep
from stagetree.dashboard.tree import node_facts
from stagetree.master.store.activity import RunningBatch
from stagetree.master.store.records import RequestRecord


def _plan() -> tuple[SearchPlan, dict[str, int]]:
    """Three trials sharing [0, 5): ``a`` is the root's own continuation to 10, ``b`` and ``c`` branch at 5."""
    plan = SearchPlan()
    nodes = {}
    for name, g in (("a", 0.5), ("b", 0.2), ("c", 0.1)):
        point, _ = plan.locate(Config.of({"lr": MultiStep(0.1, [5], g)}), 10)
        assert point is not None
        nodes[name] = point.node
    return plan, nodes


def _req(rid: int, node: int, state: RequestState, step: int = 10) -> RequestRecord:
    return RequestRecord(rid, "s", 1, node, step, state, f"c{rid}", None, label=f"t{rid}")


def test_a_shared_root_is_done_though_a_trial_below_it_failed() -> None:
    plan, n = _plan()
    root = n["a"]
    reqs = [
        _req(1, n["a"], RequestState.DONE),
        _req(2, n["b"], RequestState.DONE),
        _req(3, n["c"], RequestState.FAILED),
    ]
    facts = node_facts(plan, reqs, {n["a"]: [10], n["b"]: [10]}, {root: [5]}, [])
    assert facts[root].state == "done" and facts[n["b"]].state == "done"
    assert facts[n["c"]].state == "failed" and facts[n["c"]].trained == 5


def test_a_root_whose_own_steps_failed_says_how_far_it_was_trained() -> None:
    plan, n = _plan()
    root = n["a"]
    reqs = [
        _req(1, n["a"], RequestState.FAILED),
        _req(2, n["b"], RequestState.DONE),
        _req(3, n["c"], RequestState.NOT_SCHED),
    ]
    facts = node_facts(plan, reqs, {n["b"]: [10]}, {}, [])
    assert facts[root].trained == 5 and facts[root].end == 10  # trained to where b branched, not beyond
    assert facts[root].state == "failed" and facts[root].progress == 0.5
    assert facts[n["c"]].state == "waiting"


def test_a_node_a_batch_trains_is_running_with_its_progress() -> None:
    plan, n = _plan()
    reqs = [_req(1, n["b"], RequestState.SCHED)]
    batch = RunningBatch(
        7, 1, 1, "owner:x", "nm", ("s0",), 0.0, [(plan.nodes[n["b"]].parent or 0, 0, 5), (n["b"], 5, 10)], 7
    )
    facts = node_facts(plan, reqs, {}, {}, [batch])
    assert facts[n["b"]].state == "running" and facts[n["b"]].progress == 0.4
    assert facts[n["a"]].state == "running" and facts[n["a"]].trained == 5  # the root's first steps, passed
