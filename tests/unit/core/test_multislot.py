"""Batches on several slots in the pure core: placement on n slots of one node manager, stages costed
at n, the cost model's time per step as a function of n, the out-of-memory doubling and its cap, the
study's ``slots`` choice, and the lifecycle's out-of-memory state."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.config import Config
from stagetree.core.errors import InvalidArgument, ResourceExhausted
from stagetree.core.estimator import INV_SLOTS, CostModel
from stagetree.core.ids import PlanId
from stagetree.core.lifecycle import (
    AttemptEnd,
    BatchHead,
    BatchState,
    CarriedRequest,
    Outcome,
    RetryPolicy,
    end_attempt,
)
from stagetree.core.policies.study import parse_policies
from stagetree.core.round import BusySlot, plan_round
from stagetree.core.round.place import SlotPool
from stagetree.core.searchplan import SearchPlan
from stagetree.core.slots import Slot
from tests.sim.inputs import plan_work, round_input

PLAN, CPU = "plan-a", "cpu"


def _slots(*spec: tuple[str, int]) -> list[Slot]:
    return [Slot(f"{nm}-s{i}", nm) for nm, n in spec for i in range(n)]


def _plan(*trials: tuple[float, int]) -> SearchPlan:
    sp = SearchPlan()
    for lr, steps in trials:
        sp.add_request(Config.of({"lr": lr, "bs": 32}), steps)
    return sp


# -- placement -------------------------------------------------------------------------------------


def test_n_slots_come_from_the_fullest_node_manager_that_has_them() -> None:
    pool = SlotPool(_slots(("a", 1), ("b", 3), ("c", 2), ("d", 2)), [], [], [], {})
    got = pool.wide(2)
    assert got is not None and [s.id for s in got] == ["c-s0", "c-s1"]  # c and d fit exactly; c comes first
    pool.taken.update(got)
    assert pool.wide(4) is None  # no node manager has 4 free: nothing taken
    again = pool.wide(3)
    assert again is not None and [s.id for s in again] == ["b-s0", "b-s1", "b-s2"]
    pool.taken.update(again)
    assert [s.id for s in pool.wide(2) or ()] == ["d-s0", "d-s1"]
    first = pool.first_free()
    assert first is not None and first.id == "a-s0"


@settings(max_examples=200)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.integers(1, 4))
def test_a_wide_placement_is_n_distinct_gpus_of_the_fullest_node_manager_that_fits(free: list[int], n: int) -> None:
    slots = [Slot(f"h{h}-g{g}", f"h{h}", gpu_index=g) for h, k in enumerate(free) for g in range(k)]
    got = SlotPool(slots, [], [], [], {}).wide(n)
    fits = [k for k in free if k >= n]
    if not fits:
        assert got is None
        return
    assert got is not None and len(got) == n
    assert len({s.node_manager for s in got}) == 1 and len({s.rank_place for s in got}) == n
    host = int(got[0].node_manager[1:])
    assert free[host] == min(fits) and host == free.index(min(fits))


def test_ranks_of_one_batch_never_share_a_gpu() -> None:
    """Two slots a GPU: a 2-slot batch takes one slot of each of two GPUs (NCCL refuses two ranks on one
    device); a node manager with one GPU, however many slots share it, has room for one rank."""
    two_gpus = [Slot(f"g-gpu{i}.{j}", "g", "H200", gpu_index=i) for i in range(2) for j in range(2)]
    got = SlotPool(two_gpus, [], [], [], {}).wide(2)
    assert got is not None and [s.id for s in got] == ["g-gpu0.0", "g-gpu1.0"]
    assert SlotPool(two_gpus, [], [], [], {}).wide(3) is None
    one_gpu = [Slot(f"h-gpu0.{j}", "h", "H200", gpu_index=0) for j in range(4)]
    assert SlotPool(one_gpu, [], [], [], {}).wide(2) is None
    wide = plan_work(_plan((0.1, 10)), PlanId(1), slots=2)
    dec = plan_round(round_input([wide], one_gpu))
    assert dec.dispatches == () and "the study asks for 2 slots per batch" in dec.unplaceable[PlanId(1)]
    dec = plan_round(round_input([wide], two_gpus))
    (d,) = dec.dispatches
    assert sorted(s.gpu_index for s in d.slots) == [0, 1]


def test_a_batch_on_two_slots_waits_for_a_node_manager_with_two_free_while_others_are_placed() -> None:
    two = plan_work(_plan((0.1, 100)), PlanId(1), slots=2)  # the longest path, its plan takes 2 slots
    one = plan_work(_plan((0.5, 10)), PlanId(2))
    b_busy = BusySlot(Slot("b-s1", "b"))  # b has two slots, one of them busy
    dec = plan_round(round_input([two, one], _slots(("a", 1), ("b", 1)), busy=[b_busy]))
    assert [(d.batch.plan, [s.id for s in d.slots]) for d in dec.dispatches] == [(2, ["a-s0"])]
    assert dec.queued == 1 and not dec.unplaceable
    dec = plan_round(round_input([two, one], _slots(("a", 1), ("b", 2))))
    placed = [(d.batch.plan, d.slot.id, [s.id for s in d.slots]) for d in dec.dispatches]
    assert placed == [(1, "b-s0", ["b-s0", "b-s1"]), (2, "a-s0", ["a-s0"])]
    assert dec.dispatches[0].batch.slots == 2


def test_the_critical_path_counts_a_stage_at_its_slots() -> None:
    """Two trials, 100 steps at 2 s/step on 1 slot and 150 steps on 4 slots at the ideal speedup
    (0.5 s/step): the 100-step one is the longer path and goes first."""
    first = plan_work(_plan((0.1, 100)), PlanId(1), cost=lambda st: st.steps * 2.0)
    second = plan_work(_plan((0.2, 150)), PlanId(2), cost=lambda st: st.steps * 2.0 / 4, slots=4)
    dec = plan_round(round_input([first, second], _slots(("a", 1))))
    assert [d.batch.plan for d in dec.dispatches] == [1]


def test_a_plan_that_needs_more_slots_than_any_node_manager_has_is_unplaceable_with_why() -> None:
    oom = plan_work(_plan((0.1, 10)), PlanId(1), slots=4, asked=1)
    asked = plan_work(_plan((0.2, 10)), PlanId(2), slots=3)
    dec = plan_round(round_input([oom, asked], _slots(("a", 2))))
    assert dec.dispatches == ()
    assert "out of memory on 2 slot(s)" in dec.unplaceable[PlanId(1)]
    assert "the study asks for 3 slots per batch" in dec.unplaceable[PlanId(2)]


# -- the cost model --------------------------------------------------------------------------------


def test_time_per_step_is_fitted_on_one_over_n_and_extrapolates() -> None:
    m = CostModel()
    m.observe(PLAN, CPU, {"bs": 32}, 1.0, 0.0)  # 1 slot
    # seen on one n only: the ideal speedup
    assert m.seconds_per_step(PLAN, CPU, {"bs": 32}, 2) == pytest.approx(0.5)
    m.observe(PLAN, CPU, {"bs": 32}, 0.6, 0.0, slots=2)  # t = 0.2 + 0.8 / n
    assert m.seconds_per_step(PLAN, CPU, {"bs": 32}, 1) == pytest.approx(1.0)
    assert m.seconds_per_step(PLAN, CPU, {"bs": 32}, 4) == pytest.approx(0.4)
    assert m.observations(PLAN, CPU)[1].features == {"bs": 32.0, INV_SLOTS: 0.5}
    again = CostModel.from_json(m.to_json())
    assert again.seconds_per_step(PLAN, CPU, {"bs": 32}, 4) == pytest.approx(0.4)
    with pytest.raises(InvalidArgument, match="slots"):
        m.seconds_per_step(PLAN, CPU, {"bs": 32}, 0)


def test_a_one_slot_model_predicts_as_before() -> None:
    m = CostModel()
    m.observe(PLAN, CPU, {"bs": 32}, 1.0, 0.0)
    m.observe(PLAN, CPU, {"bs": 64}, 2.0, 0.0)
    assert m.seconds_per_step(PLAN, CPU, {"bs": 128}) == pytest.approx(4.0)
    assert "inv_slots" not in m.observations(PLAN, CPU)[0].features


def test_out_of_memory_doubles_the_slots_up_to_the_largest_node_manager_then_says_why() -> None:
    m = CostModel()
    assert m.slots_for(PLAN, 1, 4) == 1
    assert m.record_oom(PLAN, 1) == 2 and m.slots_for(PLAN, 1, 4) == 2
    assert m.record_oom(PLAN, 2) == 4 and m.slots_for(PLAN, 1, 4) == 4
    assert m.slots_for(PLAN, 1, 8) == 4 and m.min_slots("other") == 1
    m.record_oom(PLAN, 4)
    with pytest.raises(ResourceExhausted) as err:
        m.slots_for(PLAN, 1, 4)
    assert "out of memory on 4 slot(s)" in err.value.message and "largest node manager has 4" in err.value.message
    with pytest.raises(
        ResourceExhausted, match="the study asks for 3 slots per batch and the largest node manager has 2"
    ):
        m.slots_for("fresh", 3, 2)
    assert CostModel.from_json(m.to_json()).min_slots(PLAN) == 8


# -- the study's choice and the lifecycle ----------------------------------------------------------


def test_a_study_chooses_its_slots_per_batch_without_choosing_a_scheduling_step() -> None:
    p = parse_policies({"slots": 2})
    assert p.slots == 2 and not p.schedules and p.to_json() == {"slots": 2}
    assert parse_policies(p.to_json()) == p
    both = parse_policies({"slots": 4, "qos": "urgent"})
    assert both.slots == 4 and both.schedules
    assert parse_policies({"order": "bfs"}).slots == 1
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidArgument, match=r"policies\.slots"):
            parse_policies({"slots": bad})


def test_an_attempt_out_of_memory_is_its_own_batch_state_and_is_retried() -> None:
    d = end_attempt(
        BatchHead(1, BatchState.RUNNING),
        AttemptEnd(9, 1, Outcome.OUT_OF_MEMORY, "CUDA"),
        [CarriedRequest(1, 0)],
        RetryPolicy(3),
    )
    assert d.batch_state is BatchState.OUT_OF_MEMORY and d.batch_state.is_finished()
    assert d.requeued == (1,) and d.counted == (1,) and d.error == "out of memory: CUDA"
