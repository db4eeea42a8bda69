"""GPU telemetry: the latest sample per (node manager, GPU), written by the aggregators (which see the
telemetry topic) and read by the master's dashboard. A sample older than the one stored is ignored."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import delete, select, tuple_

from stagetree.master.store import models as m
from stagetree.master.store.database import Database

KEEP_S = 24 * 3600.0  # samples of a GPU not heard from for this long are dropped


class TelemetryStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def keep(self, samples: Sequence[Mapping[str, Any]], now: float | None = None) -> int:
        """Store each sample (a ``GpuTelemetry.to_json()``: ``node_manager``, ``gpu_index``, ``ts``, ...)
        unless a newer one of that GPU is stored; drops samples older than ``KEEP_S``. Returns how many
        were stored."""
        latest: dict[tuple[str, int], Mapping[str, Any]] = {}
        for smp in samples:
            key = (str(smp["node_manager"]), int(smp["gpu_index"]))
            if key not in latest or float(latest[key]["ts"]) <= float(smp["ts"]):
                latest[key] = smp
        now = time.time() if now is None else now
        with self.db.tx("keep gpu telemetry") as s:
            s.execute(delete(m.GpuSample).where(m.GpuSample.ts < now - KEEP_S))
            if not latest:
                return 0
            keys = sorted(latest)
            stored = {
                (nm, gpu): ts
                for nm, gpu, ts in s.execute(
                    select(m.GpuSample.node_manager, m.GpuSample.gpu_index, m.GpuSample.ts).where(
                        tuple_(m.GpuSample.node_manager, m.GpuSample.gpu_index).in_(keys)
                    )
                )
            }
            newer = [k for k in keys if k not in stored or stored[k] <= float(latest[k]["ts"])]
            if not newer:
                return 0
            s.execute(delete(m.GpuSample).where(tuple_(m.GpuSample.node_manager, m.GpuSample.gpu_index).in_(newer)))
            s.add_all(
                m.GpuSample(node_manager=nm, gpu_index=gpu, sample=dict(latest[(nm, gpu)]), ts=latest[(nm, gpu)]["ts"])
                for nm, gpu in newer
            )
            return len(newer)

    def latest(self, max_age_s: float = 120.0, now: float | None = None) -> list[dict[str, Any]]:
        """The stored samples no older than ``max_age_s``, by node manager and GPU."""
        now = time.time() if now is None else now
        with self.db.tx("read gpu telemetry") as s:
            rows = s.scalars(
                select(m.GpuSample.sample)
                .where(m.GpuSample.ts >= now - max_age_s)
                .order_by(m.GpuSample.node_manager, m.GpuSample.gpu_index)
            ).all()
        return [dict(r) for r in rows]
