"""The branch digest agrees with the core's divergence test: equal digests at a step exactly when the
two configs take the same child there (the unique key concurrent masters rely on)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as hst

from stagetree.core.config import Config, divergence
from stagetree.master.plans import branch_digest

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
