"""Caches in front of the store's roles, for the rows that never change once written.

Consistency rules (why a cached read is never stale):
- a study's id, owner, name and fixed part never change after it is created; a deleted study's id is
  never reused (uuid4), and the master that deletes it drops it here (``forget_study``);
- a plan's id, key, scope and fixed part never change, and plan rows are never deleted (``plan forget``
  deletes what a plan computed, not the plan);
- a batch's plan never changes.
So each of these is read once per process and kept (bounded; the oldest half goes when full). Nothing
that changes (request states, metrics, checkpoints, batches' states) is cached. The adapters below
stay plain: each cache wraps one role and takes the same calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from stagetree.master.store.batches import BatchReader
from stagetree.master.store.ledger import BatchLedger
from stagetree.master.store.plans import PlanStore
from stagetree.master.store.records import BatchRecord, DispatchItem, StudyRecord
from stagetree.master.store.studies import StudyStore

K = TypeVar("K")
V = TypeVar("V")


class Bounded(Generic[K, V]):
    """A dict that drops its oldest half when it reaches ``size`` entries."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._d: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        return self._d.get(key)

    def drop(self, key: K) -> None:
        self._d.pop(key, None)

    def put(self, key: K, value: V) -> V:
        if len(self._d) >= self.size:
            for k in list(self._d)[: self.size // 2]:
                del self._d[k]
        self._d[key] = value
        return value


class CachedStudyStore(StudyStore):
    """``get_study`` read once per study."""

    def __init__(self, inner: StudyStore, size: int = 10_000) -> None:
        super().__init__(inner.db)
        self._studies: Bounded[str, StudyRecord] = Bounded(size)

    def get_study(self, study_id: str) -> StudyRecord:
        got = self._studies.get(study_id)
        return got if got is not None else self._studies.put(study_id, super().get_study(study_id))

    def forget_study(self, study_id: str) -> None:
        self._studies.drop(study_id)


class CachedPlanStore(PlanStore):
    """Plan ids by key and each plan's key and fixed part, read once."""

    def __init__(self, inner: PlanStore, size: int = 100_000) -> None:
        super().__init__(inner.db)
        self._ids: Bounded[str, int] = Bounded(size)
        self._fixed: Bounded[int, tuple[str, str]] = Bounded(size)

    def ensure_plan(self, key: str, fixed_json: str, scope: str = "") -> int:
        got = self._ids.get(key)
        return got if got is not None else self._ids.put(key, super().ensure_plan(key, fixed_json, scope))

    def plan_fixed(self, plan_id: int) -> tuple[str, str]:
        got = self._fixed.get(plan_id)
        return got if got is not None else self._fixed.put(plan_id, super().plan_fixed(plan_id))


class CachedBatchReader(BatchReader):
    """Each batch's plan, remembered from its dispatch (``remember``) or read once."""

    def __init__(self, inner: BatchReader, size: int = 100_000) -> None:
        super().__init__(inner.db)
        self._plans: Bounded[int, int] = Bounded(size)

    def remember(self, records: Sequence[BatchRecord | None]) -> None:
        for rec in records:
            if rec is not None:
                self._plans.put(rec.id, rec.plan_id)

    def plan_of_batch(self, batch_id: int) -> int:
        got = self._plans.get(batch_id)
        return got if got is not None else self._plans.put(batch_id, super().plan_of_batch(batch_id))

    def plans_of_batches(self, batch_ids: Sequence[int]) -> dict[int, int]:
        out = {b: p for b in batch_ids if (p := self._plans.get(b)) is not None}
        missing = [b for b in batch_ids if b not in out]
        for b, p in (super().plans_of_batches(missing) if missing else {}).items():
            out[b] = self._plans.put(b, p)
        return out


class CachedBatchLedger(BatchLedger):
    """A ledger that tells the cached reader the plan of each batch it dispatches."""

    def __init__(self, inner: BatchLedger, reader: CachedBatchReader) -> None:
        super().__init__(inner.db, inner.requests, inner.checkpoints, inner.curves, inner.paths)
        self._reader = reader

    def dispatch_many(self, items: Sequence[DispatchItem]) -> list[BatchRecord | None]:
        out = super().dispatch_many(items)
        self._reader.remember(out)
        return out
