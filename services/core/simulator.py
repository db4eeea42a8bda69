"""Discrete-event simulation of W workers running the real scheduler against a request stream.

The simulator owns a core ``SearchPlan`` and calls the same ``build_stage_tree`` and
``schedule_round`` the master calls; only time is simulated. Workers load a batch's source checkpoint
(``load_s``), train its steps (``step_time(config, step)`` seconds each), evaluate where requests wait
(``eval_s``) and save checkpoints in the background (available ``save_s`` after the worker passes the
point). With ``snapshots``, a batch also leaves a checkpoint at every step it trained, available
``save_s`` after it ends (the runtime's in-memory snapshots of a small model, written as one pack at the
batch's end). A *driver* plays the tuner: it issues requests and reacts to results (grid, SHA, ASHA over
synthetic learning curves are provided). The report gives makespan, worker-seconds and executed versus
unique steps, so ordering policies can be compared at cluster scale on one CPU.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stagetree.core.batch import Point
from stagetree.core.config import Config
from stagetree.core.lifecycle import RequestState
from stagetree.core.scheduler import PlannedBatch, StageCost, schedule_round
from stagetree.core.searchplan import Checkpoint, SearchPlan
from stagetree.core.slots import Slot
from stagetree.core.stagetree import InflightBatch, InflightStage, Stage, build_stage_tree

StepTime = Callable[[Config, int], float]


def unit_step_time(config: Config, step: int) -> float:
    return 1.0


# ---------------------------------------------------------------------------------------------
# Drivers (tuner-like request streams)


@dataclass(frozen=True)
class Ask:
    """A driver's request: train ``config`` to ``step``; ``tag`` comes back with the result."""

    tag: Any
    config: Config
    step: int


class Driver(Protocol):
    def start(self) -> list[Ask]: ...

    def on_result(self, tag: Any, step: int, metrics: dict[str, float]) -> list[Ask]: ...


Curve = Callable[[Config, int], float]


def synthetic_curve(seed: int = 0) -> Curve:
    """A loss curve per config: decays toward a config-specific floor; deterministic in (config, step)."""

    def curve(config: Config, step: int) -> float:
        rng = random.Random(f"{seed}:{config.digest()}")
        floor = rng.uniform(0.05, 0.6)
        rate = rng.uniform(0.01, 0.08)
        return floor + (1.0 - floor) * math.exp(-rate * step)

    return curve


class GridDriver:
    """Every config to ``max_step`` at once (optionally with intermediate evaluations)."""

    def __init__(self, configs: Sequence[Config], max_step: int, evals: Sequence[int] = ()) -> None:
        self.configs = list(configs)
        self.max_step = max_step
        self.evals = sorted(set(evals) | {max_step})

    def start(self) -> list[Ask]:
        return [Ask((i, s), c, s) for i, c in enumerate(self.configs) for s in self.evals]

    def on_result(self, tag: Any, step: int, metrics: dict[str, float]) -> list[Ask]:
        return []


class ASHADriver:
    """Asynchronous successive halving (Li et al., MLSys 2020, Algorithm 2) over a config list.

    Keeps ``concurrency`` jobs outstanding; each free job goes to the highest rung with a promotable
    config (top 1/eta of its rung, not yet promoted), else a new config enters rung 0.
    """

    def __init__(
        self,
        configs: Sequence[Config],
        min_step: int,
        eta: int,
        max_step: int,
        concurrency: int,
        curve: Curve,
    ) -> None:
        self.configs = list(configs)
        self.eta = eta
        self.curve = curve
        self.rungs: list[int] = []
        r = min_step
        while r <= max_step:
            self.rungs.append(r)
            r *= eta
        self.results: list[dict[int, float]] = [{} for _ in self.rungs]
        self.promoted: list[set[int]] = [set() for _ in self.rungs]
        self.next_config = 0
        self.concurrency = concurrency

    def _job(self) -> Ask | None:
        for k in range(len(self.rungs) - 2, -1, -1):
            done = self.results[k]
            top = sorted(done, key=lambda i: (done[i], i))[: len(done) // self.eta]
            for i in top:
                if i not in self.promoted[k]:
                    self.promoted[k].add(i)
                    return Ask((i, k + 1), self.configs[i], self.rungs[k + 1])
        if self.next_config < len(self.configs):
            i = self.next_config
            self.next_config += 1
            return Ask((i, 0), self.configs[i], self.rungs[0])
        return None

    def _fill(self, n: int) -> list[Ask]:
        out = []
        for _ in range(n):
            job = self._job()
            if job is None:
                break
            out.append(job)
        return out

    def start(self) -> list[Ask]:
        return self._fill(self.concurrency)

    def on_result(self, tag: Any, step: int, metrics: dict[str, float]) -> list[Ask]:
        i, k = tag
        self.results[k][i] = metrics["loss"]
        return self._fill(1)


# ---------------------------------------------------------------------------------------------
# The simulation


def plan_boundaries(plan: SearchPlan, cache: dict[str, Any]) -> list[int]:
    """Every step where some config of the plan starts a new piece, sorted; the places where trials
    of one search space branch. ``cache`` keeps the work incremental as the plan grows."""
    seen: set[int] = cache.setdefault("steps", set())
    done: int = cache.get("nodes", 0)
    if done < len(plan.nodes):
        for node in list(plan.nodes.values())[done:]:
            for _, segs in node.config.items:
                seen.update(seg.start for seg in segs if seg.start > 0)
        cache["nodes"] = len(plan.nodes)
        cache["sorted"] = sorted(seen)
    out: list[int] = cache.get("sorted", [])
    return out


@dataclass
class SimReport:
    policy: str
    workers: int
    makespan: float
    worker_seconds: float
    executed_steps: int
    unique_steps: int
    requested_steps: int
    requests: int
    served: int
    rounds: int
    duplicate_steps: int
    critical_path: float
    work: float
    lower_bound: float

    @property
    def merge_rate(self) -> float:
        return self.requested_steps / self.unique_steps if self.unique_steps else 1.0

    @property
    def vs_lower_bound(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound else 1.0


@dataclass
class _Running:
    id: int
    slot: Slot
    batch: PlannedBatch
    started: float
    first_step_at: float
    # (node, start, end, time the stage starts training)
    timeline: list[tuple[int, int, int, float]] = field(default_factory=list)
    end_time: float = 0.0
    requests: set[int] = field(default_factory=set)


class Simulator:
    def __init__(
        self,
        driver: Driver,
        workers: int,
        policy: str = "critical_path",
        step_time: StepTime = unit_step_time,
        curve: Curve | None = None,
        load_s: float = 0.0,
        save_s: float = 0.0,
        eval_s: float = 0.0,
        decision_cost: StageCost | None = None,
        snapshots: bool = False,
        boundaries: bool = True,
    ) -> None:
        self.driver = driver
        self.snapshots = snapshots
        self.use_boundaries = boundaries
        self.plan = SearchPlan("sim")
        self.slots = [Slot(f"w{i}") for i in range(workers)]
        self.policy = policy
        self.step_time = step_time
        self.curve = curve or synthetic_curve()
        self.load_s, self.save_s, self.eval_s = load_s, save_s, eval_s
        # what the scheduler believes a stage costs: by default the true cost (an oracle); a platform
        # that does not know each step's cost is simulated by passing its estimate (e.g. steps_cost())
        self.decision_cost: StageCost = decision_cost or self._cost
        self.now = 0.0
        self.events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._batch_ids = itertools.count(1)
        self.running: dict[int, _Running] = {}
        self.free: list[Slot] = list(self.slots)
        self.tags: dict[int, Any] = {}  # request id -> driver tag
        self.arrival: dict[int, float] = {}
        self.executed: list[tuple[int, int, int]] = []
        self.worker_seconds = 0.0
        self.rounds = 0
        self.served = 0
        self.requested_steps = 0
        self.all_points: list[Point] = []
        self.point_arrivals: list[tuple[Point, float]] = []
        self.stage_cost_cache: dict[tuple[int, int, int], float] = {}
        self._boundary_cache: dict[str, Any] = {}

    # -- helpers -----------------------------------------------------------------------------

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, payload))

    def _train_time(self, node: int, a: int, b: int) -> float:
        key = (node, a, b)
        cached = self.stage_cost_cache.get(key)
        if cached is None:
            cfg = self.plan.nodes[node].config
            st = self.step_time
            cached = sum(st(cfg, s) for s in range(a, b))
            self.stage_cost_cache[key] = cached
        return cached

    def _boundaries(self, node: int, start: int, end: int) -> list[int]:
        return [b for b in plan_boundaries(self.plan, self._boundary_cache) if start < b < end]

    def _cost(self, stage: Stage) -> float:
        return self._train_time(stage.node, stage.start, stage.end)

    def _submit(self, asks: Sequence[Ask]) -> None:
        for ask in asks:
            res = self.plan.add_request(ask.config, ask.step)
            self.requested_steps += ask.step
            self.all_points.append(res.point)
            self.point_arrivals.append((res.point, self.now))
            if res.metrics is not None:
                self.served += 1
                self._push(self.now, "result", (ask.tag, ask.step, dict(res.metrics)))
            else:
                assert res.request is not None
                self.tags[res.request.id] = ask.tag
                self.arrival[res.request.id] = self.now

    def _time_at(self, run: _Running, p: Point) -> float | None:
        """When ``run``'s worker passes point ``p`` (None if p is not on its path)."""
        for node, a, b, t0 in run.timeline:
            if node == p.node and a < p.step <= b:
                cfg = self.plan.nodes[node].config
                return t0 + sum(self.step_time(cfg, s) for s in range(a, p.step))
        return None

    # -- main loop ---------------------------------------------------------------------------

    def run(self, max_events: int = 10_000_000) -> SimReport:
        self._submit(self.driver.start())
        self._round()
        n = 0
        while self.events and n < max_events:
            t = self.events[0][0]
            self.now = t
            changed = False
            while self.events and self.events[0][0] == t:
                _, _, kind, payload = heapq.heappop(self.events)
                n += 1
                changed |= self._handle(kind, payload)
            if changed:
                self._round()
        return self._report()

    def _handle(self, kind: str, payload: Any) -> bool:
        if kind == "ckpt":
            self.plan.record_checkpoint(Checkpoint(payload, f"sim://{payload.node}/{payload.step}", 1))
            return True
        if kind == "metrics":
            p = payload
            metrics = {"loss": self.curve(self.plan.nodes[p.node].config, p.step)}
            for req in self.plan.record_metrics(p, metrics):
                self.served += 1
                tag = self.tags.pop(req.id)
                self._submit(self.driver.on_result(tag, p.step, metrics))
            return True
        if kind == "result":
            tag, step, metrics = payload
            self._submit(self.driver.on_result(tag, step, metrics))
            return True
        if kind == "done":
            run = self.running.pop(payload)
            self.free.append(run.slot)
            self.worker_seconds += self.now - run.started
            self.plan.requeue_batch(run.id)  # anything it could not serve goes back
            return True
        raise AssertionError(kind)

    def _inflight(self) -> list[InflightBatch]:
        out = []
        for run in self.running.values():
            stages = []
            for node, a, b, t0 in run.timeline:
                cfg = self.plan.nodes[node].config
                progress, t = a, t0
                while progress < b and t + self.step_time(cfg, progress) <= self.now:
                    t += self.step_time(cfg, progress)
                    progress += 1
                stages.append(InflightStage(node, a, b, progress if self.now >= t0 else a))
            out.append(InflightBatch(run.id, tuple(stages), frozenset(run.batch.saves), self.snapshots))
        return out

    def _round(self) -> None:
        self.rounds += 1
        plan = self.plan
        pending = [(r.id, r.point) for r in plan.pending()]
        if not pending:
            return
        inflight = self._inflight()
        forest = build_stage_tree(plan.nodes, plan.checkpoint_steps(), pending, inflight)
        boundaries = self._boundaries if self.use_boundaries else None
        result = schedule_round(forest, self.free, self.decision_cost, self.policy, boundaries, inflight)
        for amend in result.amendments:
            run = self.running.get(amend.batch)
            t = None if run is None else self._time_at(run, amend.point)
            if run is None or t is None or t <= self.now or amend.point in run.batch.saves:
                continue  # too late: whatever waits on it is re-planned once the batch moves on
            run.batch.saves.add(amend.point)
            self._push(t + self.save_s, "ckpt", amend.point)
        for rid, batch in result.attachments.items():
            run = self.running.get(batch)
            p = plan.requests[rid].point
            t = None if run is None else self._time_at(run, p)
            if run is None or t is None or t <= self.now:
                continue  # stays NOT_SCHED
            if p not in run.batch.evals:
                run.batch.evals.add(p)
                self._push(t + self.eval_s, "metrics", p)
            plan.mark_scheduled([rid], batch)
        for d in result.dispatches:
            self._start(d.batch, d.slot)

    def _start(self, batch: PlannedBatch, slot: Slot) -> None:
        bid = next(self._batch_ids)
        self.free.remove(slot)
        t = self.now + (self.load_s if batch.source.step > 0 else 0.0)
        run = _Running(bid, slot, batch, self.now, t)
        inside: dict[int, list[int]] = {}
        for p in batch.saves:
            inside.setdefault(p.node, []).append(p.step)
        for st in batch.stages:
            run.timeline.append((st.node, st.start, st.end, t))
            cfg = self.plan.nodes[st.node].config
            for step in sorted(inside.get(st.node, ())):
                if st.start < step < st.end:  # a branch candidate inside the stage: save on the way
                    passed = t + sum(self.step_time(cfg, s) for s in range(st.start, step))
                    self._push(passed + self.save_s, "ckpt", Point(st.node, step))
            t += self._train_time(st.node, st.start, st.end)
            self.executed.append((st.node, st.start, st.end))
            end = st.end_point
            if end in batch.evals:
                t += self.eval_s
                self._push(t, "metrics", end)
            if end in batch.saves:
                self._push(t + self.save_s, "ckpt", end)
        if self.snapshots:  # every step's snapshot, written (as one pack) before the batch says it ended
            for st in batch.stages:
                for step in range(st.start + 1, st.end + 1):
                    self._push(t, "ckpt", Point(st.node, step))
        run.end_time = t
        self.running[bid] = run
        self.plan.mark_scheduled(batch.requests, bid)
        self._push(t, "done", bid)

    # -- accounting --------------------------------------------------------------------------

    def _unique(self) -> tuple[int, float, float]:
        """Unique trained steps over all requested points, the critical path and a lower bound.

        Each unique step ("cell") is released no earlier than the first request that needs it
        arrived, nor before the cell before it on its path can have finished. For any schedule with
        these arrivals and W workers, makespan >= tau + (work released at or after tau) / W for every
        tau; the bound is the largest such value (it includes work / W at tau = 0). The critical path
        is the latest finish of a requested point when every cell starts at its release.
        """
        plan = self.plan
        first_need: dict[tuple[int, int], float] = {}
        ends: list[tuple[Point, float]] = []
        for p, arrived in self.point_arrivals:
            for node, a, b in plan.path(p):
                for s in range(a, b):
                    key = (node, s)
                    if arrived < first_need.get(key, math.inf):
                        first_need[key] = arrived
            ends.append((p, arrived))
        finish: dict[tuple[int, int], float] = {}
        released: list[tuple[float, float]] = []
        for node, s in sorted(first_need, key=lambda c: (c[0], c[1])):
            n = plan.nodes[node]
            if s > n.start:
                pred: tuple[int, int] | None = (node, s - 1)
            elif n.parent is not None:
                pred = (n.parent, s - 1)
            else:
                pred = None
            ready = first_need[(node, s)]
            if pred is not None:
                ready = max(ready, finish[pred])
            cost = self.step_time(n.config, s)
            finish[(node, s)] = ready + cost
            released.append((ready, cost))
        crit = 0.0
        for p, arrived in ends:
            if p.step == 0:
                continue
            n = plan.nodes[p.node]
            last = (p.node, p.step - 1) if p.step > n.start else (n.parent or p.node, p.step - 1)
            crit = max(crit, finish.get(last, arrived))
        released.sort(reverse=True)
        bound = 0.0
        tail_work = 0.0
        workers = len(self.slots)
        for ready, cost in released:
            tail_work += cost
            bound = max(bound, ready + tail_work / workers)
        return len(first_need), crit, max(bound, crit)

    def _duplicates(self) -> int:
        by_node: dict[int, list[tuple[int, int]]] = {}
        for node, a, b in self.executed:
            by_node.setdefault(node, []).append((a, b))
        dup = 0
        for ranges in by_node.values():
            ranges.sort()
            reach = -1
            for a, b in ranges:
                if a < reach:
                    dup += min(b, reach) - a
                reach = max(reach, b)
        return dup

    def _report(self) -> SimReport:
        unique, crit, bound = self._unique()
        executed = sum(b - a for _, a, b in self.executed)
        workers = len(self.slots)
        work = sum(self._train_time(n, a, b) for n, a, b in self.executed)
        makespan = self.now
        live = sum(1 for r in self.plan.requests.values() if r.state is not RequestState.DONE)
        if live:
            raise AssertionError(f"{live} requests were never served")
        return SimReport(
            policy=self.policy,
            workers=workers,
            makespan=makespan,
            worker_seconds=self.worker_seconds,
            executed_steps=executed,
            unique_steps=unique,
            requested_steps=self.requested_steps,
            requests=len(self.all_points),
            served=self.served,
            rounds=self.rounds,
            duplicate_steps=self._duplicates(),
            critical_path=crit,
            work=work,
            lower_bound=bound,
        )


def simulate(driver: Driver, workers: int, policy: str = "critical_path", **kwargs: Any) -> SimReport:
    return Simulator(driver, workers, policy, **kwargs).run()
