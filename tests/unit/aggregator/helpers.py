"""A small search plan with waiting requests and running batches, and the bus messages a node manager
would publish for them; shared by the aggregator's unit and integration suites."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select

from stagetree.bus.messages import (
    BatchFailed,
    BatchFinished,
    BatchPreempted,
    BatchStarted,
    BatchTiming,
    CheckpointSaved,
    Curve,
    LogLine,
    Metrics,
    Progress,
    Rescaled,
    make_msg_id,
)
from stagetree.core.config import Config
from stagetree.core.sequences import MultiStep
from stagetree.master.plans import config_text
from stagetree.master.store import models as m
from stagetree.master.store.records import BatchRecord, NewNode, NewRequest, RequestRecord
from stagetree.master.store.store import Store

BRANCH = 50  # the child node starts at this step of the root


@dataclass
class World:
    """A plan with a root node and one child branching at step ``BRANCH``, a study and a node manager."""

    store: Store
    plan_id: int
    root: int
    child: int
    study: str
    nm: str
    _seq: dict[int, int] = field(default_factory=dict)  # next sequence number per batch
    _requests: int = 0

    def requests(self, points: list[tuple[int, int]]) -> list[RequestRecord]:
        first, self._requests = self._requests, self._requests + len(points)
        # sequential client ids, so two worlds built alike get the same request ids
        items = [NewRequest(f"r{first + i:08d}", node, step) for i, (node, step) in enumerate(points)]
        return self.store.requests.add_requests(self.study, self.plan_id, items)

    def dispatch(self, points: list[tuple[int, int]]) -> tuple[BatchRecord, list[RequestRecord]]:
        """Requests at ``points``, all SCHED on one new running batch."""
        recs = self.requests(points)
        return self.dispatch_ids([r.id for r in recs]), recs

    def dispatch_ids(self, request_ids: list[int]) -> BatchRecord:
        batch = self.store.ledger.dispatch(self.plan_id, lambda b, a: f"spec-{b}-{a}", request_ids, self.nm, "gpu0")
        assert batch is not None
        return batch

    def _next(self, batch_id: int) -> int:
        self._seq[batch_id] = self._seq.get(batch_id, -1) + 1
        return self._seq[batch_id]

    def _common(self, batch_id: int, attempt: int) -> dict[str, Any]:
        return {
            "msg_id": make_msg_id(self.nm, batch_id, attempt, self._next(batch_id)),
            "node_manager": self.nm,
            "batch_id": batch_id,
            "attempt": attempt,
        }

    def started(self, batch_id: int, attempt: int = 1, at: float | None = None) -> BatchStarted:
        return BatchStarted(**self._common(batch_id, attempt), started_at=at)

    def progress(self, batch_id: int, node: int, step: int, attempt: int = 1) -> Progress:
        return Progress(**self._common(batch_id, attempt), node=node, step=step)

    def metrics(
        self, batch_id: int, node: int, step: int, values: dict[str, float] | None = None, attempt: int = 1
    ) -> Metrics:
        vals = values if values is not None else {"loss": 1.0 / (step + 1)}
        return Metrics(**self._common(batch_id, attempt), node=node, step=step, metrics=vals)

    def curve(self, batch_id: int, node: int, points: list[tuple[int, dict[str, float]]], attempt: int = 1) -> Curve:
        return Curve(
            **self._common(batch_id, attempt), node=node, steps=[s for s, _ in points], values=[v for _, v in points]
        )

    def checkpoint(self, batch_id: int, node: int, step: int, attempt: int = 1, ranks: int = 1) -> CheckpointSaved:
        return CheckpointSaved(
            **self._common(batch_id, attempt),
            node=node,
            step=step,
            uri=f"file:///ckpt/{node}/{step}",
            bytes=1024,
            kind="central",
            ranks=ranks,
        )

    def rescaled(
        self, batch_id: int, node: int, step: int, from_ranks: int, to_ranks: int, attempt: int = 1
    ) -> Rescaled:
        """The batch resumed the checkpoint at (node, step), written by ``from_ranks`` ranks, on ``to_ranks``."""
        return Rescaled(
            **self._common(batch_id, attempt),
            node=node,
            step=step,
            uri=f"file:///ckpt/{node}/{step}",
            from_ranks=from_ranks,
            to_ranks=to_ranks,
        )

    def timing(
        self, batch_id: int, given_at: float, startup_s: float, checkpoint_s: float, train_s: float, attempt: int = 1
    ) -> BatchTiming:
        return BatchTiming(
            **self._common(batch_id, attempt),
            given_at=given_at,
            startup_s=startup_s,
            checkpoint_s=checkpoint_s,
            train_s=train_s,
        )

    def finished(self, batch_id: int, steps: int = 0, attempt: int = 1) -> BatchFinished:
        return BatchFinished(**self._common(batch_id, attempt), steps=steps)

    def failed(self, batch_id: int, error: str = "boom", oom: bool = False, attempt: int = 1) -> BatchFailed:
        return BatchFailed(**self._common(batch_id, attempt), error=error, traceback="Traceback ...", oom=oom)

    def preempted(self, batch_id: int, node: int, step: int, attempt: int = 1) -> BatchPreempted:
        return BatchPreempted(**self._common(batch_id, attempt), node=node, step=step, uri=f"file:///pre/{step}")

    def log_line(
        self, batch_id: int, seq: int, line: str, node: int = 0, step: int = 0, attempt: int = 1, at: float = 1.0
    ) -> LogLine:
        return LogLine(**self._common(batch_id, attempt), seq=seq, node=node, step=step, at=at, line=line)

    # -- what the database holds ----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Every row this world's effects can touch, for before/after comparisons."""
        with self.store.db.tx("test snapshot") as s:
            reqs = s.execute(
                select(m.Request.id, m.Request.state, m.Request.batch_id, m.Request.failures, m.Request.error).where(
                    m.Request.study_id == self.study
                )
            ).all()
            batches = s.execute(
                select(m.Batch.id, m.Batch.state).where(m.Batch.plan_id == self.plan_id).order_by(m.Batch.id)
            ).all()
            attempts = s.execute(
                select(m.BatchAttempt.batch_id, m.BatchAttempt.attempt, m.BatchAttempt.state)
                .join(m.Batch, m.Batch.id == m.BatchAttempt.batch_id)
                .where(m.Batch.plan_id == self.plan_id)
            ).all()
            nodes = [self.root, self.child]
            metrics = s.execute(
                select(m.Metric.node_id, m.Metric.step, m.Metric.values).where(m.Metric.node_id.in_(nodes))
            ).all()
            ckpts = s.execute(
                select(
                    m.Checkpoint.node_id, m.Checkpoint.step, m.Checkpoint.uri, m.Checkpoint.kind, m.Checkpoint.ranks
                ).where(m.Checkpoint.node_id.in_(nodes))
            ).all()
            curve = s.execute(
                select(m.CurvePointRow.node_id, m.CurvePointRow.step, m.CurvePointRow.values).where(
                    m.CurvePointRow.node_id.in_(nodes)
                )
            ).all()
            p = m.PathChange
            paths = s.execute(
                select(p.batch_id, p.attempt, p.node_id, p.step, p.from_ranks, p.to_ranks).where(p.node_id.in_(nodes))
            ).all()
            ll = m.LogLineRow
            lines = s.execute(
                select(ll.batch_id, ll.attempt, ll.seq, ll.node_id, ll.step, ll.at, ll.line)
                .join(m.Batch, m.Batch.id == ll.batch_id)
                .where(m.Batch.plan_id == self.plan_id)
            ).all()
        return {
            "requests": sorted(tuple(r) for r in reqs),
            "batches": [tuple(b) for b in batches],
            "attempts": sorted(tuple(a) for a in attempts),
            "metrics": sorted((n, st, sorted(v.items())) for n, st, v in metrics),
            "checkpoints": sorted(tuple(c) for c in ckpts),
            "curve": sorted((n, st, sorted(_json(v).items())) for n, st, v in curve),
            "path_changes": sorted(tuple(c) for c in paths),
            "log_lines": sorted(tuple(x) for x in lines),
        }

    def request_states(self, ids: list[int]) -> list[str]:
        by_id = {r.id: r.state for r in self.store.requests.get_requests(self.study, ids)}
        return [by_id[i] for i in ids]


def make_world(store: Store) -> World:
    tag = uuid.uuid4().hex[:12]
    plan_id = store.plans.ensure_plan(f"plan-{tag}", "{}")
    store.plans.insert_nodes(plan_id, [NewNode(None, 0, "root", config_text(Config.of({"lr": 0.1})))])
    (root,) = store.plans.load_nodes(plan_id)
    branch = Config.of({"lr": MultiStep(0.1, [BRANCH], 0.5)})
    store.plans.insert_nodes(plan_id, [NewNode(root.id, BRANCH, "child", config_text(branch))])
    child = store.plans.load_nodes(plan_id, after=root.id)[0]
    study = store.studies.create_study(f"owner-{tag}", "study", None)
    nm = f"nm-{tag}"
    store.nodes.register_node_manager(nm, "127.0.0.1:1", [("gpu0", "cpu")])
    return World(store, plan_id, root.id, child.id, study.id, nm)


def applied_count(store: Store, prefix: str = "") -> int:
    with store.db.tx("count applied") as s:
        q = select(func.count()).select_from(m.AppliedMessage)
        if prefix:
            q = q.where(m.AppliedMessage.msg_id.like(f"{prefix}%"))
        return int(s.scalar(q) or 0)


def _json(v: Any) -> dict[str, Any]:
    return json.loads(v) if isinstance(v, str) else dict(v)
