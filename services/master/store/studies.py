"""Studies: a user's HPO jobs, each owned by one principal.

Read and written with SQLAlchemy Core: the ORM's first query of a mapped class compiles its loader
(some 75 ms of a process's CPU, paid by every embedded study's first submit).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from sqlalchemy import insert, select

from stagetree.core.errors import AlreadyExists, Conflict, NotFound
from stagetree.master.store import models as m
from stagetree.master.store.database import Database, table
from stagetree.master.store.records import StudyRecord


class StudyStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create_study(
        self,
        owner: str,
        name: str,
        fixed_json: str | None,
        *,
        retry_user_errors: bool = False,
        curve_every_steps: int | None = None,
        curve_max_per_s: float | None = None,
    ) -> StudyRecord:
        """A new study; ``curve_*`` None keep the master's defaults (checked by the caller)."""
        every, rate = curve_every_steps, curve_max_per_s
        rec = StudyRecord(uuid.uuid4().hex, owner, name, fixed_json, time.time(), retry_user_errors, every, rate)
        try:
            with self.db.tx("create study") as s:
                s.execute(
                    insert(_S).values(
                        id=rec.id,
                        owner=owner,
                        name=name,
                        fixed_json=fixed_json,
                        created_at=rec.created_at,
                        retry_user_errors=retry_user_errors,
                        curve_every_steps=every,
                        curve_max_per_s=rate,
                    )
                )
        except Conflict as e:
            raise AlreadyExists(f"study {name!r} already exists for {owner!r}; pick another name") from e
        return rec

    def get_study(self, study_id: str) -> StudyRecord:
        with self.db.tx("get study") as s:
            row = s.execute(_STUDY.where(_S.c.id == study_id)).first()
            if row is None:
                raise NotFound(f"study {study_id!r} does not exist")
            return _study(row)

    def forget_study(self, study_id: str) -> None:
        """Drop a deleted study from any cache in front of this role (none here)."""

    def find_study(self, owner: str, name: str) -> StudyRecord:
        with self.db.tx("find study") as s:
            row = s.execute(_STUDY.where(_S.c.owner == owner, _S.c.name == name)).first()
            if row is None:
                raise NotFound(f"study {name!r} does not exist for {owner!r}")
            return _study(row)

    def list_studies(self, owner: str) -> list[StudyRecord]:
        with self.db.tx("list studies") as s:
            rows = s.execute(_STUDY.where(_S.c.owner == owner).order_by(_S.c.created_at)).all()
            return [_study(r) for r in rows]


_S = table(m.Study)
_STUDY = select(
    _S.c.id,
    _S.c.owner,
    _S.c.name,
    _S.c.fixed_json,
    _S.c.created_at,
    _S.c.retry_user_errors,
    _S.c.curve_every_steps,
    _S.c.curve_max_per_s,
)


def _study(row: Any) -> StudyRecord:
    i, owner, name, fixed_json, created_at, retry, every, rate = row
    return StudyRecord(
        str(i),
        str(owner),
        str(name),
        fixed_json,
        float(created_at),
        bool(retry),
        None if every is None else int(every),
        None if rate is None else float(rate),
    )
