"""The scheduler's cost estimates, learned from the batches that ran (TreeML §5.2, live).

The critical-path scheduler orders work by each stage's estimated time. With no data every step costs
``default_step_seconds``; that ranks two 50-step branches alike even when one trains at batch size 128
and costs four times the other, and the scheduler then starts the long one last. ``CostLearner`` feeds
the core's ``CostModel`` (a linear fit of seconds per step on the cost-relevant hyper-parameters, ``bs``
by default) with every batch attempt that ran to its end: its seconds (from the node manager taking it
to its end) over its steps, at the mean of its steps' feature values. A plan and GPU type it has data
for gets the fitted cost; others keep the default.

The measure includes a batch's fixed costs (start, checkpoint load, evaluations, end), so short
batches read a little dear per step; the fit only has to rank stages, and more data (longer batches)
dominates it. Everything comes from the database (``store.finished_attempts``): a master that takes the
lead learns the same, and the aggregators need not know about it.

A batch on ``n`` slots is learnt at ``n`` (the model fits time per step on ``1 / n`` too), and a stage is
costed at the slots its plan's batches take (``slots_of``: what the study asks for, or more after an
out of memory). Attempts that ran out of memory (``OUT_OF_MEMORY`` in the ledger) teach the model that
their plan needs twice their slots (``CostModel.record_oom``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence

from stagetree.core.batch import BatchSpec
from stagetree.core.config import Config
from stagetree.core.errors import StagetreeError
from stagetree.core.estimator import CostModel, features_of
from stagetree.core.ids import NO_PLAN, PlanId
from stagetree.core.lifecycle import BatchState
from stagetree.core.scheduler import StageCost
from stagetree.core.stagetree import Stage
from stagetree.master.store.batches import BatchReader
from stagetree.master.store.records import FinishedAttempt

log = logging.getLogger(__name__)

# Attempts finish out of order and their time stamps come from several processes' clocks: each read
# goes back this far before the latest one seen, and skips the ones already counted.
OVERLAP_S = 30.0


class CostLearner:
    def __init__(self, default_step_seconds: float, model: CostModel | None = None) -> None:
        self.default_step_seconds = default_step_seconds
        self.model = model or CostModel()
        self._since = 0.0
        self._oom_since = 0.0
        self._seen: dict[tuple[int, int], float] = {}  # (batch, attempt) -> finished at, within the overlap
        self._oom_seen: set[tuple[int, int]] = set()
        self._warm: set[tuple[str, str]] = set()  # (plan key, GPU type) with data
        # stage costs per (plan key, GPU type), (node, start, end): dropped when that key learns more
        self._costs: dict[tuple[str, str], dict[tuple[int, int, int], float]] = {}

    def refresh(self, batches: BatchReader) -> int:
        """Learn from the attempts that finished since the last refresh; how many were new."""
        return self.observe(batches.finished_attempts(self._since, skip=self._seen))

    def refresh_oom(self, batches: BatchReader) -> list[tuple[str, int]]:
        """Learn from the attempts that ran out of memory since the last look (every round: the retry of
        the work they carried must already take the doubled slots)."""
        return self.observe_oom(
            batches.finished_attempts(self._oom_since, state=BatchState.OUT_OF_MEMORY, skip=self._oom_seen)
        )

    def observe_oom(self, attempts: Sequence[FinishedAttempt]) -> list[tuple[str, int]]:
        """Attempts that ran out of memory: their plans' batches take twice their slots from now on.
        Returns (plan key, new slots) of each new one."""
        out = []
        for at in attempts:
            key = (at.batch_id, at.attempt)
            if key in self._oom_seen:
                continue
            self._oom_seen.add(key)
            self._oom_since = max(self._oom_since, at.finished_at - OVERLAP_S)
            try:
                spec = BatchSpec.from_json(json.loads(at.spec_json))
            except (StagetreeError, ValueError, KeyError, TypeError):
                continue
            n = self.model.record_oom(spec.plan_key, spec.slots)
            log.warning(
                "batch ran out of memory: its plan's next batches take %d slots",
                n,
                extra={"batch_id": at.batch_id, "plan_key": spec.plan_key, "slots": spec.slots},
            )
            out.append((spec.plan_key, n))
        return out

    def observe(self, attempts: Sequence[FinishedAttempt]) -> int:
        new = 0
        for at in attempts:
            key = (at.batch_id, at.attempt)
            if key in self._seen:
                continue
            self._seen[key] = at.finished_at
            new += self._learn(at)
            self._since = max(self._since, at.finished_at - OVERLAP_S)
        for key, when in list(self._seen.items()):
            if when < self._since:
                del self._seen[key]
        return new

    def _learn(self, at: FinishedAttempt) -> int:
        try:
            spec = BatchSpec.from_json(json.loads(at.spec_json))
        except (StagetreeError, ValueError, KeyError, TypeError):
            return 0  # the scheduler logs unreadable specs; nothing to learn here
        steps = sum(st.end - st.start for st in spec.stages)
        if steps <= 0 or at.seconds <= 0:
            return 0
        totals: dict[str, float] = {}
        for st in spec.stages:
            feats = features_of(st.config, (st.start + st.end) // 2, self.model.feature_names)
            for name, v in feats.items():
                totals[name] = totals.get(name, 0.0) + v * (st.end - st.start)
        features = {name: total / steps for name, total in totals.items()}
        gpu = at.gpu_type or "cpu"
        self.model.observe(spec.plan_key, gpu, features, at.seconds / steps, 0.0, spec.slots)
        self._warm.add((spec.plan_key, gpu))
        self._costs.pop((spec.plan_key, gpu), None)
        return 1

    def knows(self, plan_key: str, gpu_type: str) -> bool:
        return (plan_key, gpu_type) in self._warm

    def stage_cost(
        self,
        plan_key_of: Callable[[int], str],
        config_of: Callable[[int, int], Config],
        gpu_type: str,
        slots_of: Callable[[PlanId], int] | None = None,
    ) -> StageCost:
        """The scheduler's cost callable for one round: a stage of a plan (``stage.plan`` is its id) with
        data costs its steps times the fitted seconds per step at its midpoint, on the slots its plan's
        batches take (``slots_of(stage.plan)``, default 1); others cost ``default_step_seconds`` per step
        (divided by the slots: the ideal speedup). A stage's cost is kept until its plan learns more: a
        round asks for every stage of the forest, most of them the same as the round before.
        ``config_of(plan id, node id)``: a node's configuration, which the caller loads when it lacks it
        (the stages of a running batch can be older than anything this master has read)."""
        default = self.default_step_seconds
        if slots_of is not None:
            return self._stage_cost_on_slots(plan_key_of, config_of, gpu_type, slots_of)
        model, names = self.model, self.model.feature_names
        # per plan of the round: (its key, its kept stage costs), or None when it has no data
        per_plan: dict[PlanId, tuple[str, dict[tuple[int, int, int], float]] | None] = {}

        def known(plan: PlanId) -> tuple[str, dict[tuple[int, int, int], float]] | None:
            plan_key = plan_key_of(plan) if plan != NO_PLAN else None
            if plan_key is None or (plan_key, gpu_type) not in self._warm:
                return None
            return plan_key, self._costs.setdefault((plan_key, gpu_type), {})

        def cost(stage: Stage) -> float:
            try:
                entry = per_plan[stage.plan]
            except KeyError:
                entry = per_plan[stage.plan] = known(stage.plan)
            if entry is None:
                return stage.steps * default
            plan_key, costs = entry
            k = (stage.node, stage.start, stage.end)
            got = costs.get(k)
            if got is None:
                if stage.steps <= 0:
                    got = 0.0
                else:
                    config = config_of(stage.plan, stage.node)
                    feats = features_of(config, (stage.start + stage.end) // 2, names)
                    got = stage.steps * model.seconds_per_step(plan_key, gpu_type, feats)
                costs[k] = got
            return got

        return cost

    def _stage_cost_on_slots(
        self,
        plan_key_of: Callable[[int], str],
        config_of: Callable[[int, int], Config],
        gpu_type: str,
        slots_of: Callable[[PlanId], int],
    ) -> StageCost:
        """``stage_cost`` when some plan's batches take several slots (kept apart: the common case above
        stays as fast as it was)."""
        default, model, names = self.default_step_seconds, self.model, self.model.feature_names
        memo: dict[tuple[PlanId, int, int, int], float] = {}

        def cost(stage: Stage) -> float:
            k = (stage.plan, stage.node, stage.start, stage.end)
            got = memo.get(k)
            if got is not None:
                return got
            n = slots_of(stage.plan)
            plan_key = plan_key_of(stage.plan) if stage.plan != NO_PLAN else None
            if stage.steps <= 0:
                got = 0.0
            elif plan_key is None or (plan_key, gpu_type) not in self._warm:
                got = stage.steps * default / n
            else:
                config = config_of(stage.plan, stage.node)
                feats = features_of(config, (stage.start + stage.end) // 2, names)
                got = stage.steps * model.seconds_per_step(plan_key, gpu_type, feats, n)
            memo[k] = got
            return got

        return cost

    def width_scale(self, plan_key_of: Callable[[int], str], gpu_type: str) -> Callable[[PlanId, int], float]:
        """Time per step of a plan's batch on ``n`` slots over that on 1 (``(plan id, n) -> ratio``): from
        the fit where the plan has data, else the ideal ``1 / n``."""
        model = self.model

        def scale(plan: PlanId, n: int) -> float:
            key = plan_key_of(plan) if plan != NO_PLAN else None
            if key is None or (key, gpu_type) not in self._warm:
                return 1.0 / n
            one = model.seconds_per_step(key, gpu_type, {}, 1)
            return model.seconds_per_step(key, gpu_type, {}, n) / one if one > 0 else 1.0 / n

        return scale
