"""``SearchPlan``'s branch index (a child found by the hash of the values it takes at its branch step)
decides exactly what comparing every sibling decides: the same nodes, the same points, also after
``forget_node``, and when siblings share a hash."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core import searchplan
from stagetree.core.config import Config, divergence
from stagetree.core.searchplan import Node, SearchPlan
from stagetree.core.sequences import MultiStep


class ScanningPlan(SearchPlan):
    """The reference: every sibling compared, no index."""

    def _child_at(self, node: Node | None, config: Config, d: int) -> Node | None:
        kids = self.roots if node is None else node.children.get(d, [])
        for cid in kids:
            if divergence(self.nodes[cid].config, config, d, d + 1) > d:
                return self.nodes[cid]
        return None


lrs = st.builds(
    MultiStep,
    st.sampled_from([0.1, 0.05]),
    st.lists(st.sampled_from([5, 10, 15]), min_size=1, max_size=2, unique=True).map(sorted),
    st.sampled_from([0.5, 0.1]),
)
configs = st.builds(lambda lr, bs: Config.of({"lr": lr, "bs": bs}), lrs, st.sampled_from([32, 64]))


def _shape(plan: SearchPlan) -> list[tuple[int, int | None, int]]:
    return sorted((n.id, n.parent, n.start) for n in plan.nodes.values())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(configs, st.integers(1, 20)), min_size=1, max_size=25), st.data())
def test_the_index_walks_where_the_scan_walks(items: list[tuple[Config, int]], data: st.DataObject) -> None:
    fast, slow = SearchPlan(), ScanningPlan()
    for config, step in items:
        assert fast.locate(config, step)[0] == slow.locate(config, step)[0]
    assert _shape(fast) == _shape(slow)
    leaves = [n.id for n in fast.nodes.values() if not n.children and n.parent is not None]
    if leaves:  # forget a leaf in both, then locate everything again: the same nodes come back
        gone = data.draw(st.sampled_from(leaves))
        fast.forget_node(gone)
        slow.forget_node(gone)
        for config, step in items:
            assert fast.locate(config, step)[0] == slow.locate(config, step)[0]
        assert _shape(fast) == _shape(slow)


def test_siblings_under_one_hash_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(searchplan, "_values_hash", lambda config, step: 0)  # every key collides
    plan, reference = SearchPlan(), ScanningPlan()
    items = [(Config.of({"lr": MultiStep(0.1, [10], g), "bs": b}), 30) for g in (0.5, 0.2, 0.1) for b in (32, 64)]
    for config, step in items + items:
        assert plan.locate(config, step)[0] == reference.locate(config, step)[0]
    assert _shape(plan) == _shape(reference) and len(plan.nodes) == 6
    first = plan.roots[0]
    (kids,) = plan.nodes[first].children.values()
    gone = kids[0]
    plan.forget_node(gone)  # the indexed child goes: a sibling under the same hash takes its place
    reference.forget_node(gone)
    for config, step in items:
        assert plan.locate(config, step)[0] == reference.locate(config, step)[0]


def test_forgetting_siblings_under_one_hash_in_any_order_keeps_the_index_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The index counts the siblings a key shadows: forgetting the newest (not indexed), then the
    indexed one, leaves the remaining sibling found, as a scan finds it."""
    monkeypatch.setattr(searchplan, "_values_hash", lambda config, step: 0)
    plan, reference = SearchPlan(), ScanningPlan()
    items = [(Config.of({"lr": MultiStep(0.1, [10], g)}), 30) for g in (0.5, 0.2, 0.1)]
    for config, step in items:
        assert plan.locate(config, step)[0] == reference.locate(config, step)[0]
    (kids,) = plan.nodes[plan.roots[0]].children.values()
    for gone in (kids[-1], kids[0]):  # the newest, then the indexed one
        plan.forget_node(gone)
        reference.forget_node(gone)
        left = [(c, s) for c, s in items if reference.locate(c, s, create=False)[0] is not None]
        for config, step in left:
            assert plan.locate(config, step, create=False)[0] == reference.locate(config, step, create=False)[0]
    assert len(left) == 1
