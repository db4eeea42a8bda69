"""HyperDrive's POP (Rasley et al., Middleware 2017) and the policies it was compared with, as pure plug-ins.

POP sorts the live trials of a study into *promising*, *opportunistic* and *poor*:

* **poor** (killed): the metric has not passed the user's ``kill_threshold`` at an evaluation boundary
  (domain knowledge: 15% accuracy on CIFAR-10), or the confidence ``p`` of reaching the target within
  ``T_max`` is below ``p_floor`` (0.05);
* **promising**: the trials with the highest ``p`` that fit in ``S_promising`` slots, where
  ``S_promising = max_p min(S_desired(p), S_deserved(p))``, ``S_desired(p) = k * #{i : p_i >= p}``,
  ``S_deserved(p) = S * p`` (§3.2); they keep their slots;
* **opportunistic**: the rest, which share the remaining slots round robin: at each evaluation boundary
  an opportunistic trial is suspended (checkpoint, slot freed) and the next idle trial runs.

``p`` and the expected remaining time ``ERT`` come from the learning-curve model (``curves.fit_curve``):
``P(m) = P(y(n + m) >= y_target | y(1..n))``, ``p_m = P(m) - P(m - 1)``, ``x = sum_m m p_m`` (Eq. 2),
``ERT = x * epoch`` (Eq. 3), summing only while ``ERT <= T_max - T_pass`` and over at most
``M = (T_max - T_pass) / epoch`` epochs; ``p = sum_m p_m``.

Baselines (§5.3): ``Default`` (greedy, every trial to its last epoch), ``Bandit`` (TuPAQ's action
elimination: at each boundary keep a trial only while ``job_best * (1 + eps) > global_best``, eps = 0.5,
b = 10), ``EarlyTerm`` (Domhan's predictive termination: kill when ``P(y(max_epoch) >= best_so_far) <
delta``, delta = 0.05, b = 30).

Plug-in interface (HyperDrive's up-calls, one object per study; a metric is "higher is better", already
normalized to [0, 1] or given ``y_min``/``y_max`` for HyperDrive's Eq. 4 min-max scaling)::

    policy = search_policy("pop", PopConfig(target=0.77, t_max_s=12 * 3600, kill_threshold=0.15))
    verdict = policy.on_epoch(job, epoch, value, now, epoch_s, waiting)   # ApplicationStat + OnIterationFinish
        # -> Verdict.CONTINUE | Verdict.SUSPEND | Verdict.TERMINATE; ``waiting`` = idle trials that could
        #    take the slot (POP never suspends when nothing waits)
    job = policy.next_job(idle)            # AllocateJobs: which idle trial (new or suspended) gets a free slot
    policy.priority(job)                   # labelJob: the scheduling priority of a trial (None = FIFO)
    policy.restore(policy.snapshot())      # what it learnt as plain JSON data, into a policy of the same config

The master maps SUSPEND to ``Preempt`` (finish the step, save a peripheral checkpoint; the trial's
remaining work re-enters the stage tree from there) and TERMINATE to cancelling the trial's requests.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.curves import CurveFit, fit_curve
from stagetree.core.policies.plain import dec, decs, enc, encs

Predictor = Callable[[Sequence[float], Sequence[float], int], CurveFit]  # (epochs, values in [0, 1], seed)


def default_predictor(xs: Sequence[float], ys: Sequence[float], seed: int) -> CurveFit:
    return fit_curve(xs, ys, seed=seed)


class Verdict(enum.Enum):
    CONTINUE = "continue"
    SUSPEND = "suspend"
    TERMINATE = "terminate"


@dataclass(frozen=True)
class Remaining:
    """POP's estimate for one trial: expected remaining seconds (Eq. 3) and the confidence ``p``."""

    ert_s: float
    confidence: float
    epochs: float  # x of Eq. 2


def expected_remaining(reach: Sequence[float], epoch_s: float, remaining_s: float) -> Remaining:
    """Eq. 1-3. ``reach[m - 1]`` is ``P(target reached by the m-th future epoch)``, ``m = 1..M``.

    ``p_m`` is the increment of that CDF; ``x = sum m p_m``; the sum stops as soon as ``x * epoch_s``
    exceeds ``remaining_s`` (the search will not run longer), and ``ERT`` is then ``remaining_s``.
    """
    if epoch_s <= 0:
        raise InvalidArgument(f"expected_remaining: epoch_s must be > 0, got {epoch_s}")
    x = 0.0
    p = 0.0
    prev = 0.0
    remaining_s = max(remaining_s, 0.0)
    for m, cdf in enumerate(reach, start=1):
        pm = max(cdf - prev, 0.0)
        prev = max(prev, cdf)
        if (x + m * pm) * epoch_s > remaining_s:
            return Remaining(remaining_s, p, remaining_s / epoch_s)
        x += m * pm
        p += pm
    return Remaining(x * epoch_s, p, x)


@dataclass(frozen=True)
class PoolSplit:
    """The dynamic split of §3.2: how many slots the promising pool gets, and at which confidence."""

    promising_slots: int
    threshold: float


def promising_slots(confidences: Sequence[float], slots: int, k: int = 1) -> PoolSplit:
    """``S_promising = max_p min(k * N_satisfying(p), round(S * p))`` over the trials' own ``p`` values.

    ``N_satisfying(p)`` counts trials whose confidence is at least ``p`` (their ERT at confidence ``p`` is
    within ``T_max``); a slot is a whole machine, so the deserved share ``S * p`` is rounded to the
    nearest whole slot. Ties prefer the higher threshold (fewer, surer trials).
    """
    if slots < 0 or k < 1:
        raise InvalidArgument(f"promising_slots: need slots >= 0 and k >= 1, got {slots}, {k}")
    best = PoolSplit(0, 1.0)
    ps = sorted((p for p in confidences if p > 0), reverse=True)
    for i, p in enumerate(ps):
        n_sat = i + 1
        while n_sat < len(ps) and ps[n_sat] >= p:
            n_sat += 1
        eff = min(k * n_sat, math.floor(slots * p + 0.5))
        if eff > best.promising_slots:
            best = PoolSplit(eff, p)
    return best


@dataclass(frozen=True)
class PopConfig:
    """User inputs (§3.1.1, §5.3). ``eval_every`` is the evaluation boundary b in epochs."""

    target: float
    t_max_s: float
    kill_threshold: float
    eval_every: int = 10
    p_floor: float = 0.05
    k: int = 1
    max_epochs: int | None = None
    y_min: float = 0.0
    y_max: float = 1.0

    def __post_init__(self) -> None:
        if self.eval_every < 1 or self.t_max_s <= 0 or self.k < 1 or self.y_max <= self.y_min:
            raise InvalidArgument(f"PopConfig: need eval_every >= 1, t_max_s > 0, k >= 1, y_max > y_min: {self}")

    def norm(self, y: float) -> float:
        return (y - self.y_min) / (self.y_max - self.y_min)


@dataclass(frozen=True)
class IdleJob:
    """A trial waiting for a slot: new (never run) or suspended. ``since`` orders the round robin."""

    id: str
    since: float
    suspended: bool = False


class SearchPolicy(Protocol):
    name: str

    def on_epoch(self, job: str, epoch: int, value: float, now: float, epoch_s: float, waiting: int) -> Verdict: ...

    def next_job(self, idle: Sequence[IdleJob]) -> str | None: ...

    def priority(self, job: str) -> float | None: ...

    def next_decision(self, epoch: int) -> int | None:
        """The first epoch after ``epoch`` whose report may change a trial's verdict (an evaluation
        boundary), or None when none will."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """What the policy learnt so far, as plain JSON data (its config is not in it)."""
        ...

    def restore(self, data: Mapping[str, Any]) -> None:
        """Take over a ``snapshot`` of a policy of the same config: from then on this one decides as that
        one would have."""
        ...


def _next_boundary(epoch: int, every: int, last: int | None) -> int | None:
    """The first multiple of ``every`` after ``epoch``; None from ``last`` on (no verdict at or after it)."""
    nxt = (epoch // every + 1) * every
    return None if last is not None and nxt >= last else nxt


def _fifo(idle: Sequence[IdleJob]) -> str | None:
    return min(idle, key=lambda j: (j.since, j.id)).id if idle else None


@dataclass
class _History:
    epochs: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    best: float = -math.inf

    def snapshot(self) -> dict[str, Any]:
        return {"epochs": encs(self.epochs), "values": encs(self.values), "best": enc(self.best)}

    @classmethod
    def restore(cls, data: Mapping[str, Any]) -> _History:
        return cls(decs(data["epochs"]), decs(data["values"]), dec(data["best"]))


class Default:
    """Greedy: idle trials go to idle machines in arrival order and run to their last epoch."""

    name = "default"

    def __init__(self, max_epochs: int | None = None) -> None:
        self.max_epochs = max_epochs

    def on_epoch(self, job: str, epoch: int, value: float, now: float, epoch_s: float, waiting: int) -> Verdict:
        return Verdict.CONTINUE

    def next_job(self, idle: Sequence[IdleJob]) -> str | None:
        return _fifo(idle)

    def priority(self, job: str) -> float | None:
        return None

    def next_decision(self, epoch: int) -> int | None:
        return None

    def snapshot(self) -> dict[str, Any]:
        return {}

    def restore(self, data: Mapping[str, Any]) -> None:
        pass


class Bandit(Default):
    """TuPAQ's action elimination (§5.3): at every ``eval_every`` epochs keep a trial only while
    ``job_best * (1 + eps) > global_best``."""

    name = "bandit"

    def __init__(self, eps: float = 0.5, eval_every: int = 10) -> None:
        super().__init__()
        self.eps = eps
        self.eval_every = eval_every
        self.job_best: dict[str, float] = {}
        self.global_best = -math.inf

    def on_epoch(self, job: str, epoch: int, value: float, now: float, epoch_s: float, waiting: int) -> Verdict:
        best = max(self.job_best.get(job, -math.inf), value)
        self.job_best[job] = best
        self.global_best = max(self.global_best, best)
        if epoch % self.eval_every == 0 and not best * (1.0 + self.eps) > self.global_best:
            return Verdict.TERMINATE
        return Verdict.CONTINUE

    def next_decision(self, epoch: int) -> int | None:
        return _next_boundary(epoch, self.eval_every, None)

    def snapshot(self) -> dict[str, Any]:
        return {"job_best": {j: enc(v) for j, v in self.job_best.items()}, "global_best": enc(self.global_best)}

    def restore(self, data: Mapping[str, Any]) -> None:
        self.job_best = {j: dec(v) for j, v in data["job_best"].items()}
        self.global_best = dec(data["global_best"])


class EarlyTerm(Default):
    """Domhan et al.'s predictive termination (§5.3): at every ``eval_every`` epochs kill a trial when
    ``P(y(max_epochs) >= best seen so far | its curve) < delta``."""

    name = "earlyterm"

    def __init__(
        self,
        max_epochs: int,
        delta: float = 0.05,
        eval_every: int = 30,
        predictor: Predictor = default_predictor,
        y_min: float = 0.0,
        y_max: float = 1.0,
    ) -> None:
        super().__init__(max_epochs)
        self.delta = delta
        self.eval_every = eval_every
        self.predictor = predictor
        self.y_min, self.y_max = y_min, y_max
        self.hist: dict[str, _History] = {}
        self.global_best = -math.inf
        self.predictions = 0

    def on_epoch(self, job: str, epoch: int, value: float, now: float, epoch_s: float, waiting: int) -> Verdict:
        h = self.hist.setdefault(job, _History())
        h.epochs.append(float(epoch))
        h.values.append((value - self.y_min) / (self.y_max - self.y_min))
        h.best = max(h.best, value)
        self.global_best = max(self.global_best, value)
        if epoch % self.eval_every or (self.max_epochs is not None and epoch >= self.max_epochs):
            return Verdict.CONTINUE
        self.predictions += 1
        fit = self.predictor(h.epochs, h.values, _seed(job, epoch))
        best = (self.global_best - self.y_min) / (self.y_max - self.y_min)
        assert self.max_epochs is not None
        if fit.prob_at_least(best, float(self.max_epochs)) < self.delta:
            return Verdict.TERMINATE
        return Verdict.CONTINUE

    def next_decision(self, epoch: int) -> int | None:
        return _next_boundary(epoch, self.eval_every, self.max_epochs)

    def snapshot(self) -> dict[str, Any]:
        return {
            "hist": {j: h.snapshot() for j, h in self.hist.items()},
            "global_best": enc(self.global_best),
            "predictions": self.predictions,
        }

    def restore(self, data: Mapping[str, Any]) -> None:
        self.hist = {j: _History.restore(h) for j, h in data["hist"].items()}
        self.global_best = dec(data["global_best"])
        self.predictions = int(data["predictions"])


def _seed(job: str, epoch: int) -> int:
    """A stable per-(trial, epoch) seed (``hash`` of a str is salted per process, so not that)."""
    h = 1469598103934665603
    for ch in f"{job}:{epoch}":
        h = ((h ^ ord(ch)) * 1099511628211) % (1 << 63)
    return h


@dataclass
class _PopJob:
    hist: _History = field(default_factory=_History)
    estimate: Remaining | None = None


class Pop:
    """POP (§3, §5.3): classification at evaluation boundaries, dynamic pools, kills, round robin."""

    name = "pop"

    def __init__(self, config: PopConfig, slots: int, predictor: Predictor = default_predictor) -> None:
        if slots < 1:
            raise InvalidArgument(f"Pop: slots must be >= 1, got {slots}")
        self.cfg = config
        self.slots = slots
        self.predictor = predictor
        self.jobs: dict[str, _PopJob] = {}
        self.dead: set[str] = set()
        self.promising: dict[str, float] = {}  # job -> p, the trials holding promising slots
        self.split = PoolSplit(0, 1.0)
        self.predictions = 0

    def estimate(self, job: str, now: float, epoch_s: float) -> Remaining:
        """Eq. 1-3 for ``job`` from its curve so far."""
        cfg = self.cfg
        h = self.jobs[job].hist
        n = int(h.epochs[-1])
        remaining_s = max(cfg.t_max_s - now, 0.0)
        horizon = int(remaining_s // epoch_s)
        if cfg.max_epochs is not None:
            horizon = min(horizon, cfg.max_epochs - n)
        if horizon < 1:
            return Remaining(remaining_s, 0.0, 0.0)
        self.predictions += 1
        fit = self.predictor(h.epochs, h.values, _seed(job, n))
        reach = fit.prob_reached(cfg.norm(cfg.target), [float(n + m) for m in range(1, horizon + 1)])
        return expected_remaining(reach, epoch_s, remaining_s)

    def reclassify(self) -> None:
        """The promising pool from the latest confidences of every live trial."""
        live = {j: pj.estimate.confidence for j, pj in self.jobs.items() if j not in self.dead and pj.estimate}
        self.split = promising_slots(list(live.values()), self.slots, self.cfg.k)
        ranked = sorted((j for j, p in live.items() if p >= self.split.threshold), key=lambda j: (-live[j], j))
        self.promising = {j: live[j] for j in ranked[: self.split.promising_slots]}

    def kill(self, job: str) -> Verdict:
        self.dead.add(job)
        self.promising.pop(job, None)
        return Verdict.TERMINATE

    def on_epoch(self, job: str, epoch: int, value: float, now: float, epoch_s: float, waiting: int) -> Verdict:
        cfg = self.cfg
        pj = self.jobs.setdefault(job, _PopJob())
        h = pj.hist
        h.epochs.append(float(epoch))
        h.values.append(cfg.norm(value))
        h.best = max(h.best, value)
        if epoch % cfg.eval_every or (cfg.max_epochs is not None and epoch >= cfg.max_epochs):
            return Verdict.CONTINUE
        if h.best < cfg.kill_threshold:
            return self.kill(job)
        pj.estimate = self.estimate(job, now, epoch_s)
        if pj.estimate.confidence < cfg.p_floor:
            return self.kill(job)
        self.reclassify()
        if job in self.promising or waiting == 0:
            return Verdict.CONTINUE
        return Verdict.SUSPEND

    def next_job(self, idle: Sequence[IdleJob]) -> str | None:
        """Promising trials first (highest ``p``), then the opportunistic round robin (longest idle first)."""
        live = [j for j in idle if j.id not in self.dead]
        if not live:
            return None
        promising = [j for j in live if j.id in self.promising]
        if promising:
            return min(promising, key=lambda j: (-self.promising[j.id], j.id)).id
        return _fifo(live)

    def priority(self, job: str) -> float | None:
        return self.promising.get(job)

    def next_decision(self, epoch: int) -> int | None:
        return _next_boundary(epoch, self.cfg.eval_every, self.cfg.max_epochs)

    def classes(self) -> Mapping[str, str]:
        """Every trial seen so far: ``promising``, ``opportunistic`` or ``poor``."""
        return {
            j: "poor" if j in self.dead else "promising" if j in self.promising else "opportunistic" for j in self.jobs
        }

    def snapshot(self) -> dict[str, Any]:
        """``slots`` (the cluster's size when the study began), each trial's curve and latest estimate
        (``[ERT s, p, x]``), the killed trials, the promising pool and its split."""
        return {
            "slots": self.slots,
            "jobs": {
                j: {
                    "hist": pj.hist.snapshot(),
                    "estimate": None
                    if pj.estimate is None
                    else encs((pj.estimate.ert_s, pj.estimate.confidence, pj.estimate.epochs)),
                }
                for j, pj in self.jobs.items()
            },
            "dead": sorted(self.dead),
            "promising": {j: enc(p) for j, p in self.promising.items()},
            "split": [self.split.promising_slots, enc(self.split.threshold)],
            "predictions": self.predictions,
        }

    def restore(self, data: Mapping[str, Any]) -> None:
        self.slots = int(data["slots"])
        self.jobs = {
            j: _PopJob(_History.restore(d["hist"]), None if d["estimate"] is None else Remaining(*decs(d["estimate"])))
            for j, d in data["jobs"].items()
        }
        self.dead = set(data["dead"])
        self.promising = {j: dec(p) for j, p in data["promising"].items()}
        self.split = PoolSplit(int(data["split"][0]), dec(data["split"][1]))
        self.predictions = int(data["predictions"])


def _earlyterm(config: PopConfig, slots: int, predictor: Predictor) -> SearchPolicy:
    if config.max_epochs is None:
        raise InvalidArgument("search_policy: earlyterm needs PopConfig.max_epochs (the epoch it predicts)")
    return EarlyTerm(config.max_epochs, predictor=predictor, y_min=config.y_min, y_max=config.y_max)


SEARCH_POLICIES: Mapping[str, Callable[[PopConfig, int, Predictor], SearchPolicy]] = {
    Default.name: lambda c, s, p: Default(c.max_epochs),
    Bandit.name: lambda c, s, p: Bandit(),
    EarlyTerm.name: _earlyterm,
    Pop.name: Pop,
}


def search_policy(name: str, config: PopConfig, slots: int, predictor: Predictor = default_predictor) -> SearchPolicy:
    """A fresh policy by name; the baselines take what they need from ``config`` (max epochs, scaling)."""
    factory = SEARCH_POLICIES.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown search policy {name!r}; known: {sorted(SEARCH_POLICIES)}")
    return factory(config, slots, predictor)
