"""The pure rules of a batch attempt's end (``core.lifecycle.end_attempt``), property-tested."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stagetree.core.lifecycle import (
    MAX_ERROR_CHARS,
    AttemptEnd,
    BatchHead,
    BatchState,
    CarriedRequest,
    Outcome,
    RequestState,
    RetryPolicy,
    after,
    end_attempt,
    failure_text,
)

outcomes = st.sampled_from(list(Outcome))
carried_lists = st.lists(
    st.builds(CarriedRequest, st.integers(1, 10_000), st.integers(0, 5), st.booleans()),
    max_size=8,
    unique_by=lambda r: r.id,
)
policies = st.builds(RetryPolicy, st.integers(1, 5))


@given(outcomes, carried_lists, policies, st.text(max_size=50))
def test_every_carried_request_is_failed_or_requeued_exactly_once(
    outcome: Outcome, carried: list[CarriedRequest], policy: RetryPolicy, error: str
) -> None:
    d = end_attempt(BatchHead(2, BatchState.RUNNING), AttemptEnd(7, 2, outcome, error), carried, policy)
    assert not d.stale and d.batch_state is outcome.batch_state()
    assert sorted(d.failed + d.requeued) == sorted(r.id for r in carried)
    assert not set(d.failed) & set(d.requeued)
    if outcome.counts_as_failure():
        assert sorted(d.counted) == sorted(r.id for r in carried) and d.error
        final = outcome is Outcome.USER_ERROR  # the user's code raised: a retry would raise again
        assert set(d.failed) == {
            r.id for r in carried if r.failures + 1 >= policy.max_failures or (final and not r.retry_user_errors)
        }
    else:
        assert d.failed == d.counted == ()
        assert d.exclude_host == (outcome is Outcome.HOST_PROBLEM) and bool(d.error) == d.exclude_host


@given(outcomes, carried_lists, policies, st.sampled_from(list(BatchState)), st.integers(1, 4))
def test_an_end_of_an_attempt_that_is_not_the_running_one_changes_nothing(
    outcome: Outcome, carried: list[CarriedRequest], policy: RetryPolicy, state: BatchState, attempt: int
) -> None:
    head = BatchHead(attempt, state)
    for end in (AttemptEnd(1, attempt + 1, outcome), AttemptEnd(1, attempt, outcome)):
        d = end_attempt(head, end, carried, policy)
        if state is BatchState.RUNNING and end.attempt == attempt:
            continue
        assert d.stale and d.failed == d.requeued == d.counted == () and d.batch_state is None
        assert after(head, d) == head
    assert end_attempt(None, AttemptEnd(1, 1, outcome), carried, policy).stale


@given(outcomes, outcomes, carried_lists, policies)
def test_a_second_end_of_the_same_attempt_is_stale(
    first: Outcome, second: Outcome, carried: list[CarriedRequest], policy: RetryPolicy
) -> None:
    head = BatchHead(1, BatchState.RUNNING)
    d1 = end_attempt(head, AttemptEnd(3, 1, first), carried, policy)
    assert after(head, d1) == BatchHead(1, first.batch_state())
    assert end_attempt(after(head, d1), AttemptEnd(3, 1, second), carried, policy).stale


def test_a_preemption_a_loss_and_an_abort_cost_no_retry() -> None:
    carried = [CarriedRequest(1, failures=2)]
    for outcome in (Outcome.PREEMPTED, Outcome.LOST, Outcome.ABORTED, Outcome.SUCCEEDED):
        d = end_attempt(BatchHead(1, BatchState.RUNNING), AttemptEnd(5, 1, outcome), carried, RetryPolicy(3))
        assert d.requeued == (1,) and d.failed == () and d.counted == ()


def test_the_last_allowed_failure_fails_the_request_with_the_error() -> None:
    head = BatchHead(1, BatchState.RUNNING)
    d = end_attempt(
        head, AttemptEnd(5, 1, Outcome.FAILED, "boom"), [CarriedRequest(1, 2), CarriedRequest(2, 0)], RetryPolicy(3)
    )
    assert (d.failed, d.requeued, d.error, d.batch_state) == ((1,), (2,), "boom", BatchState.FAILED)


def test_failure_text_names_out_of_memory_and_keeps_the_tail() -> None:
    assert failure_text(Outcome.OUT_OF_MEMORY, "CUDA") == "out of memory: CUDA"
    assert failure_text(Outcome.OUT_OF_MEMORY, "") == "out of memory"
    assert failure_text(Outcome.FAILED, "") == "the batch failed"
    long = "x" * (MAX_ERROR_CHARS + 10) + "END\x00"
    assert (
        failure_text(Outcome.FAILED, long).endswith("END")
        and len(failure_text(Outcome.FAILED, long)) == MAX_ERROR_CHARS
    )


def test_states_answer_their_questions() -> None:
    assert {s for s in RequestState if s.is_finished()} == {
        RequestState.DONE,
        RequestState.CANCELLED,
        RequestState.FAILED,
    }
    assert all(s.is_live() != s.is_finished() for s in RequestState)
    assert [s for s in BatchState if not s.is_finished()] == [BatchState.RUNNING]
    assert Outcome.of_report(True, preempted=True, oom=True) is Outcome.SUCCEEDED
    assert Outcome.of_report(False, preempted=True, oom=True) is Outcome.PREEMPTED
    assert Outcome.of_report(False, oom=True) is Outcome.OUT_OF_MEMORY
    assert Outcome.of_report(False) is Outcome.FAILED
    assert Outcome.of_report(False, host_problem=True, user_error=True) is Outcome.HOST_PROBLEM
    assert Outcome.of_report(False, oom=True, host_problem=True) is Outcome.OUT_OF_MEMORY


def test_a_host_that_cannot_import_the_trainer_costs_no_retry_and_is_excluded_with_its_reason() -> None:
    carried = [CarriedRequest(1, failures=2), CarriedRequest(2, retry_user_errors=True)]
    end = AttemptEnd(5, 1, Outcome.HOST_PROBLEM, "ModuleNotFoundError: no module named 'mine'")
    d = end_attempt(BatchHead(1, BatchState.RUNNING), end, carried, RetryPolicy(3))
    assert (d.requeued, d.failed, d.counted) == ((1, 2), (), ())
    assert d.exclude_host and d.error == "ModuleNotFoundError: no module named 'mine'"
    assert d.batch_state is BatchState.FAILED


@given(carried_lists, policies)
def test_a_user_error_fails_its_requests_at_once_unless_their_study_retries_them(
    carried: list[CarriedRequest], policy: RetryPolicy
) -> None:
    head = BatchHead(1, BatchState.RUNNING)
    d = end_attempt(head, AttemptEnd(3, 1, Outcome.USER_ERROR, "ValueError: bad"), carried, policy)
    assert set(d.failed) == {r.id for r in carried if not r.retry_user_errors or r.failures + 1 >= policy.max_failures}
    # what a retry can cure keeps its retries
    d = end_attempt(head, AttemptEnd(3, 1, Outcome.FAILED, "worker killed by SIGKILL"), carried, policy)
    assert set(d.failed) == {r.id for r in carried if r.failures + 1 >= policy.max_failures}


def test_a_long_error_keeps_what_was_raised_and_where() -> None:
    tb = "RuntimeError: exploded\n" + "".join(f'  File "t.py", line {i}, in f{i}\n' for i in range(400))
    text = failure_text(Outcome.USER_ERROR, tb)
    assert (
        len(text) <= MAX_ERROR_CHARS and text.startswith("RuntimeError: exploded\n...") and text.endswith("in f399\n")
    )
