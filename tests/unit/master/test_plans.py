"""The branch digest agrees with the core's divergence test: equal digests at a step exactly when the
two configs take the same child there (the unique key concurrent masters rely on)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as hst

from stagetree.core.batch import Point
from stagetree.core.config import Config, divergence
from stagetree.core.searchplan import SearchPlan
from stagetree.master.plans import branch_digest, locate_all

lrs = hst.sampled_from([0.1, 0.05, 0.2])
milestones = hst.lists(hst.integers(1, 60), min_size=1, max_size=3, unique=True).map(sorted)


def _config(init: float, ms: list[int], gamma: float, bs: int) -> Config:
    return Config.of({"lr": {"kind": "multistep", "init": init, "milestones": ms, "gamma": gamma}, "bs": bs})


configs = hst.builds(_config, lrs, milestones, hst.sampled_from([0.5, 0.1]), hst.sampled_from([32, 64]))


@settings(max_examples=300, deadline=None)
@given(configs, configs, hst.integers(0, 80))
def test_digest_equal_iff_configs_agree_at_the_step(a: Config, b: Config, step: int) -> None:
    # the walk compares configs that agree before `step`; there the digest must decide like divergence
    if divergence(a, b, 0, step) < step:
        return
    agree_at_step = divergence(a, b, step, step + 1) > step
    assert (branch_digest(a, step) == branch_digest(b, step)) == agree_at_step


@settings(max_examples=150, deadline=None)
@given(hst.lists(hst.tuples(configs, hst.integers(0, 80)), min_size=1, max_size=30))
def test_locating_all_at_once_gives_each_items_own_walk(items: list[tuple[Config, int]]) -> None:
    together, one_by_one = SearchPlan(), SearchPlan()
    points, created = locate_all(together, items, create=True)
    alone = [one_by_one.locate(c, s)[0] for c, s in items]
    # Which trial's config a node holds past its branch step depends on the order of the walks (the
    # batched walk takes each config once, at its largest step), so the two trees may differ in shape;
    # what must hold is that every item's point trains exactly its own config's values.
    assert len(created) == len(together.nodes)
    for (config, step), p, q in zip(items, points, alone, strict=True):
        assert p is not None and q is not None
        own = [config.values_at(x) for x in range(step)]
        assert _trained(together, p) == own == _trained(one_by_one, q)
    assert [together.locate(c, s, create=False)[0] for c, s in items] == points  # nothing left to create
    again, more = locate_all(together, items, create=False)
    assert again == points and more == []


def _trained(plan: SearchPlan, p: Point) -> list[dict[str, float]]:
    """The values trained at each step on the way to ``p`` (a node's config beyond its segment may be any
    trial's that agrees on it, so only the steps inside each segment count)."""
    return [plan.nodes[n].config.values_at(x) for n, a, b in plan.path(p) for x in range(a, b)]
