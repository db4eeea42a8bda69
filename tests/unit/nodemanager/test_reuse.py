"""The node manager's two reuse decisions (``nodemanager.reuse``), as pure functions of plain data."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from stagetree.nodemanager.reuse import (
    MIB,
    ReusePolicy,
    TrainerKey,
    WorkerView,
    retire_after_batch,
    retire_before_batch,
)

T1 = TrainerKey("pkg.train:Net", "v1")
USED = WorkerView(trainer=T1, batches=3, rss_bytes=500 * MIB, first_rss_bytes=480 * MIB)


def test_a_worker_that_finished_its_batch_is_kept_unless_reuse_is_off() -> None:
    assert retire_after_batch(USED, ReusePolicy()) is None
    why = retire_after_batch(USED, ReusePolicy(reuse=False))
    assert why is not None and "STAGETREE_NM_WORKER_REUSE" in why


def test_a_batch_that_left_processes_running_ends_its_worker() -> None:
    why = retire_after_batch(replace(USED, children=2), ReusePolicy())
    assert why == "its batch left 2 process(es) running"


def test_memory_grown_past_the_bound_since_the_first_batch_ends_the_worker() -> None:
    policy = ReusePolicy(max_rss_growth_bytes=100 * MIB)
    assert retire_after_batch(replace(USED, rss_bytes=580 * MIB), policy) is None  # grew by exactly 100 MiB
    why = retire_after_batch(replace(USED, rss_bytes=581 * MIB), policy)
    assert why is not None and "grew by 101 MiB" in why and "STAGETREE_NM_WORKER_MAX_RSS_GROWTH_MB" in why
    assert retire_after_batch(replace(USED, rss_bytes=50_000 * MIB), ReusePolicy(max_rss_growth_bytes=0)) is None


def test_a_waiting_worker_runs_its_own_trainer_and_code_version_only() -> None:
    assert retire_before_batch(USED, T1) is None
    assert retire_before_batch(WorkerView(), T1) is None  # started ahead, nothing imported yet
    other_trainer = retire_before_batch(USED, TrainerKey("pkg.train:Other", "v1"))
    assert other_trainer == "it imported trainer 'pkg.train:Net', the batch runs 'pkg.train:Other'"
    new_code = retire_before_batch(USED, TrainerKey("pkg.train:Net", "v2"))
    assert new_code == "it imported code version 'v1' of the trainer, the batch runs 'v2'"
    assert retire_before_batch(replace(USED, exited=True), T1) == "it exited"


names = st.sampled_from(["a:A", "a:B", "b:A"])
versions = st.sampled_from(["", "v1", "v2"])


@given(have=st.none() | st.builds(TrainerKey, names, versions), needs=st.builds(TrainerKey, names, versions))
def test_a_worker_is_given_a_batch_exactly_when_it_imported_nothing_or_that_code(
    have: TrainerKey | None, needs: TrainerKey
) -> None:
    reused = retire_before_batch(WorkerView(trainer=have), needs) is None
    assert reused == (have is None or have == needs)


@given(
    batches=st.integers(1, 100),
    first=st.integers(0, 10_000),
    now=st.integers(0, 10_000),
    children=st.integers(0, 3),
    bound=st.integers(0, 5_000),
)
def test_a_worker_is_kept_exactly_when_no_rule_ends_it(
    batches: int, first: int, now: int, children: int, bound: int
) -> None:
    view = WorkerView(trainer=T1, batches=batches, rss_bytes=now * MIB, first_rss_bytes=first * MIB, children=children)
    kept = retire_after_batch(view, ReusePolicy(max_rss_growth_bytes=bound * MIB)) is None
    assert kept == (children == 0 and (bound == 0 or now - first <= bound))
