"""The scheduling loop: event-driven rounds, each read -> ``plan_round`` -> apply.

A round (``SchedulingLoop.run_round``) requeues the work of node managers whose heartbeat key lapsed,
reads its input (``master.round_read``), calls the pure round ``stagetree.core.round.plan_round`` (the
function the simulator calls) and carries its decision out (``master.round_apply``). Only the holder of
the leader lease runs rounds (``run``); a standby keeps trying to take the lease and takes over when it
lapses, and loads the policies' saved state before its first round (``master.policies``). The loop wakes
on every wake-up, at least every ``round_interval_s``, and when the round asks (``wake_at``: a busy slot
coming within the lookahead of its end, a time-sharing quantum's end, a search trial's next evaluation
boundary). After a round that left nothing to do until work is pending (``RoundReport.quiet``), a wake-up
runs a round only if some request is pending (``_next_round``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from stagetree.core.errors import Unavailable
from stagetree.core.ids import BatchId
from stagetree.core.round import RoundDecision, plan_round
from stagetree.gcpause import gc_paused
from stagetree.master import metrics
from stagetree.master.checkpoint_files import CheckpointFiles, NodeManagersDeleteFiles
from stagetree.master.coordination import Coordination, Subscription
from stagetree.master.costs import CostLearner
from stagetree.master.plans import PlanCache
from stagetree.master.policies import PolicyStates
from stagetree.master.round_apply import DecisionApplier
from stagetree.master.round_read import InputReader, RoundRead
from stagetree.master.service import CH_ROUND
from stagetree.master.settings import SchedulingSettings
from stagetree.master.store.nodes import ALIVE, LEFT
from stagetree.master.store.records import NodeManagerRecord, RoundReads
from stagetree.master.store.store import Store

log = logging.getLogger(__name__)

# how often the loop's rounds look for lapsed heartbeats (200 node managers' liveness keys each round
# were a twentieth of a round on a busy cluster; tests.bench.scale)
LIVENESS_CHECK_S = 1.0
SLOW_ROUND_S = 1.0  # a round this long is logged with where its time went


@dataclass(frozen=True)
class RoundReport:
    pending: int
    dispatched: list[BatchId]
    lost_node_managers: list[str]
    queued: int
    snapshot_ms: float
    decide_ms: float
    wake_at: float | None = None  # when the round asked to run again (time.time())
    # nothing the next round must do unless work is pending: a wake-up (a batch that ended, a checkpoint
    # written) that finds none pending runs no round (``SchedulingLoop._next_round``)
    quiet: bool = False


@dataclass(frozen=True)
class Decided:
    """A round's read and decision, before anything is written."""

    read: RoundRead
    decision: RoundDecision
    decide_ms: float

    @property
    def pending(self) -> int:
        return self.read.pending


class SchedulingLoop:
    def __init__(
        self,
        store: Store,
        plans: PlanCache,
        coordination: Coordination,
        settings: SchedulingSettings,
        instance_id: str,
        files: CheckpointFiles | None = None,
    ) -> None:
        self.store = store
        self.plans = plans
        self.coord = coordination
        self.settings = settings
        self.instance_id = instance_id
        self.files = files if files is not None else NodeManagersDeleteFiles()
        self.is_leader = False
        # when this instance started leading (construction, then each lease taken): see requeue_lost
        self.leader_since = time.time()
        self.costs = CostLearner(settings.default_step_seconds)
        self.policies = PolicyStates(store, settings.policy_state_save_s)
        self.reader = InputReader(store, plans, self.costs, self.policies)
        self.applier = DecisionApplier(store, plans, coordination, self.policies)
        self._round_thread: ThreadPoolExecutor | None = None  # run's own thread for the rounds
        self._settled: set[tuple[str, float]] = set()  # node managers that left, looked at a TTL later

    # -- one round ------------------------------------------------------------------------------

    def requeue_lost(self, nms: Sequence[NodeManagerRecord] | None = None) -> list[str]:
        """Requeue the work of node managers whose heartbeat key lapsed. A master that just started
        leading (restarted, or a standby taking over) gives the node managers it has not heard from yet
        one heartbeat TTL to reconnect: while no master ran, their keys lapsed with nobody to renew them.
        A node manager that left (``LEFT``) keeps the work it listed for one heartbeat TTL, for its
        reports to arrive; what is still running on it then is requeued, once (it stays ``LEFT``)."""
        every = self.store.nodes.node_managers() if nms is None else nms
        nms = [n for n in every if n.state == ALIVE]
        alive = self.coord.alive(n.id for n in nms)
        now, since = time.time(), self.leader_since
        grace = now < since + self.settings.heartbeat_ttl_s
        lost = []
        for n in nms:
            if n.id in alive or (grace and n.last_heartbeat <= since):
                continue
            # as read: a node manager that registered or heartbeated since is not lost
            batches = self.store.ledger.mark_lost(n.id, seen=(ALIVE, n.last_heartbeat))
            if batches is not None:
                lost.append(n.id)
                log.warning("node manager lost; work requeued", extra={"node_manager_id": n.id, "batches": batches})
        for n in every:
            key = (n.id, n.last_heartbeat)
            if n.state == LEFT and now >= n.last_heartbeat + self.settings.heartbeat_ttl_s and key not in self._settled:
                self._settled.add(key)
                if batches := self.store.ledger.mark_lost(n.id, state=LEFT, seen=(LEFT, n.last_heartbeat)):
                    lost.append(n.id)
                    log.warning(
                        "node manager left with work whose report never came; requeued",
                        extra={"node_manager_id": n.id, "batches": batches},
                    )
        return lost

    def decide(self, reads: RoundReads | None = None) -> Decided:
        """Read the round's input (from ``reads`` when the caller has just read them) and run the round.
        Writes nothing.

        The cyclic garbage collector is paused meanwhile (``gcpause``): a round allocates tens of
        thousands of short-lived, acyclic objects, and the collections they trigger walk the whole plan
        cache. Reference counting still frees them."""
        with gc_paused():
            read = self.reader.read(self.settings, reads)
            t0 = time.perf_counter()
            decision = plan_round(read.input)
            return Decided(read, decision, (time.perf_counter() - t0) * 1000)

    def run_round(self, check_lost: bool = True) -> RoundReport:
        """One round. ``check_lost``: look for node managers whose heartbeat lapsed first (the loop does
        it at most every ``LIVENESS_CHECK_S``: a lapse is seen a heartbeat TTL late anyway)."""
        t0 = time.monotonic()
        reads = self.store.rounds.round_reads()  # one read serves the liveness check, the free slots, the forest
        lost = self.requeue_lost(reads.node_managers) if check_lost else []
        if lost:
            reads = self.store.rounds.round_reads()
        t_read = time.monotonic()
        decided = self.decide(reads)
        t_write = time.monotonic()
        dec = decided.decision
        applied = self.applier.apply(dec, decided.read, self.settings, self.files)
        self.reader.sent(applied.sent)
        took = time.monotonic() - t0
        metrics.observe_round(took, applied.dispatched, applied.ahead)
        if took >= SLOW_ROUND_S:
            log.warning(
                "slow scheduling round",
                extra={
                    "round_ms": round(took * 1000),
                    "read_ms": round((t_read - t0) * 1000),
                    "snapshot_ms": round(decided.read.snapshot_ms),
                    "decide_ms": round(decided.decide_ms),
                    "dispatch_ms": round((time.monotonic() - t_write) * 1000),
                    "pending": decided.pending,
                    "dispatched": len(applied.dispatched),
                },
            )
        return RoundReport(
            decided.pending,
            applied.dispatched,
            lost,
            dec.queued,
            decided.read.snapshot_ms,
            decided.decide_ms,
            dec.wake_at,
            quiet=not lost and self._quiet(decided),
        )

    def _quiet(self, decided: Decided) -> bool:
        """Whether the round left nothing to do until work is pending: no study's policies learning or
        holding state (they may kill or preempt on reports alone), no checkpoint budget (a checkpoint
        written may put the store over it), no preemption, kill or eviction under way, no time it asked to
        run again. Work it could not place is pending, and ``_next_round`` reads that before it skips."""
        dec = decided.decision
        return (
            not (dec.preempts or dec.kills or dec.evictions or dec.unplaceable)
            and dec.wake_at is None
            and dec.state.empty()
            and not decided.read.input.policies
            and self.settings.checkpoint_budget_bytes is None
        )

    # -- the loop -------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Rounds on every wake-up (and at least every ``round_interval_s``) while holding the lease."""
        wakeups = await self.coord.subscribe(CH_ROUND)  # keeps a wake-up that comes during a round
        self._round_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rounds")
        try:
            await self._rounds(stop, wakeups)
        finally:
            self._round_thread.shutdown(wait=False)
            await wakeups.close()
            with contextlib.suppress(Unavailable):  # it lapses by itself
                await asyncio.to_thread(self.coord.release_lease, self.instance_id)

    async def _rounds(self, stop: asyncio.Event, wakeups: Subscription) -> None:
        s = self.settings
        checked_lost_at = float("-inf")
        while not stop.is_set():
            try:
                leader = await asyncio.to_thread(self.coord.acquire_lease, self.instance_id, s.lease_ttl_s)
            except Unavailable as e:  # Redis away: lead nothing until the lease can be checked again
                log.warning("leader lease cannot be checked; retrying: %s", e.message)
                leader = False
            if leader != self.is_leader:
                log.info("leadership changed", extra={"instance_id": self.instance_id, "leader": leader})
                self.is_leader = leader
                if leader:
                    self.leader_since = time.time()
                    self.policies.reset()  # another master may have led meanwhile: load what it saved
            if not leader:
                await _sleep_or_stop(stop, s.lease_ttl_s / 3)
                continue
            try:
                now = time.monotonic()
                check_lost = now - checked_lost_at >= LIVENESS_CHECK_S
                if check_lost:
                    checked_lost_at = now
                # on a thread of its own: a round never waits for a thread behind the API's calls
                report = await asyncio.get_running_loop().run_in_executor(
                    self._round_thread, self.run_round, check_lost
                )
                if report.dispatched or report.lost_node_managers:
                    log.info("round", extra={"dispatched": len(report.dispatched), "pending": report.pending})
            except Exception:
                log.exception("scheduling round failed; retrying on the next wake-up")
                report = None
            wait = min(s.round_interval_s, s.lease_ttl_s / 3)
            if report is not None and report.wake_at is not None:  # the round asked to run again then
                wait = min(wait, max(0.05, report.wake_at - time.time()))
            await self._next_round(
                stop, wakeups, wait, quiet=report is not None and report.quiet, lost_at=checked_lost_at
            )

    async def _next_round(
        self, stop: asyncio.Event, wakeups: Subscription, wait: float, *, quiet: bool, lost_at: float
    ) -> None:
        """Wait for the next round: a wake-up, or ``wait`` seconds. After a quiet round, a wake-up that
        finds no work pending (one indexed read) waits on, within the same ``wait``: a study with one trial
        in flight would otherwise run two rounds a batch, one when the batch ends, with nothing to do, and
        one when the tuner's next request comes. A liveness check that is due runs its round."""
        deadline = time.monotonic() + wait
        loop = asyncio.get_running_loop()
        while True:
            woken = await wakeups.wait(max(0.0, deadline - time.monotonic()))
            if not (woken and quiet) or stop.is_set() or time.monotonic() - lost_at >= LIVENESS_CHECK_S:
                return
            try:
                if await loop.run_in_executor(self._round_thread, self.store.rounds.any_pending):
                    return
            except Exception:
                log.exception("reading whether work is pending failed; running a round")
                return
            metrics.observe_quiet_wakeup()


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
