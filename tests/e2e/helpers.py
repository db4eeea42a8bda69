"""Helpers of the e2e suite: studies of the (fault-injecting) digits trainer and reads of the cluster's
database, for checks the client cannot make (which batch ran where, from which checkpoint)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stagetree.client.sdk import Client, Study
from stagetree.cluster import ProcessCluster
from stagetree.nodemanager.examples.faults import ENTRY_POINT

LRS = (0.05, 0.1, 0.2, 0.4, 0.02, 0.3, 0.15, 0.25)


async def new_study(client: Client, name: str, *, retry_user_errors: bool = False, **values: Any) -> Study:
    """A study of ``FaultyDigits`` whose fixed part is its own (a unique tag): nothing is shared with
    another test's plan, so no eval is answered from another test's metrics."""
    tag = f"{name}-{uuid.uuid4().hex[:6]}"
    return await Study.create(
        client,
        tag,
        trainer=ENTRY_POINT,
        dataset="sklearn-digits",
        values={"tag": tag, **values},
        tuned=["lr"],
        retry_user_errors=retry_user_errors,
    )


@dataclass(frozen=True)
class BatchRow:
    id: int
    state: str
    node_manager_id: str
    spec: dict[str, Any]
    created_at: float

    @property
    def nodes(self) -> set[int]:
        return {int(s["node"]) for s in self.spec["stages"]}

    @property
    def source_step(self) -> int:
        src = self.spec.get("source") or {}
        return int(src["step"]) if src.get("uri") else 0


def query(cluster: ProcessCluster, sql: str, **params: Any) -> list[Any]:
    return cluster.query(sql, **params)


def plan_of(cluster: ProcessCluster, study: Study) -> int:
    rows = query(cluster, "SELECT DISTINCT plan_id FROM requests WHERE study_id = :s", s=study.id)
    assert len(rows) == 1, rows
    return int(rows[0][0])


def plan_or_none(cluster: ProcessCluster, study: Study) -> int | None:
    rows = query(cluster, "SELECT DISTINCT plan_id FROM requests WHERE study_id = :s", s=study.id)
    return int(rows[0][0]) if rows else None


def study_batches(cluster: ProcessCluster, study: Study) -> list[BatchRow]:
    """The batches of the study's plan (none before its first request is recorded)."""
    plan = plan_or_none(cluster, study)
    return [] if plan is None else batches(cluster, plan)


def batches(cluster: ProcessCluster, plan_id: int) -> list[BatchRow]:
    rows = query(
        cluster,
        "SELECT id, state, node_manager_id, spec_json, created_at FROM batches WHERE plan_id = :p ORDER BY id",
        p=plan_id,
    )
    return [BatchRow(int(r[0]), r[1], r[2] or "", json.loads(r[3] or "{}"), float(r[4])) for r in rows]


def requests(cluster: ProcessCluster, study: Study) -> list[Any]:
    return query(
        cluster, "SELECT id, state, failures, error, node_id, step FROM requests WHERE study_id = :s", s=study.id
    )


def checkpoint_steps(cluster: ProcessCluster, nodes: set[int]) -> list[int]:
    if not nodes:
        return []
    rows = query(cluster, "SELECT node_id, step FROM checkpoints WHERE step > 0")
    return sorted(int(st) for n, st in rows if int(n) in nodes)


async def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.2) -> Any:
    """Poll ``pred`` (run in a thread: it may read the database) until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await asyncio.to_thread(pred)
        if got:
            return got
        await asyncio.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def diagnostics(cluster: ProcessCluster, *names: str) -> str:
    return "\n".join(f"--- {n} ---\n{cluster.log_tail(n)}" for n in names or list(cluster.services))
