"""Studies: a user's HPO jobs, each owned by one principal."""

from __future__ import annotations

import time
import uuid

from sqlalchemy import select

from stagetree.core.errors import AlreadyExists, Conflict, NotFound
from stagetree.master.store import models as m
from stagetree.master.store.database import Database
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
                s.add(
                    m.Study(
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
            row = s.get(m.Study, study_id)
            if row is None:
                raise NotFound(f"study {study_id!r} does not exist")
            return _study(row)

    def forget_study(self, study_id: str) -> None:
        """Drop a deleted study from any cache in front of this role (none here)."""

    def find_study(self, owner: str, name: str) -> StudyRecord:
        with self.db.tx("find study") as s:
            row = s.scalar(select(m.Study).where(m.Study.owner == owner, m.Study.name == name))
            if row is None:
                raise NotFound(f"study {name!r} does not exist for {owner!r}")
            return _study(row)

    def list_studies(self, owner: str) -> list[StudyRecord]:
        with self.db.tx("list studies") as s:
            rows = s.scalars(select(m.Study).where(m.Study.owner == owner).order_by(m.Study.created_at)).all()
            return [_study(r) for r in rows]


def _study(row: m.Study) -> StudyRecord:
    return StudyRecord(
        row.id,
        row.owner,
        row.name,
        row.fixed_json,
        row.created_at,
        bool(row.retry_user_errors),
        row.curve_every_steps,
        row.curve_max_per_s,
    )
