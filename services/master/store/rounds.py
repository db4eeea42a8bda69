"""What a scheduling round reads, in one transaction (one turn on SQLite, not six)."""

from __future__ import annotations

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from stagetree.core.batch import Point
from stagetree.core.ids import RequestId, StudyId
from stagetree.core.lifecycle import LIVE_REQUEST_STATES, BatchState, RequestState
from stagetree.master.store import models as m
from stagetree.master.store.batches import RUNNING_SLOTS, BatchReader, slots_in
from stagetree.master.store.checkpoints import CheckpointCatalog
from stagetree.master.store.database import Database, table
from stagetree.master.store.nodes import NodeRegistry
from stagetree.master.store.records import BatchRecord, RoundReads, SlotInfo

_R, _B, _S, _A = table(m.Request), table(m.Batch), table(m.Study), table(m.BatchAttempt)
_PENDING = select(_R.c.id, _R.c.plan_id, _R.c.node_id, _R.c.step, _R.c.study_id, _R.c.created_at).where(
    _R.c.state == RequestState.NOT_SCHED
)
_ANY_PENDING = select(_R.c.id).where(_R.c.state == RequestState.NOT_SCHED).limit(1)
_RUNNING_KEYS = (
    select(_B.c.id, _B.c.plan_id, _B.c.attempt, _B.c.node_manager_id, _A.c.started_at, _A.c.dispatched_at)
    .select_from(_B.outerjoin(_A, (_A.c.batch_id == _B.c.id) & (_A.c.attempt == _B.c.attempt)))
    .where(_B.c.state == BatchState.RUNNING)
)
_SPECS = select(_B.c.id, _B.c.attempt, _B.c.spec_json).where(_B.c.id.in_(bindparam("ids", expanding=True)))
# the study a running batch serves: that of its last request
_BATCH_STUDIES = (
    select(_R.c.batch_id, _R.c.study_id).where(_R.c.batch_id.in_(bindparam("ids", expanding=True))).order_by(_R.c.id)
)
_OWNERS = select(_S.c.id, _S.c.owner).where(_S.c.id.in_(bindparam("ids", expanding=True)))
# on the partial index of the attempts that ran out of memory (a handful): one lookup a round instead of
# the cost learner's own transaction every round
_OUT_OF_MEMORY = select(func.count(), func.max(_A.c.finished_at)).where(_A.c.state == BatchState.OUT_OF_MEMORY)
_SPECS_PER_READ = 500
PATH_NODES_READ = 20_000  # see RoundReader.path_checkpoints
_POLICY_STUDIES = select(_S.c.id, _S.c.fixed_json).where(
    _S.c.fixed_json.like('%"policies"%'),
    select(_R.c.id).where(_R.c.study_id == _S.c.id, _R.c.state.in_(LIVE_REQUEST_STATES)).exists(),
)


class RoundReader:
    def __init__(self, db: Database, nodes: NodeRegistry, batches: BatchReader, checkpoints: CheckpointCatalog) -> None:
        self.db = db
        self.nodes = nodes
        self.batches = batches
        self.checkpoints = checkpoints
        # (batch id, attempt) -> the running batch's record: a spec (and slot) never changes once an attempt
        # is dispatched, so each round reads only the specs of attempts it has not seen (a few a round, not
        # every running batch's kilobytes); the same for the study it serves and when it was dispatched
        self._records: dict[tuple[int, int], BatchRecord] = {}
        self._studies: dict[tuple[int, int], tuple[str | None, float]] = {}
        self._owners: dict[str, str] = {}  # a study's owner never changes
        self._dispatched: dict[tuple[int, int], float] = {}  # of the attempts a round sees for the first time
        self._slots: dict[str, tuple[float, tuple[SlotInfo, ...]]] = {}  # see NodeRegistry.node_managers_cached_in

    def round_reads(self) -> RoundReads:
        """Everything a scheduling round reads, in one transaction, but the checkpoints: those are read
        for the paths of the pending work (``path_checkpoints``) once the plans say what the paths are."""
        with self.db.tx("round reads") as s:
            nms = self.nodes.node_managers_cached_in(s, self._slots)
            policies = self._policy_studies_in(s)
            studies: dict[RequestId, StudyId] = {}
            arrivals: dict[RequestId, float] = {}
            pending = self._pending_in(s, studies, arrivals)
            started: dict[tuple[int, int], float] = {}
            running = self._running_in(s, started)
            served = self._served_in(s, running)
            owners = self._owners_in(s, {*studies.values(), *(sid for sid, _ in served.values() if sid is not None)})
            unable = self.batches.host_problems_in(s) if pending else {}
            oom = s.execute(_OUT_OF_MEMORY).one()
        busy = {(b.node_manager_id, slot) for b in running if b.node_manager_id for slot in b.slot_ids}
        return RoundReads(
            nms, busy, policies, pending, running, started, studies, arrivals, served, owners, unable,
            (int(oom[0]), None if oom[1] is None else float(oom[1])),
        )  # fmt: skip

    def path_checkpoints(self, nodes: list[int], plans: list[int]) -> dict[int, dict[Point, str]]:
        """Checkpoint uri per point, per node, on ``nodes`` (the pending work's paths in ``plans``). Past
        ``PATH_NODES_READ`` nodes, every checkpoint of the plans is read instead: a list of 100k node ids
        cost more than the plans' checkpoints when the pending work is most of the plans."""
        with self.db.tx("path checkpoints") as s:
            if len(nodes) <= PATH_NODES_READ:
                return self.checkpoints.checkpoints_on(s, nodes)
            out: dict[int, dict[Point, str]] = {}
            for per_plan in self.checkpoints.checkpoints_in(s, plans).values():
                for p, uri in per_plan.items():
                    out.setdefault(p.node, {})[p] = uri
            return out

    def _running_in(self, s: Session, started: dict[tuple[int, int], float] | None = None) -> list[BatchRecord]:
        """Every running batch, its record built once per attempt (a round reads 1,600 of them at 1,600
        slots; building each again every round was 8% of the round's samples under py-spy). ``started``
        gets the start time of those whose worker said it started."""
        kept = self._records
        now: dict[tuple[int, int], BatchRecord] = {}
        new: list[tuple[int, int, int, str | None]] = []
        self._dispatched = {}
        for i, p, a, nm, began, sent in self.db.rows(s, _RUNNING_KEYS):
            if began is not None and started is not None:
                started[(int(i), int(a))] = float(began)
            if (i, a) not in self._studies and sent is not None:
                self._dispatched[(int(i), int(a))] = float(sent)
            rec = kept.get((i, a))
            if rec is None:
                new.append((int(i), int(p), int(a), nm))
            else:
                now[(i, a)] = rec
        missing = sorted({i for i, _, _, _ in new})
        specs: dict[tuple[int, int], str] = {}
        for k in range(0, len(missing), _SPECS_PER_READ):
            for i, a, spec in self.db.rows(s, _SPECS, {"ids": missing[k : k + _SPECS_PER_READ]}):
                specs[(int(i), int(a))] = str(spec)  # a batch retried since the first read has a new spec
        slots = slots_in(self.db, s, missing) if missing else {}
        for i, p, a, nm in new:
            spec = specs.get((i, a))
            if spec is not None:
                now[(i, a)] = BatchRecord(i, p, BatchState.RUNNING, a, spec, nm, slots.get(i, ()))
        self._records = now
        return list(now.values())

    def any_pending(self) -> bool:
        """Whether some request waits to be scheduled (one indexed row at most)."""
        with self.db.tx("any pending") as s:
            return s.execute(_ANY_PENDING).first() is not None

    def pending(self) -> dict[int, list[tuple[int, Point]]]:
        """(request id, point) of every NOT_SCHED request, per plan."""
        with self.db.tx("load pending") as s:
            return self._pending_in(s, {}, {})

    def busy_slots(self) -> set[tuple[str, str]]:
        """(node manager, slot) of every running batch."""
        with self.db.tx("busy slots") as s:
            return self._busy_in(s)

    def policy_studies(self) -> list[tuple[str, str]]:
        """(study id, fixed json) of the studies that chose policies and have live requests."""
        with self.db.tx("policy studies") as s:
            return self._policy_studies_in(s)

    def _pending_in(
        self, s: Session, studies: dict[RequestId, StudyId], arrivals: dict[RequestId, float]
    ) -> dict[int, list[tuple[int, Point]]]:
        """Per plan, (request id, point) of every NOT_SCHED request; each one's study into ``studies``
        and its arrival into ``arrivals``."""
        out: dict[int, list[tuple[int, Point]]] = {}
        for rid, pid, node, step, sid, created in self.db.rows(s, _PENDING):
            out.setdefault(pid, []).append((rid, Point(node, step)))
            studies[rid] = sid
            arrivals[rid] = created
        return out

    def _served_in(self, s: Session, running: list[BatchRecord]) -> dict[tuple[int, int], tuple[str | None, float]]:
        """(batch, attempt) -> (the study of its last request, when it was dispatched), read once per
        attempt (``_RUNNING_KEYS`` brought the dispatch times of the new ones)."""
        kept = self._studies
        now = {(b.id, b.attempt): kept[(b.id, b.attempt)] for b in running if (b.id, b.attempt) in kept}
        new = [b for b in running if (b.id, b.attempt) not in kept]
        if new:
            last: dict[int, str] = {}
            ids = sorted({b.id for b in new})
            for k in range(0, len(ids), _SPECS_PER_READ):
                for bid, sid in self.db.rows(s, _BATCH_STUDIES, {"ids": ids[k : k + _SPECS_PER_READ]}):
                    last[int(bid)] = str(sid)
            for b in new:
                now[(b.id, b.attempt)] = (last.get(b.id), self._dispatched.get((b.id, b.attempt), 0.0))
        self._studies = now
        return now

    def _owners_in(self, s: Session, studies: set[str]) -> dict[str, str]:
        """Each of these studies' owner (kept: an owner never changes)."""
        missing = sorted(sid for sid in studies if sid not in self._owners)
        for k in range(0, len(missing), _SPECS_PER_READ):
            for sid, owner in self.db.rows(s, _OWNERS, {"ids": missing[k : k + _SPECS_PER_READ]}):
                self._owners[str(sid)] = str(owner)
        return {sid: self._owners[sid] for sid in studies if sid in self._owners}

    def _busy_in(self, s: Session) -> set[tuple[str, str]]:
        return {(str(nm), str(slot)) for _b, _r, slot, nm in self.db.rows(s, RUNNING_SLOTS) if nm is not None}

    @staticmethod
    def _policy_studies_in(s: Session) -> list[tuple[str, str]]:
        return [(str(i), str(f)) for i, f in s.connection().execute(_POLICY_STUDIES)]
