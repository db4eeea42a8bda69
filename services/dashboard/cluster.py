"""What the Cluster page shows: the hosts (node managers), their slots and what each works on, how busy
the slots were over the last half hour, recent failures and recent policy decisions.

A slot shows the batch that occupies it (its worker started, or the first sent) and, apart, a batch
sent to it ahead of time (the scheduler's lookahead: it starts the moment the slot frees), which does
not make the slot any busier. The caller's work is shown in detail (which study and trials it serves,
its steps and progress, whether its worker's log can be read here); another owner's only as busy.
Failures (what was raised, and where the worker's log is) are the trials' own and listed apart from
the policies' decisions (kills with their reasons, preemptions).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stagetree.core.errors import NotFound
from stagetree.core.failures import parse_failure, worker_log_name
from stagetree.core.lifecycle import NodeManagerState, RequestState
from stagetree.core.utilisation import busy_history
from stagetree.dashboard.views import trial_key
from stagetree.master.auth import Principal
from stagetree.master.service import MasterService
from stagetree.master.store.activity import ActivityReader, RunningBatch
from stagetree.master.store.policy_state import PolicyStateStore

MAX_DECISIONS = 50
MAX_FAILURES = 50
HISTORY_S = 1800.0  # the utilisation history's window
MIN_HISTORY_S = 120.0
HISTORY_BUCKETS = 90
SLOT_TRIALS = 12  # trials named per slot's batch (the count is always whole)
LOG_TAIL_BYTES = 64 * 1024
MAX_LOG_TAIL_BYTES = 4 * 1024 * 1024

# MasterApp.worker_logs, read at each call (the embedded mode sets it once its node manager is built)
WorkerLogs = Callable[[], Callable[[str, int, int], Sequence[Path]] | None]


def occupancy(batches: Sequence[RunningBatch]) -> dict[tuple[str, str], tuple[RunningBatch, list[RunningBatch]]]:
    """(node manager, slot) -> (the batch occupying it, the batches sent to it ahead). The occupant is
    the batch whose worker started (else the first dispatched); a batch on several slots occupies each."""
    on: dict[tuple[str, str], list[RunningBatch]] = defaultdict(list)
    for b in batches:
        for slot in b.slot_ids:
            on[(b.node_manager_id, slot)].append(b)
    out = {}
    for key, bs in on.items():
        bs = sorted(bs, key=lambda b: (b.worker_started_at is None, b.worker_started_at or 0.0, b.batch_id))
        out[key] = (bs[0], bs[1:])
    return out


class ClusterViews:
    def __init__(self, service: MasterService, worker_logs: WorkerLogs = lambda: None) -> None:
        self.svc = service
        self.store = service.store
        self.activity = ActivityReader(service.store.db)
        self.policy_states = PolicyStateStore(service.store.db)
        self.worker_logs = worker_logs

    def cluster(self, who: Principal, telemetry: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
        studies = {s.id: s for s in self.svc.list_studies(who)}
        running = self.activity.running_batches()
        carried = self.activity.batch_requests([b.batch_id for b in running])
        slots_at = occupancy(running)

        def work(b: RunningBatch, ahead: bool) -> dict[str, Any]:
            reqs = [r for r in carried.get(b.batch_id, []) if r[1] in studies]
            if not reqs and not (who.admin or b.scope == who.scope):
                return {"busy": True, "sent_ahead": ahead}
            first = b.stages[0] if b.stages else (0, 0, 0)
            last = b.stages[-1] if b.stages else (0, 0, 0)
            by_study: dict[str, list[str]] = defaultdict(list)
            for rid, sid, label in reqs:
                key = label or f"#{rid}"
                if key not in by_study[sid]:
                    by_study[sid].append(key)
            return {
                "busy": True,
                "sent_ahead": ahead,
                "batch_id": b.batch_id,
                "attempt": b.attempt,
                "started": b.worker_started_at is not None or b.step > first[1],  # its start heard, or its steps
                "studies": [
                    {"id": sid, "name": studies[sid].name, "trials": keys[:SLOT_TRIALS], "trial_count": len(keys)}
                    for sid, keys in sorted(by_study.items())
                ],
                "nodes": [x[0] for x in b.stages],
                "start": first[1],
                "end": last[2],
                "step": max(b.step, first[1]),
                "log": self.worker_logs() is not None,
            }

        hosts = []
        n_slots = busy = ahead = 0
        for nm in self.store.nodes.node_managers():
            slots = []
            for s in nm.slots:
                occ = slots_at.get((nm.id, s.id))
                if nm.state is NodeManagerState.ALIVE:
                    n_slots += 1
                    busy += occ is not None
                    ahead += len(occ[1]) if occ is not None else 0
                slots.append(
                    {
                        "id": s.id,
                        "gpu_type": s.gpu_type,
                        "gpu_index": s.gpu_index,
                        "share": s.share,
                        "cpu_cores": s.cpu_cores,
                        "work": work(occ[0], False) if occ is not None else None,
                        "next": [work(b, True) for b in occ[1]] if occ is not None else [],
                    }
                )
            hosts.append(
                {
                    "id": nm.id,
                    "address": nm.address,
                    "state": str(nm.state),
                    "last_heartbeat": nm.last_heartbeat,
                    "slots": slots,
                    "gpus": [dict(t) for t in telemetry if t.get("node_manager") == nm.id],
                }
            )
        now = time.time()
        ran = self.activity.intervals(now - HISTORY_S)
        # the last half hour, or since the first attempt in it (a young cluster's whole life), 2 min at least
        t0 = max(now - HISTORY_S, min([a for _, _, a, _ in ran], default=now) - 10.0)
        t0 = min(t0, now - MIN_HISTORY_S)
        intervals = [((nm, slot), a, b) for nm, slot, a, b in ran]
        return {
            "node_managers": hosts,
            "summary": {"slots": n_slots, "busy": busy, "sent_ahead": ahead},
            "history": {
                "t0": t0,
                "t1": now,
                "bucket_s": (now - t0) / HISTORY_BUCKETS,
                "busy": [round(x, 3) for x in busy_history(intervals, t0, now, HISTORY_BUCKETS)],
                "slots": n_slots,
            },
            "failures": self.failures(who),
            "decisions": self.decisions(who),
        }

    def failures(self, who: Principal) -> list[dict[str, Any]]:
        """The caller's failed trials, latest first: what was raised and where the worker's log is."""
        out: list[dict[str, Any]] = []
        for st in self.svc.list_studies(who):
            failed = [r for r in self.svc.get_requests(who, st.id, None) if r.state is RequestState.FAILED]
            if not failed:
                continue
            times = self.activity.request_times(st.id)
            for r in failed:
                f = parse_failure(r.error or "")
                out.append(
                    {
                        "study_id": st.id,
                        "study": st.name,
                        "trial": trial_key(r),
                        "request_id": r.id,
                        "step": r.step,
                        "headline": f.headline,
                        "log_path": f.log_path,
                        "node_manager": f.node_manager,
                        "batch_id": r.batch_id,
                        "at": times.get(r.id, (0.0, None))[1],
                    }
                )
        out.sort(key=lambda x: -(x["at"] or 0.0))
        return out[:MAX_FAILURES]

    def decisions(self, who: Principal) -> list[dict[str, Any]]:
        """Recent policy decisions on the caller's studies: trials a policy cancelled (POP kills, with
        their reasons) and batches being preempted (Hermes). A failure is not one (``failures``)."""
        out: list[dict[str, Any]] = []
        studies = self.svc.list_studies(who)
        states = self.policy_states.load([s.id for s in studies])
        for st in studies:
            snap = states.get(st.id, {})
            for b in (snap.get("hermes") or {}).get("preempting", []):
                out.append(
                    {
                        "study_id": st.id,
                        "study": st.name,
                        "kind": "preempt",
                        "what": f"batch {b}",
                        "reason": "time quantum",
                    }
                )
            for k in (snap.get("pending") or {}).get("kills", []):
                out.append(
                    {
                        "study_id": st.id,
                        "study": st.name,
                        "kind": "kill",
                        "what": str(k.get("job")),
                        "reason": str(k.get("reason", "")),
                    }
                )
            for r in self.svc.get_requests(who, st.id, None):
                if r.state is RequestState.CANCELLED and r.error:
                    out.append(
                        {
                            "study_id": st.id,
                            "study": st.name,
                            "kind": "kill",
                            "what": trial_key(r),
                            "reason": r.error.splitlines()[0][:200],
                        }
                    )
        return out[-MAX_DECISIONS:]

    # -- worker logs ----------------------------------------------------------------------------------

    def _log_path(self, who: Principal, study_id: str, batch_id: int, attempt: int) -> str:
        """Where the attempt's worker log is on its node manager's host: the whole path a failure of the
        batch's requests noted, else its name under the work directory's ``logs/``."""
        name = worker_log_name(batch_id, attempt)
        carried = [rid for rid, sid, _ in self.activity.batch_requests([batch_id]).get(batch_id, []) if sid == study_id]
        for r in self.svc.get_requests(who, study_id, carried) if carried else []:
            noted = parse_failure(r.error).log_path if r.error else ""
            if noted.endswith("/" + name):
                return noted
        return f"logs/{name}"

    def worker_log(
        self, who: Principal, study_id: str, batch_id: int, attempt: int, tail_bytes: int = LOG_TAIL_BYTES
    ) -> dict[str, Any]:
        """A batch attempt's worker log, for a batch that ran on a plan of the caller's study: the end of
        its text where this master can read the file (embedded mode), else where the file is (the node
        manager's host and the file's path there); in every mode the lines its trainer logged, which the
        master keeps (``core.loglines``)."""
        study = self.svc.get_study(who, study_id)
        plans = set(self.store.plans.study_plan_ids(study.id))
        row = next((a for a in self.activity.attempts([batch_id]) if a.attempt == attempt), None)
        if row is None or row.plan_id not in plans:
            raise NotFound(f"batch {batch_id} attempt {attempt} did not run for study {study_id!r}")
        source = self.worker_logs()
        files: Sequence[Path] = source(row.node_manager_id, batch_id, attempt) if source is not None else []
        nm = row.node_manager_id
        host = next((x.address for x in self.store.nodes.node_managers() if x.id == nm), "")
        log_path = self._log_path(who, study.id, batch_id, attempt)
        where = (
            f"on node manager {nm}'s host{f' ({host})' if host else ''}: {log_path}"
            + ("" if log_path.startswith("/") else " in the node manager's work directory (STAGETREE_NM_WORK_DIR)")
            + "; this master runs apart from that node manager and does not read its files"
        )
        out: dict[str, Any] = {
            "batch_id": batch_id,
            "attempt": attempt,
            "node_manager": nm,
            "files": [],
            "readable": bool(files),
            "where": "" if files else where,
            "host": host,
            "path": log_path,
            "lines": [
                {"seq": x.seq, "node": x.node, "step": x.step, "at": x.at, "line": x.line}
                for x in self.store.batches.attempt_log_lines(batch_id, attempt)
            ],
        }
        for path in files:
            try:
                size = path.stat().st_size
                with path.open("rb") as fh:
                    fh.seek(max(0, size - tail_bytes))
                    text = fh.read(tail_bytes).decode("utf-8", "replace")
            except OSError as e:
                out["files"].append({"path": str(path), "bytes": 0, "text": "", "truncated": False, "error": str(e)})
                continue
            out["files"].append(
                {"path": str(path), "bytes": size, "text": text, "truncated": size > tail_bytes, "error": ""}
            )
        return out
