"""The saved soft state of each study's scheduling policies (table ``policy_states``, one row a study).

``PolicyStateStore`` reads and upserts the snapshots ``core.policies.state.PolicyState`` makes; what
they mean and when they are written is ``stagetree.master.policies``'s business. It uses the shared
``Database``'s transactions and its dialect's INSERT (for the upsert).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select

from stagetree.master.store import models as m
from stagetree.master.store.database import Database, table


class PolicyStateStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    def load(self, study_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The saved state of each of these studies that has one."""
        ids = sorted(set(study_ids))
        out: dict[str, dict[str, Any]] = {}
        with self._db.tx("load policy state") as s:
            for i in range(0, len(ids), 1000):
                q = select(m.PolicyState.study_id, m.PolicyState.state).where(
                    m.PolicyState.study_id.in_(ids[i : i + 1000])
                )
                for sid, state in s.execute(q):
                    out[str(sid)] = dict(state)
        return out

    def save(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the saved state of each of these studies, all in one transaction."""
        if not states:
            return
        now = time.time()
        stmt = self._db.insert(table(m.PolicyState))
        stmt = stmt.on_conflict_do_update(
            index_elements=["study_id"], set_={"state": stmt.excluded.state, "updated_at": stmt.excluded.updated_at}
        )
        rows = [{"study_id": sid, "state": dict(state), "updated_at": now} for sid, state in sorted(states.items())]
        with self._db.tx("save policy state") as s:
            s.execute(stmt, rows)
