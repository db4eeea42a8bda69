"""A trainer's text log lines in the worker runtime: ``log_text`` becomes ``log_line`` events, numbered in
the attempt, at the step the batch stood at, bounded (``core.loglines``), none lost to a finish, a
preemption or a failure; and the bounds keep a direct report far below gRPC's 4 MiB."""

from __future__ import annotations

from typing import Any

from stagetree.bus.messages import encode_many
from stagetree.core.loglines import CUT_MARK, MAX_LINE_CHARS, MAX_LINES, lines_of
from stagetree.nodemanager.examples.digits import DigitsMLP, digits_batch
from stagetree.nodemanager.examples.faults import ENTRY_POINT as FAULTY
from stagetree.nodemanager.examples.faults import FaultyDigits
from stagetree.nodemanager.reporting import AttemptInfo, message_of
from stagetree.nodemanager.runtime.executor import run_batch
from stagetree.nodemanager.runtime.trainer import StepMetrics

HP: dict[str, Any] = {"lr": 0.1, "momentum": 0.9, "bs": 16}
GRPC_LIMIT = 4 * 1024 * 1024  # grpc's default max_receive_message_length, the master's


def _lines(events: Any) -> list[tuple[int, int, int, str]]:
    return [(p["seq"], p["node"], p["step"], p["line"]) for p in events.of("log_line")]


def test_lines_are_numbered_in_the_attempt_at_the_step_they_were_logged_across_stages(store, make_events) -> None:
    events = make_events()
    spec = digits_batch([(1, 0, 4, HP), (2, 4, 6, {**HP, "lr": 0.05})], fixed_values={"log_every": 2})
    assert run_batch(spec, DigitsMLP, store, events).status == "finished"
    got = _lines(events)
    assert [(seq, node, step) for seq, node, step, _ in got] == [(0, 1, 2), (1, 1, 4), (2, 2, 6)]
    assert all(line.startswith(f"step {step} train_loss ") for _, _, step, line in got)
    kinds = events.kinds()
    assert max(i for i, k in enumerate(kinds) if k == "log_line") < kinds.index("batch_timing")
    assert all(p["batch_id"] == 1 and p["attempt"] == 1 and p["at"] > 0 for p in events.of("log_line"))


class Chatty(DigitsMLP):
    """Logs in ``init`` and in ``evaluate``, ``per_step`` lines every step, and odd text."""

    per_step = 3

    def init(self) -> None:
        super().init()
        self.log_text("built")

    def train(self) -> StepMetrics | None:
        for i in range(self.per_step):
            self.log_text(f"s{self.step + 1}.{i}")
        return super().train()

    def evaluate(self) -> dict[str, float]:
        self.log_text("two\nlines")
        return super().evaluate()


def test_an_attempt_keeps_at_most_max_lines_the_last_saying_how_many_more(store, make_events) -> None:
    events = make_events()
    steps = 100  # 1 + 300 + 2 lines logged, past MAX_LINES
    spec = digits_batch([(1, 0, steps, HP)], evals=[(1, 1)])
    assert run_batch(spec, Chatty, store, events).status == "finished"
    got = _lines(events)
    assert [seq for seq, *_ in got] == list(range(MAX_LINES))
    assert [line for *_, line in got[:6]] == ["built", "s1.0", "s1.1", "s1.2", "two", "lines"]
    assert got[0][2] == 0 and got[1][2] == 1  # init's line at the start step, the first step's at step 1
    logged = 1 + Chatty.per_step * steps + 2
    assert got[-1][3] == f"[stagetree] {logged - (MAX_LINES - 1)} more log lines of this batch attempt not kept " + (
        f"(at most {MAX_LINES} are kept)"
    )


class Exact(DigitsMLP):
    def train(self) -> StepMetrics | None:
        self.log_text(f"line {self.step}")
        return super().train()


def test_an_attempt_that_logs_exactly_max_lines_keeps_them_all(store, make_events) -> None:
    events = make_events()
    assert run_batch(digits_batch([(1, 0, MAX_LINES, HP)]), Exact, store, events).status == "finished"
    assert [line for *_, line in _lines(events)] == [f"line {s}" for s in range(MAX_LINES)]


def test_the_lines_before_a_failure_are_reported_ahead_of_it(store, make_events) -> None:
    events = make_events()
    fixed = {"fault": "raise", "fault_step": 3, "log_every": 1}
    spec = digits_batch([(1, 0, 10, HP)], trainer=FAULTY, fixed_values=fixed)
    assert run_batch(spec, FaultyDigits, store, events).status == "failed"
    assert [step for _, _, step, _ in _lines(events)] == [1, 2, 3]
    kinds = events.kinds()
    assert max(i for i, k in enumerate(kinds) if k == "log_line") < kinds.index("batch_failed")


def test_a_preempted_attempt_reports_its_lines_ahead_of_its_end(store, make_events) -> None:
    events = make_events()
    spec = digits_batch([(1, 0, 10, HP)], fixed_values={"log_every": 1})
    seen = iter(range(100))
    outcome = run_batch(spec, DigitsMLP, store, events, should_preempt=lambda: next(seen) >= 3)
    assert outcome.status == "preempted"
    assert [step for _, _, step, _ in _lines(events)] == list(range(1, outcome.step + 1))
    kinds = events.kinds()
    assert max(i for i, k in enumerate(kinds) if k == "log_line") < kinds.index("batch_preempted")


def test_text_becomes_storable_lines_within_the_length_bound() -> None:
    assert lines_of("a\nb\r\nc\n") == ["a", "b", "c"]
    assert lines_of("") == [""] and lines_of(3.5) == ["3.5"]
    assert lines_of("nul\x00here") == ["nul\ufffdhere"]  # PostgreSQL refuses NUL
    assert lines_of("lone \ud800") == ["lone \ufffd"]  # UTF-8 cannot hold a lone surrogate
    (long,) = lines_of("x" * (MAX_LINE_CHARS + 500))
    assert len(long) == MAX_LINE_CHARS and long.endswith(CUT_MARK)
    assert lines_of("x" * MAX_LINE_CHARS) == ["x" * MAX_LINE_CHARS]


def test_an_attempts_lines_at_their_bounds_keep_a_direct_report_well_under_grpcs_limit() -> None:
    """The worst case: MAX_LINES lines of MAX_LINE_CHARS control characters (six bytes each in JSON), as the
    messages a direct report carries."""
    info = AttemptInfo(batch_id=2**62, attempt=9, plan_key="p" * 32)
    worst = "\x01" * MAX_LINE_CHARS
    assert lines_of(worst) == [worst]
    msgs = [
        message_of(
            "nm-" + "n" * 60,
            f"nm-{'n' * 60}:{2**62}:9:{seq}",
            info,
            "log_line",
            {"seq": seq, "node": 2**62, "step": 2**31 - 1, "at": 1.7e9, "line": worst},
        )
        for seq in range(MAX_LINES)
    ]
    size = sum(len(r) for r in encode_many(msgs))
    assert size < GRPC_LIMIT // 3, size
