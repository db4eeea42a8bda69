"""The node-manager registry (who is alive, with which slots) and each node manager's outbox: the batch
attempts placed on it and the control actions (abort, preempt, delete checkpoints) queued for it, each
sent exactly once on its assignment stream."""

from __future__ import annotations

import time
from collections.abc import Sequence

from sqlalchemy import bindparam, case, select, update
from sqlalchemy.orm import Session

from stagetree.core.errors import NotFound
from stagetree.core.lifecycle import Assignment, AssignmentKind, BatchState, NodeManagerState
from stagetree.core.slots import SlotInfo
from stagetree.master.store import models as m
from stagetree.master.store.database import Database, table
from stagetree.master.store.records import NodeManagerRecord

ALIVE, LOST, LEFT = NodeManagerState.ALIVE, NodeManagerState.LOST, NodeManagerState.LEFT

_A, _B, _NA, _SL, _NM, _HP = (
    table(t) for t in (m.BatchAttempt, m.Batch, m.NodeManagerAction, m.SlotRow, m.NodeManager, m.HostProblem)
)
_SLOTS = select(
    _SL.c.node_manager_id,
    _SL.c.slot_id,
    _SL.c.gpu_type,
    _SL.c.memory_bytes,
    _SL.c.compute_capability,
    _SL.c.share,
    _SL.c.cpu_cores,
    _SL.c.gpu_index,
).order_by(_SL.c.slot_id)
_NODE_MANAGERS = select(_NM.c.id, _NM.c.address, _NM.c.state, _NM.c.last_heartbeat).order_by(_NM.c.id)
_NODE_MANAGER_KEYS = select(_NM.c.id, _NM.c.address, _NM.c.state, _NM.c.last_heartbeat, _NM.c.registered_at).order_by(
    _NM.c.id
)
_SLOTS_OF = _SLOTS.where(_SL.c.node_manager_id.in_(bindparam("nms", expanding=True)))
_CLAIM_ATTEMPTS = (
    update(_A)
    .where(
        _A.c.node_manager_id.in_(bindparam("nms", expanding=True)),
        _A.c.state == BatchState.RUNNING,
        _A.c.sent_at.is_(None),
    )
    .values(sent_at=bindparam("t"))
    .returning(_A.c.node_manager_id, _A.c.batch_id, _A.c.attempt, _A.c.slot_id)
)
_SPECS = select(_B.c.id, _B.c.spec_json).where(_B.c.id.in_(bindparam("ids", expanding=True)))
_CLAIM_ACTIONS = (
    update(_NA)
    .where(_NA.c.node_manager_id.in_(bindparam("nms", expanding=True)), _NA.c.sent_at.is_(None))
    .values(sent_at=bindparam("t"))
    .returning(_NA.c.node_manager_id, _NA.c.id, _NA.c.kind, _NA.c.batch_id, _NA.c.attempt, _NA.c.payload)
)
# the node managers with something not yet sent (both looks are on a few rows: partial index, small table)
_UNSENT = (
    select(_A.c.node_manager_id)
    .where(_A.c.sent_at.is_(None), _A.c.state == BatchState.RUNNING)
    .union(select(_NA.c.node_manager_id).where(_NA.c.sent_at.is_(None)))
)


def enqueue_action(
    s: Session, nm_id: str, kind: AssignmentKind, batch_id: int = 0, attempt: int = 0, uris: Sequence[str] = ()
) -> None:
    """Queue a control action for a node manager inside the caller's transaction."""
    s.add(
        m.NodeManagerAction(
            node_manager_id=nm_id,
            kind=kind,
            batch_id=batch_id,
            attempt=attempt,
            payload={"uris": list(uris)},
            created_at=time.time(),
        )
    )


class NodeRegistry:
    def __init__(self, db: Database) -> None:
        self.db = db

    def register_node_manager(self, nm_id: str, address: str, slots: Sequence[SlotInfo | tuple[str, str]]) -> None:
        infos = [s if isinstance(s, SlotInfo) else SlotInfo(s[0], s[1]) for s in slots]
        now = time.time()
        with self.db.tx("register node manager") as s:
            row = s.get(m.NodeManager, nm_id, with_for_update=True)
            if row is None:
                s.add(m.NodeManager(id=nm_id, address=address, state=ALIVE, registered_at=now, last_heartbeat=now))
            else:
                # registered_at is the latest registration: the slots below are its (rounds cache them by it)
                row.address, row.state, row.last_heartbeat, row.registered_at = address, ALIVE, now, now
            s.flush()
            # a node manager registering again may have been restarted with the modules it lacked
            s.execute(_HP.delete().where(_HP.c.node_manager_id == nm_id))
            s.execute(_SL.delete().where(_SL.c.node_manager_id == nm_id))
            s.add_all(
                m.SlotRow(
                    node_manager_id=nm_id,
                    slot_id=i.id,
                    gpu_type=i.gpu_type,
                    memory_bytes=i.memory_bytes,
                    compute_capability=i.compute_capability,
                    share=i.share,
                    cpu_cores=i.cpu_cores,
                    gpu_index=i.gpu_index,
                )
                for i in infos
            )

    def heartbeat(self, nm_id: str) -> None:
        if nm_id not in self.heartbeat_many([nm_id]):
            raise NotFound(f"node manager {nm_id!r} is not registered; register it first")

    def heartbeat_many(self, nm_ids: Sequence[str]) -> set[str]:
        """Mark these node managers alive now, in one statement (the heartbeats that arrived together);
        returns those that are registered. One that left stays ``LEFT``, its leave's time kept: a
        heartbeat that reaches the master after the leave (held up in a batch of heartbeats) is older
        than it, and only a registration brings the node manager back."""
        if not nm_ids:
            return set()
        left = _NM.c.state == LEFT
        with self.db.tx("heartbeat") as s:
            res = s.execute(
                update(_NM)
                .where(_NM.c.id.in_(sorted(set(nm_ids))))
                .values(
                    last_heartbeat=case((left, _NM.c.last_heartbeat), else_=time.time()),
                    state=case((left, LEFT), else_=ALIVE),
                )
                .returning(_NM.c.id)
            )
            return {str(i) for (i,) in res}

    def node_managers(self) -> list[NodeManagerRecord]:
        with self.db.tx("list node managers") as s:
            return self.node_managers_in(s)

    @staticmethod
    def node_managers_in(s: Session) -> list[NodeManagerRecord]:
        # plain column rows, not ORM objects: every scheduling round reads these
        infos: dict[str, list[SlotInfo]] = {}
        c = s.connection()
        for nm_id, sid, gpu, mem, cc, share, cores, index in c.execute(_SLOTS):
            infos.setdefault(nm_id, []).append(SlotInfo(sid, gpu, mem, cc, share, cores, index))
        out = []
        for nm_id, address, state, beat in c.execute(_NODE_MANAGERS):
            out.append(NodeManagerRecord(nm_id, address, NodeManagerState(state), beat, tuple(infos.get(nm_id, ()))))
        return out

    def node_managers_cached_in(
        self, s: Session, cache: dict[str, tuple[float, tuple[SlotInfo, ...]]]
    ) -> list[NodeManagerRecord]:
        """``node_managers_in``, reading the slots only of node managers registered since ``cache`` (node
        manager -> (registered at, slots)) saw them, and updating it: slots change only when a node
        manager registers, and a round of a 1,600-slot cluster read every slot row each time."""
        c = s.connection()
        rows = c.execute(_NODE_MANAGER_KEYS).all()
        stale = [str(nm_id) for nm_id, _, _, _, at in rows if cache.get(nm_id, (None,))[0] != at]
        if stale:
            infos: dict[str, list[SlotInfo]] = {nm: [] for nm in stale}
            for i in range(0, len(stale), 500):
                for nm_id, sid, gpu, mem, cc, share, cores, index in c.execute(_SLOTS_OF, {"nms": stale[i : i + 500]}):
                    infos[nm_id].append(SlotInfo(sid, gpu, mem, cc, share, cores, index))
            at_of = {str(nm_id): float(at) for nm_id, _, _, _, at in rows}
            for nm, slots in infos.items():
                cache[nm] = (at_of[nm], tuple(slots))
        live = {str(nm_id) for nm_id, *_ in rows}
        for gone in [nm for nm in cache if nm not in live]:
            del cache[gone]
        return [
            NodeManagerRecord(nm_id, address, NodeManagerState(state), beat, cache[nm_id][1])
            for nm_id, address, state, beat, _ in rows
        ]

    def take_assignments(self, nm_id: str) -> list[Assignment]:
        """Running attempts for this node manager not yet sent, then its queued control actions; each is
        marked sent exactly once even when two streams (or two masters) race for it."""
        return self.take_assignments_many([nm_id])[nm_id]

    def take_assignments_many(self, nm_ids: Sequence[str]) -> dict[str, list[Assignment]]:
        """``take_assignments`` of several node managers in one transaction (the streams a round woke)."""
        nms = sorted(set(nm_ids))
        out: dict[str, list[Assignment]] = {nm: [] for nm in nms}
        if not nms:
            return out
        now = time.time()
        with self.db.tx("take assignments") as s:
            c = s.connection()
            # each row is claimed by one UPDATE only (sent_at IS NULL is checked again under its lock)
            claimed = sorted(c.execute(_CLAIM_ATTEMPTS, {"nms": nms, "t": now}).all(), key=lambda r: (r[1], r[2]))
            specs = dict(c.execute(_SPECS, {"ids": [r[1] for r in claimed]}).all()) if claimed else {}
            actions = sorted(c.execute(_CLAIM_ACTIONS, {"nms": nms, "t": now}).all(), key=lambda r: r[1])
        for nm, bid, att, slot in claimed:
            out[nm].append(Assignment(int(bid), int(att), spec_json=specs[bid], slot_id=slot or ""))
        for nm, _id, kind, bid, att, payload in actions:
            uris = tuple(str(u) for u in (payload or {}).get("uris", ()))
            out[nm].append(Assignment(int(bid), int(att), AssignmentKind(kind), checkpoint_uris=uris))
        return out

    def with_unsent(self) -> set[str]:
        """The node managers that have attempts or control actions not yet sent."""
        with self.db.tx("unsent assignments") as s:
            return {str(nm) for (nm,) in s.connection().execute(_UNSENT)}
