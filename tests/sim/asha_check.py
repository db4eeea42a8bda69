"""A reference ASHA (Li et al., MLSys 2020, Algorithm 2) and the checks of an ASHA run against it: test oracles.

This module owns ``check_asha_trace`` (replay a trace, recompute every get_job() from scratch with a
separate, deliberately naive re-implementation, and list each disagreement and each broken invariant),
``random_asha_run`` (a random, asynchronous ASHA run in the simulator) and ``asha_promotions_ok(seed)``,
which a benchmark can call to check ASHA on many random traces.

The reference keeps no rung objects: rung k is recomputed at every call as the trials with a result at
rung k's step, and "already promoted from rung k" as "already submitted to rung k+1".
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from stagetree.client.spaces import Choice, RandomSearchSpace, TrialConfig, Uniform
from stagetree.client.tuners.asha import ASHA
from stagetree.client.tuners.base import Failed, Finish, Result, Submit
from stagetree.client.tuners.simulate import Run, TraceEntry, simulate


def _ref_steps(min_step: int, max_step: int, eta: int, s: int) -> list[int]:
    top = 0
    while min_step * eta ** (top + 1) <= max_step:
        top += 1
    return [min_step * eta ** (s + k) for k in range(top - s + 1)]


def check_asha_trace(
    trace: Iterable[TraceEntry],
    *,
    metric: str,
    mode: str,
    eta: int,
    min_step: int,
    max_step: int,
    max_concurrent: int,
    max_trials: int,
    early_stopping_rate: int = 0,
) -> list[str]:
    """Every way ``trace`` departs from Algorithm 2 (an empty list: none). ``max_trials`` must not
    exceed the size of the space the run drew from."""
    steps = _ref_steps(min_step, max_step, eta, early_stopping_rate)
    sign = 1.0 if mode == "max" else -1.0
    results: dict[int, dict[int, float]] = {}
    submitted: dict[int, list[int]] = {}
    outstanding: set[int] = set()
    problems: list[str] = []
    finishes = 0

    def value(v: float) -> float:
        return -math.inf if math.isnan(v) else sign * v

    def get_job(subs: dict[int, set[int]], n_new: int) -> tuple[int | None, int] | None:
        for k in range(len(steps) - 2, -1, -1):
            here = [t for t, r in results.items() if steps[k] in r]
            here.sort(key=lambda t: (-results[t][steps[k]], t))
            for t in here[: len(here) // eta]:
                if steps[k + 1] not in subs.get(t, set()):
                    subs.setdefault(t, set()).add(steps[k + 1])
                    return t, steps[k + 1]
        return (None, steps[0]) if n_new < max_trials else None

    for i, (event, actions) in enumerate(trace):
        if isinstance(event, Result) and event.trial_id in outstanding:
            outstanding.discard(event.trial_id)
            results.setdefault(event.trial_id, {})[event.step] = value(float(event.metrics[metric]))
        elif isinstance(event, Failed):
            outstanding.discard(event.trial_id)
        scratch = {t: set(v) for t, v in submitted.items()}
        n_new = len(submitted)
        expected: list[tuple[int | None, int]] = []
        for _ in range(max_concurrent - len(outstanding)):
            job = get_job(scratch, n_new)
            if job is None:
                break
            if job[0] is None:
                n_new += 1
            expected.append(job)
        got = [a for a in actions if isinstance(a, Submit)]
        if len(got) != len(expected):
            problems.append(f"event {i} ({event}): {len(got)} submits, Algorithm 2 gives {len(expected)}")
        for sub, (want, step) in zip(got, expected, strict=False):
            if want is None and (sub.trial_id in submitted or sub.step != step):
                problems.append(f"event {i}: expected a new trial at step {step}, got {sub}")
            if want is not None and (sub.trial_id, sub.step) != (want, step):
                problems.append(f"event {i}: expected to promote trial {want} to step {step}, got {sub}")
        for sub in got:
            if sub.step in submitted.get(sub.trial_id, []):
                problems.append(f"event {i}: trial {sub.trial_id} submitted to step {sub.step} twice")
            if sub.step != steps[0]:
                # The ratio: a promotion to rung k+1 takes a trial ranked in the top |rung k| // eta.
                k = steps.index(sub.step) - 1 if sub.step in steps else -1
                here = sorted(
                    (t for t, r in results.items() if k >= 0 and steps[k] in r),
                    key=lambda t: (-results[t][steps[k]], t),
                )
                if sub.trial_id not in here[: len(here) // eta]:
                    problems.append(f"event {i}: {sub} is not in the top 1/{eta} of the rung below")
            submitted.setdefault(sub.trial_id, []).append(sub.step)
            outstanding.add(sub.trial_id)
        finishes += sum(1 for a in actions if isinstance(a, Finish))
    if finishes != 1:
        problems.append(f"the trace has {finishes} Finish actions, not 1")
    if outstanding:
        problems.append(f"trials {sorted(outstanding)} still outstanding at the end")
    return problems


def random_asha_run(
    seed: int,
    *,
    workers: int = 4,
    eta: int = 3,
    min_step: int = 1,
    max_step: int = 27,
    max_trials: int = 40,
    early_stopping_rate: int = 0,
    mode: str = "max",
    fail_rate: float = 0.0,
    tuner_class: type[ASHA] = ASHA,
) -> tuple[ASHA, Run]:
    """ASHA (or a variant, ``tuner_class``) on a random space with rounded (tie-prone) learning curves,
    random per-trial speeds and, with ``fail_rate``, failures after the bottom rung."""
    space = RandomSearchSpace(
        {
            "quality": Choice([0.2, 0.4, 0.6, 0.8]),
            "rate": Uniform(0.05, 1.0),
            "speed": Uniform(0.2, 3.0),
            "luck": Uniform(0.0, 1.0),
        },
        seed=seed,
    )

    def evaluate(config: TrialConfig, step: int) -> dict[str, float]:
        luck = float(config["luck"].value(0))
        if luck < fail_rate and step > min_step:
            raise RuntimeError("simulated training failure")
        q, r = float(config["quality"].value(0)), float(config["rate"].value(0))
        return {"acc": round(q * (1.0 - math.exp(-r * step)), 1)}

    tuner = tuner_class(
        space,
        metric="acc",
        mode=mode,
        eta=eta,
        min_step=min_step,
        max_step=max_step,
        early_stopping_rate=early_stopping_rate,
        max_concurrent=workers,
        max_trials=max_trials,
    )
    run = simulate(tuner, evaluate, workers=workers, step_time=lambda _, c: float(c["speed"].value(0)))
    return tuner, run


def asha_promotions_ok(
    seed: int,
    *,
    workers: int = 4,
    eta: int = 3,
    min_step: int = 1,
    max_step: int = 27,
    max_trials: int = 40,
    early_stopping_rate: int = 0,
    mode: str = "max",
    fail_rate: float = 0.0,
) -> bool:
    """Whether ASHA's every decision on a random asynchronous run matches the reference."""
    tuner, run = random_asha_run(
        seed,
        workers=workers,
        eta=eta,
        min_step=min_step,
        max_step=max_step,
        max_trials=max_trials,
        early_stopping_rate=early_stopping_rate,
        mode=mode,
        fail_rate=fail_rate,
    )
    problems = check_asha_trace(
        run.trace,
        metric=tuner.metric,
        mode=mode,
        eta=eta,
        min_step=min_step,
        max_step=max_step,
        max_concurrent=workers,
        max_trials=max_trials,
        early_stopping_rate=early_stopping_rate,
    )
    return not problems
