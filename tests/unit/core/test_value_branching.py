"""Sharing as exact as the values allow: the plan branches where two configs' values first differ, not
where their pieces do, so executed steps equal the unique steps by value."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.config import Config, divergence
from stagetree.core.searchplan import SearchPlan
from stagetree.core.sequences import (
    LOOKAHEAD,
    Constant,
    Cosine,
    Exponential,
    MultiStep,
    Segment,
    Sequence,
    Warmup,
    first_divergence,
)
from stagetree.core.sharing import unique_steps

STEP = 60


def unique_by_value(configs: list[Config], step: int) -> int:
    """Distinct prefixes of per-step values (with their types) over all configs: the steps any system
    that shares exactly by value must train."""
    seen: set[tuple[Any, ...]] = set()
    for c in configs:
        prefix: tuple[Any, ...] = ()
        for s in range(step):
            prefix = (*prefix, tuple((k, type(v), v) for k, v in sorted(c.values_at(s).items())))
            seen.add(prefix)
    return len(seen)


def plan_steps(configs: list[Config], step: int) -> int:
    plan = SearchPlan()
    points = [plan.add_request(c, step).point for c in configs]
    nodes = {n.id: (n.parent, n.start) for n in plan.nodes.values()}
    return unique_steps(nodes, [(p.node, p.step) for p in points])


def families(value: float) -> st.SearchStrategy[Sequence]:
    """Schedule families from ``value``; several agree at their first step, none stays equal long."""
    return st.one_of(
        st.just(Constant(value)),
        st.sampled_from([0.001, 0.01]).map(lambda f: Cosine(value, f, STEP)),
        st.sampled_from([0.9, 0.97]).map(lambda g: Exponential(value, g)),
        st.tuples(st.sampled_from([10, 30]), st.sampled_from([0.1, 0.5])).map(lambda t: MultiStep(value, [t[0]], t[1])),
    )


lr = st.sampled_from([0.1, 0.05]).flatmap(
    lambda v: st.one_of(families(v), families(v).map(lambda f: Warmup(0.01, 5, f)))
)
momentum = st.one_of(st.just(Constant(0.9)), families(0.9))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(lr, momentum), min_size=2, max_size=10))
def test_executed_steps_equal_unique_steps_by_value(grid: list[tuple[Sequence, Sequence]]) -> None:
    configs = [Config.of({"lr": a, "momentum": b}) for a, b in grid]
    assert plan_steps(configs, STEP) == unique_by_value(configs, STEP)


def test_pieces_that_start_at_the_same_value_share_that_step() -> None:
    cos, exp = Config.of({"lr": Cosine(0.1, 0.001, 50)}), Config.of({"lr": Exponential(0.1, 0.98)})
    assert cos.values_at(0) == exp.values_at(0) and divergence(cos, exp, 0, 50) == 1
    plan = SearchPlan()
    a = plan.add_request(cos, 20).point
    b = plan.add_request(exp, 20).point
    assert plan.nodes[b.node].start == 1 and plan.nodes[b.node].parent == a.node


def test_the_look_ahead_is_bounded_and_conservative() -> None:
    flat = Constant(0.1).segments()
    assert first_divergence(flat, MultiStep(0.1, [200], 0.5).segments(), 0, 300) == 200  # equal pieces: skipped
    # pieces that differ but whose values agree for good (an exponential with gamma 1, never built by the
    # families, which canonicalize it): the value search stops after LOOKAHEAD steps, an early branch
    flat_exp = (Segment(0, None, "exp", ("float", 0.1, 1.0)),)
    assert first_divergence(flat, flat_exp, 0, 300) == LOOKAHEAD
    assert first_divergence(flat, flat_exp, 0, 10) == 10


def test_values_of_another_type_differ() -> None:
    assert first_divergence(Constant(1).segments(), Constant(1.0).segments(), 0, 10) == 0
