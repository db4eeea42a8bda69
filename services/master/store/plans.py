"""Search plans and their append-only node trees (one plan per fixed part).

The store never walks a plan: ``master.plans.PlanCache`` walks an in-memory core ``SearchPlan`` and
asks this role to write what it decided. Concurrent writers are reconciled by the unique key of a node
(plan, parent-or-0, start, branch digest): inserts are insert-or-ignore, then read back.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session

from stagetree.core.errors import Conflict, NotFound
from stagetree.core.lifecycle import RequestState
from stagetree.master.store import models as m
from stagetree.master.store.database import Database, table
from stagetree.master.store.records import NewNode, NewTreeNode, NodeRecord

_NODE_KEY = ["plan_id", "parent_key", "start", "branch_digest"]
_NODE_IDS = ["id", "parent_key", "start", "branch_digest"]
_DRAW_NODE_IDS = "SELECT nextval(pg_get_serial_sequence('nodes', 'id')) FROM generate_series(1, %s)"
_KEYS_PER_READ = 2000
_BY_KEYS_PG = (
    "SELECT n.id, n.parent_key, n.start, n.branch_digest, n.config_json FROM nodes n"
    " JOIN (VALUES %s) AS k (pk, st, dg) ON n.parent_key = k.pk AND n.start = k.st AND n.branch_digest = k.dg"
    " WHERE n.plan_id = {plan_id}"
)


class PlanStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def ensure_plan(self, key: str, fixed_json: str, scope: str = "") -> int:
        """The id of the plan with this key (``FixedPart.key(scope)``), created in ``scope`` if needed."""
        with self.db.tx("ensure plan") as s:
            pid = s.scalar(select(m.Plan.id).where(m.Plan.key == key))
            if pid is not None:
                return int(pid)
            s.execute(
                self.db.insert(table(m.Plan))
                .values(key=key, fixed_json=fixed_json, created_at=time.time(), scope=scope)
                .on_conflict_do_nothing(index_elements=["key"])
            )
            return int(s.scalar(select(m.Plan.id).where(m.Plan.key == key)))  # type: ignore[arg-type]

    def plan_ids_by_key(self, keys: Iterable[str]) -> dict[str, int]:
        with self.db.tx("find plans") as s:
            rows = s.execute(select(m.Plan.key, m.Plan.id).where(m.Plan.key.in_(list(keys)))).all()
            return {k: int(i) for k, i in rows}

    def plan_fixed(self, plan_id: int) -> tuple[str, str]:
        """(key, fixed part JSON) of a plan."""
        with self.db.tx("get plan") as s:
            row = s.get(m.Plan, plan_id)
            if row is None:
                raise NotFound(f"plan {plan_id} does not exist")
            return row.key, row.fixed_json

    def plan_scope(self, plan_id: int) -> str:
        with self.db.tx("plan scope") as s:
            scope = s.scalar(select(m.Plan.scope).where(m.Plan.id == plan_id))
            if scope is None:
                raise NotFound(f"plan {plan_id} does not exist")
            return str(scope)

    def study_plan_ids(self, study_id: str) -> list[int]:
        with self.db.tx("study plans") as s:
            return [
                int(p) for p in s.scalars(select(m.Request.plan_id).where(m.Request.study_id == study_id).distinct())
            ]

    # -- nodes ------------------------------------------------------------------------------------

    def load_nodes(self, plan_id: int, after: int = 0) -> list[NodeRecord]:
        """Nodes of a plan with id above ``after``, parents before children (ids grow)."""
        with self.db.tx("load nodes") as s:
            rows = s.execute(
                select(m.Node.id, m.Node.parent_id, m.Node.start, m.Node.config_json)
                .where(m.Node.plan_id == plan_id, m.Node.id > after)
                .order_by(m.Node.id)
            ).all()
            return [NodeRecord(int(i), None if p is None else int(p), st, cj) for i, p, st, cj in rows]

    def insert_nodes(self, plan_id: int, nodes: Sequence[NewNode]) -> None:
        """Insert-or-ignore: a node another writer created first under the same key is kept."""
        if not nodes:
            return
        rows = [_node_row(plan_id, n.parent, n.start, n.branch_digest, n.config_json) for n in nodes]
        # one global order of rows so that concurrent writers take row locks in the same order
        rows.sort(key=lambda r: (r["parent_key"], r["start"], r["branch_digest"]))
        stmt = self.db.insert(table(m.Node)).on_conflict_do_nothing(index_elements=_NODE_KEY)

        def write() -> None:
            with self.db.tx("insert nodes") as s:
                s.execute(stmt, rows)

        self.db.retry(write)

    def insert_node_tree(self, plan_id: int, nodes: Sequence[NewTreeNode]) -> dict[int, int]:
        """Insert-or-ignore a forest of new nodes (parents before children) in one transaction, one
        statement per depth level (and a read of the keys another writer held first); returns ``ref ->
        database id`` of the nodes now in the database with the caller's config. Where another master
        wrote a node under the same key first with a different config, that node is kept and the
        caller's subtree below it is not written (it was placed relative to the caller's config): the
        caller walks again."""
        if not nodes:
            return {}
        depth: dict[int, int] = {}
        levels: list[list[NewTreeNode]] = []
        for n in nodes:
            d = depth[n.parent] + 1 if n.parent is not None and n.parent < 0 else 0
            depth[n.ref] = d
            if d == len(levels):
                levels.append([])
            levels[d].append(n)
        if self.db.is_postgres and len(levels) > 1:
            at_once = self.db.retry(lambda: self._write_at_once(plan_id, nodes))
            if at_once is not None:
                return at_once
        return self.db.retry(lambda: self._write_levels(plan_id, levels))

    def _write_at_once(self, plan_id: int, nodes: Sequence[NewTreeNode]) -> dict[int, int] | None:
        """Postgres: the whole forest in one statement, its ids drawn from the nodes' sequence first so
        that a child names its new parent (a deep one, a trial per milestone of a schedule, is otherwise
        a statement per level while the plan's cache is locked). None, with nothing written, where
        another writer holds one of the keys: the level-by-level write then keeps theirs."""
        import psycopg2.errors  # the Postgres path only

        try:
            with self.db.tx("insert nodes") as s:
                drawn = s.connection().exec_driver_sql(_DRAW_NODE_IDS, (len(nodes),)).scalars().all()
                ids = {n.ref: int(i) for n, i in zip(nodes, drawn, strict=True)}
                rows = [
                    {
                        "id": ids[n.ref],
                        **_node_row(
                            plan_id,
                            ids[n.parent] if n.parent is not None and n.parent < 0 else n.parent,
                            n.start,
                            n.branch_digest,
                            n.config_json,
                        ),
                    }
                    for n in nodes
                ]
                rows.sort(key=lambda r: (r["parent_key"], r["start"], r["branch_digest"]))  # the lock order
                if len(self.db.insert_ignore(s, table(m.Node), rows, _NODE_KEY, ["id"])) < len(rows):
                    raise _KeyTaken  # a leaf's key: undo the rest
        except _KeyTaken:
            return None
        except Conflict as e:
            if isinstance(e.__cause__, psycopg2.errors.ForeignKeyViolation):
                return None  # an inner node's key: its children name no row
            raise  # busy or deadlocked: the caller's retry runs it again
        return ids

    def _write_levels(self, plan_id: int, levels: list[list[NewTreeNode]]) -> dict[int, int]:
        ids: dict[int, int] = {}
        foreign: set[int] = set()  # refs whose key holds another writer's config
        with self.db.tx("insert nodes") as s:
            for level in levels:
                rows: list[dict[str, Any]] = []
                refs: dict[tuple[int, int, str], tuple[int, str]] = {}
                for n in level:
                    if n.parent is not None and n.parent in foreign:
                        foreign.add(n.ref)
                        continue
                    parent = ids[n.parent] if n.parent is not None and n.parent < 0 else n.parent
                    rows.append(_node_row(plan_id, parent, n.start, n.branch_digest, n.config_json))
                    refs[(parent or 0, n.start, n.branch_digest)] = (n.ref, n.config_json)
                if not rows:
                    break
                # one global order of rows so that concurrent writers take row locks in the same order
                rows.sort(key=lambda r: (r["parent_key"], r["start"], r["branch_digest"]))
                for i, pk, st, dg in self.db.insert_ignore(s, table(m.Node), rows, _NODE_KEY, _NODE_IDS):
                    ids[refs.pop((int(pk), int(st), dg))[0]] = int(i)  # written now, with the caller's config
                if refs:  # another writer's nodes hold these keys: theirs stay, and are ours if configs agree
                    for i, pk, st, dg, cj in self._by_keys(s, plan_id, list(refs)):
                        ref, config_json = refs[(pk, st, dg)]
                        if cj == config_json:
                            ids[ref] = int(i)
                        else:
                            foreign.add(ref)
        return ids

    def _by_keys(self, s: Session, plan_id: int, keys: list[tuple[int, int, str]]) -> list[Any]:
        """(id, parent_key, start, branch_digest, config_json) of the plan's nodes under ``keys``, by the
        node key's index whatever the plan's size. On Postgres a join with the keys as a VALUES list sent
        by psycopg2 (a row-value IN list is planned as a scan of the plan's nodes, a long one overflows
        the parser's stack, and compiling either per call cost more than the query); SQLite's row-value
        IN already probes the index."""
        if self.db.is_postgres:
            from psycopg2.extras import execute_values

            sql = _BY_KEYS_PG.format(plan_id=int(plan_id))
            cur = s.connection().connection.cursor()
            try:
                return list(execute_values(cur, sql, keys, page_size=_KEYS_PER_READ, fetch=True))
            finally:
                cur.close()
        cols = (m.Node.id, m.Node.parent_key, m.Node.start, m.Node.branch_digest, m.Node.config_json)
        key = tuple_(m.Node.parent_key, m.Node.start, m.Node.branch_digest)
        out: list[Any] = []
        for i in range(0, len(keys), _KEYS_PER_READ):
            out.extend(s.execute(select(*cols).where(m.Node.plan_id == plan_id, key.in_(keys[i : i + _KEYS_PER_READ]))))
        return out

    def plan_state(self, plan_id: int) -> tuple[dict[int, dict[str, int]], dict[int, list[int]], dict[int, list[int]]]:
        """Per node: request counts by state; checkpoint steps; metric steps (for the plan view)."""
        with self.db.tx("plan state") as s:
            counts: dict[int, dict[str, int]] = {}
            for node, state, n in s.execute(
                select(m.Request.node_id, m.Request.state, func.count())
                .where(m.Request.plan_id == plan_id)
                .group_by(m.Request.node_id, m.Request.state)
            ):
                counts.setdefault(int(node), {})[str(RequestState(state))] = int(n)
            ckpts, mets = self._marks_in(s, plan_id)
            return counts, ckpts, mets

    def plan_marks(self, plan_id: int) -> tuple[dict[int, list[int]], dict[int, list[int]], set[int]]:
        """Per node: checkpoint steps and metric steps; and the nodes with a path change (what a stage
        tree marks on its nodes: ``plan_state`` without the request counts, which it reads apart)."""
        with self.db.tx("plan marks") as s:
            ckpts, mets = self._marks_in(s, plan_id)
            changed = {
                int(n)
                for n in s.scalars(
                    select(m.PathChange.node_id)
                    .join(m.Node, m.Node.id == m.PathChange.node_id)
                    .where(m.Node.plan_id == plan_id)
                    .distinct()
                )
            }
            return ckpts, mets, changed

    @staticmethod
    def _marks_in(s: Session, plan_id: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        ckpts: dict[int, list[int]] = {}
        for node, step in s.execute(
            select(m.Checkpoint.node_id, m.Checkpoint.step)
            .join(m.Node, m.Node.id == m.Checkpoint.node_id)
            .where(m.Node.plan_id == plan_id)
        ):
            ckpts.setdefault(int(node), []).append(int(step))
        mets: dict[int, list[int]] = {}
        for node, step in s.execute(
            select(m.Metric.node_id, m.Metric.step)
            .join(m.Node, m.Node.id == m.Metric.node_id)
            .where(m.Node.plan_id == plan_id)
        ):
            mets.setdefault(int(node), []).append(int(step))
        return ckpts, mets


class _KeyTaken(Exception):
    """Another writer holds the key of a node being written (inside ``_write_at_once``)."""


def _node_row(plan_id: int, parent: int | None, start: int, digest: str, config_json: str) -> dict[str, Any]:
    return {
        "plan_id": plan_id,
        "parent_id": parent,
        "parent_key": parent or 0,
        "start": start,
        "branch_digest": digest,
        "config_json": config_json,
    }
