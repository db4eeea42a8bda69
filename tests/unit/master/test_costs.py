"""The cost estimator fed by finished batches, and the scheduling round that uses it."""

from __future__ import annotations

import json
from typing import Any

from stagetree.core.config import Config
from stagetree.core.ids import PlanId
from stagetree.core.round import plan_round
from stagetree.core.searchplan import SearchPlan
from stagetree.core.slots import Slot
from stagetree.core.stagetree import build_stage_tree
from stagetree.master.costs import CostLearner
from stagetree.master.store.records import FinishedAttempt
from stagetree.nodemanager.examples.digits import digits_batch
from tests.sim.inputs import plan_input

CHEAP = {"lr": 0.1, "bs": 32}
DEAR = {"lr": 0.1, "bs": 128}


def _attempt(
    batch_id: int, hps: dict[str, Any], steps: int, seconds: float, at: float, plan_values: Any = None
) -> FinishedAttempt:
    spec = digits_batch([(1, 0, steps, hps)], batch_id=batch_id, fixed_values=plan_values or {})
    return FinishedAttempt(batch_id, 1, json.dumps(spec.to_json()), seconds, at, "cpu")


def _plan_key(plan_values: Any = None) -> str:
    return digits_batch([(1, 0, 1, CHEAP)], fixed_values=plan_values or {}).plan_key


def test_cold_plans_cost_the_default_and_learned_ones_follow_the_batch_size() -> None:
    learner = CostLearner(default_step_seconds=1.0)
    plan = SearchPlan()
    cheap = plan.add_request(Config.of(CHEAP), 50).point
    dear = plan.add_request(Config.of(DEAR), 40).point
    forest = build_stage_tree(plan.nodes, {}, [(r.id, r.point) for r in plan.pending()], plan=PlanId(7))
    cost = learner.stage_cost(lambda pid: _plan_key(), lambda pid, node: plan.nodes[node].config, "cpu")
    by_end = {s.end: cost(s) for s in forest.stages}
    assert by_end == {50: 50.0, 40: 40.0}  # no data: every step costs the default
    # the critical path is then the longer one in steps
    first = plan_round(plan_input(plan, [Slot("w0")], cost=cost)).dispatches[0].batch
    assert first.end == cheap

    assert learner.observe([_attempt(1, CHEAP, 10, 0.22, 100.0), _attempt(2, DEAR, 10, 0.88, 101.0)]) == 2
    assert learner.observe([_attempt(1, CHEAP, 10, 0.22, 100.0)]) == 0  # read again: not counted twice
    assert learner.knows(_plan_key(), "cpu") and not learner.knows(_plan_key({"hidden": 8}), "cpu")
    cost = learner.stage_cost(lambda pid: _plan_key(), lambda pid, node: plan.nodes[node].config, "cpu")
    forest = build_stage_tree(plan.nodes, {}, [(r.id, r.point) for r in plan.pending()], plan=PlanId(7))
    costs = {s.end: cost(s) for s in forest.stages}
    assert abs(costs[50] - 50 * 0.022) < 1e-6 and abs(costs[40] - 40 * 0.088) < 1e-6
    first = plan_round(plan_input(plan, [Slot("w0")], cost=cost)).dispatches[0].batch
    assert first.end == dear  # 40 steps at bs=128 take longer than 50 at bs=32
    other_plan = learner.stage_cost(
        lambda pid: _plan_key({"hidden": 8}), lambda pid, node: plan.nodes[node].config, "cpu"
    )
    assert {s.end: other_plan(s) for s in forest.stages} == {50: 50.0, 40: 40.0}
    gpu = learner.stage_cost(lambda pid: _plan_key(), lambda pid, node: plan.nodes[node].config, "a100")
    assert {s.end: gpu(s) for s in forest.stages} == {50: 50.0, 40: 40.0}  # per GPU type
    # what it learns next replaces the costs it kept: bs=32 twice as dear now, on the average
    learner.observe([_attempt(3, CHEAP, 10, 0.66, 102.0)])
    cost = learner.stage_cost(lambda pid: _plan_key(), lambda pid, node: plan.nodes[node].config, "cpu")
    assert abs(cost(next(s for s in forest.stages if s.end == 50)) - 50 * 0.044) < 1e-6


def test_a_batch_over_several_stages_is_learned_at_its_mean_batch_size_and_bad_rows_are_skipped() -> None:
    learner = CostLearner(default_step_seconds=1.0)
    spec = digits_batch([(1, 0, 10, CHEAP), (2, 10, 20, DEAR)], batch_id=5)
    good = FinishedAttempt(5, 1, json.dumps(spec.to_json()), 1.1, 10.0, "")
    unreadable = FinishedAttempt(6, 1, "{not json", 1.0, 11.0, "cpu")
    empty = FinishedAttempt(7, 1, json.dumps(digits_batch([(1, 0, 0, CHEAP)]).to_json()), 1.0, 12.0, "cpu")
    assert learner.observe([good, unreadable, empty]) == 1
    (obs,) = learner.model.observations(spec.plan_key, "cpu")  # no slot row: taken as a CPU slot
    assert obs.features == {"bs": 80.0} and abs(obs.seconds_per_step - 0.055) < 1e-9


def test_old_attempts_leave_the_overlap_window() -> None:
    learner = CostLearner(default_step_seconds=1.0)
    learner.observe([_attempt(1, CHEAP, 10, 0.2, 100.0)])
    learner.observe([_attempt(2, CHEAP, 10, 0.2, 1000.0)])
    assert set(learner._seen) == {(2, 1)}  # (1, 1) finished long before: it cannot be read again
