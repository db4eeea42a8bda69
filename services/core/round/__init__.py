"""One scheduling round as a pure function: ``plan_round(RoundInput) -> RoundDecision``.

The master's loop (read, ``plan_round``, apply) and the simulator call this same function; nothing in
it reads a clock, a database or a random source, and it never changes its input. Per round::

    learn     the running trials' new reports feed the policies that learn (Hermes' quanta, POP's
              verdicts: kill a trial, suspend its batch)                              round.learn
    batch     each plan's stage forest is cut into batches in its order policy's order
              (critical path by default), lazily where no study of the plan reorders   round.work
    order     within a study: its order steps (GENIE's allowance, POP's promising trials, Hermes'
              score, longest first for decreasing packing); across studies: the fewest slots held by
              the owner, then the study (a fair share), after GENIE's tier when a study has a class
                                                                                      round.order
    place     each study's place step: first fit with the lookahead (the default), Hermes' device
              cap, HyperSack's packing; n slots of one node manager for a batch that takes n
                                                                                      round.place
    preempt   Hermes' node scheduler over the time-sharing studies' busy slots, and the search
              policies' suspensions                                                  round.learn

Studies with different policies share one round: each study's work goes through the steps its
policies select (``steps_for``), and the lookahead (busy slots about to free, soonest first) is
offered to the work whose place step allows it. The decision also carries the checkpoints to evict
when the catalog is over its budget, the plans no node manager can run (and why), when the next
round is due without an event (``wake_at``: a busy slot coming within the lookahead of its end, a
time-sharing quantum's end, a search trial's next evaluation boundary) and the policies' next state.
"""

from stagetree.core.round.model import (
    BusySlot,
    CheckpointBudget,
    Dispatch,
    PlanWork,
    Report,
    RoundDecision,
    RoundInput,
    RoundSettings,
    RunningAttempt,
)
from stagetree.core.round.plan import StudySteps, plan_round, steps_for

__all__ = [
    "BusySlot",
    "CheckpointBudget",
    "Dispatch",
    "PlanWork",
    "Report",
    "RoundDecision",
    "RoundInput",
    "RoundSettings",
    "RunningAttempt",
    "StudySteps",
    "plan_round",
    "steps_for",
]
