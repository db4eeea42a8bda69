"""The master's store: the search-plan database, split by role over one shared :class:`Database`.

    Store
    ├── studies      StudyStore          studies and their owners
    ├── plans        PlanStore           plans and their append-only node trees
    ├── requests     RequestStore        requests and the metrics that answer them
    ├── checkpoints  CheckpointCatalog   checkpoints by canonical point
    ├── curves       CurveStore          learning-curve points by canonical point
    ├── ledger       BatchLedger         batches, attempts, and how an attempt's end is persisted
    ├── batches      BatchReader         batches and attempts, read (what they trained, how long they took)
    ├── paths        PathChangeStore     resumes on another number of ranks (the plan's path changes)
    ├── nodes        NodeRegistry        node managers, their slots and outboxes
    ├── rounds       RoundReader         what a scheduling round reads, in one transaction
    ├── stats        StatsReader         what sharing bought a study
    └── retention    Retention           deleting a study, forgetting what a plan computed

Each caller takes the role it uses. Rows that never change are cached in front of the roles
(``cache``); the same contract suite runs every role on Postgres and SQLite.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

from stagetree.master.store.batches import BatchReader
from stagetree.master.store.cache import CachedBatchLedger, CachedBatchReader, CachedPlanStore, CachedStudyStore
from stagetree.master.store.checkpoints import CheckpointCatalog
from stagetree.master.store.curves import CurveStore
from stagetree.master.store.database import Database, make_engine
from stagetree.master.store.ledger import BatchLedger
from stagetree.master.store.nodes import NodeRegistry
from stagetree.master.store.paths import PathChangeStore
from stagetree.master.store.plans import PlanStore
from stagetree.master.store.requests import RequestStore
from stagetree.master.store.retention import Retention
from stagetree.master.store.rounds import RoundReader
from stagetree.master.store.stats import StatsReader
from stagetree.master.store.studies import StudyStore
from stagetree.master.store.telemetry import TelemetryStore

__all__ = ["Store", "make_engine"]


@dataclass(frozen=True)
class Store:
    db: Database
    studies: StudyStore
    plans: PlanStore
    requests: RequestStore
    checkpoints: CheckpointCatalog
    ledger: BatchLedger
    nodes: NodeRegistry
    rounds: RoundReader
    stats: StatsReader
    retention: Retention
    curves: CurveStore
    telemetry: TelemetryStore
    paths: PathChangeStore
    batches: BatchReader

    @classmethod
    def open(cls, engine: Engine, *, check: bool = True, cached: bool = True) -> Store:
        """Every role over one database (``check``: refuse an old schema, with the command that fixes it)."""
        db = Database(engine, check=check)
        requests, checkpoints, nodes, curves = RequestStore(db), CheckpointCatalog(db), NodeRegistry(db), CurveStore(db)
        paths = PathChangeStore(db)
        studies, plans = StudyStore(db), PlanStore(db)
        ledger, batches = BatchLedger(db, requests, checkpoints, curves, paths), BatchReader(db)
        if cached:
            studies, plans, batches = CachedStudyStore(studies), CachedPlanStore(plans), CachedBatchReader(batches)
            ledger = CachedBatchLedger(ledger, batches)
        rounds = RoundReader(db, nodes, batches, checkpoints)
        stats, retention = StatsReader(db), Retention(db)
        telemetry = TelemetryStore(db)
        return cls(
            db,
            studies,
            plans,
            requests,
            checkpoints,
            ledger,
            nodes,
            rounds,
            stats,
            retention,
            curves,
            telemetry,
            paths,
            batches,
        )

    def dispose(self) -> None:
        self.db.dispose()
