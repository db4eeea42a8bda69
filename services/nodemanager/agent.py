"""``NodeManager``: one per GPU server; runs the master's batches in worker processes (TreeML §5.1).

It owns the processes on its machine and nothing else: it registers its slots with the master,
heartbeats, and carries out its assignment stream:

* ``RUN``: hand the batch attempt to the worker of the slot the master named (``workers``: the slot's
  warm worker, which runs batch after batch, or a new one) as soon as the slot is free: it may still be
  running the batch before (the master sends a slot's next batch shortly before its end,
  ``SchedulingSettings.lookahead_s``, or its view runs ahead of a worker that is still exiting). A
  slot is free once its worker has reported its batch's end and says it waits for the next one (or has
  exited), so a batch sent ahead starts the moment the batch before it ends. A RUN naming no slot of
  this node manager takes any free one. For a batch on ``spec.slots = n > 1`` slots, ``n`` of them as
  one ``torch.distributed`` group on ``n`` free slots
  (``group.WorkerGroup``: a rendezvous on a free loopback port, rank ``r`` on the ``r``-th slot; the
  first rank to die ends the others, and the attempt ends once, as that rank's end), read its events,
  hand them to the ``BatchReporter``, and report the attempt's end exactly once. A worker that dies
  without a terminal event is a failed attempt with its exit status or signal (a SIGKILL nobody here
  sent is taken for the kernel's out-of-memory killer and flagged ``oom``); one that reports
  ``batch_failed`` keeps its own error and ``oom`` flag.
* ``ABORT``: kill the worker without saving. ``PREEMPT``: SIGUSR1 (the runtime finishes its step,
  saves a peripheral checkpoint and exits), sent once the worker has installed its handler.
* ``DELETE_CHECKPOINTS``: delete those URIs from the checkpoint store (missing ones are fine).

When the master goes away (killed, restarting, network) the node manager keeps its workers running,
queues their reports (``GrpcReporter``) or keeps publishing (``BusReporter``), and reconnects with
exponential backoff, registering again. Each registration lists the attempts this process runs or
recently ended (``known_attempts``), so the master requeues only what it sent here and this process
never got: the work of a previous, killed process under the same id, or a RUN lost with a broken stream.
A wrong token is not retried: ``run`` raises ``Unauthenticated``/``PermissionDenied`` with the setting
to fix. A call the master fails with a bug (INTERNAL, UNKNOWN) is logged as one and ends the session
like any failure, but the backoff keeps growing across registrations while sessions end that way.
On stop, running workers are preempted (``stop_grace_s`` to save) so their work resumes elsewhere from
a checkpoint; once their reports are sent the node manager tells the master it left (``LeaveNodeManager``),
which then sends it no more work and requeues at once what it was given and never ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import signal
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stagetree.core.batch import BatchSpec
from stagetree.core.errors import (
    InvalidArgument,
    PermissionDenied,
    StagetreeError,
    Unauthenticated,
    Unavailable,
)
from stagetree.core.failures import log_note
from stagetree.core.lifecycle import Assignment
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager import metrics
from stagetree.nodemanager.gpu import GpuProbe
from stagetree.nodemanager.group import WorkerGroup
from stagetree.nodemanager.link import ABORT, DELETE_CHECKPOINTS, PREEMPT, RUN, MasterLink
from stagetree.nodemanager.mps import MpsDaemon
from stagetree.nodemanager.reporting import TERMINAL_EVENTS, AttemptExit, AttemptInfo, BatchReporter, RecentKeys
from stagetree.nodemanager.runtime.checkpoints import CheckpointStore
from stagetree.nodemanager.runtime.ranks import LOOPBACK, RANK_KEY, RankInfo, free_port
from stagetree.nodemanager.workers import EXIT_USAGE, WorkerLauncher, WorkerProcess

log = logging.getLogger(__name__)

PREEMPT_SIGNAL = signal.SIGUSR1
DEFAULT_HEARTBEAT_S = 5.0
STOPPED = "the node manager stopped"
EOF_GRACE_S = 2.0  # after a worker exits, how long its last events may take to arrive
KNOWN_ENDED = 1000  # ended attempts listed at registration (their reports may not be applied yet)
LEAVE_TIMEOUT_S = 3.0  # how long a stop waits to tell the master (unreachable: it finds out a TTL later)


@dataclass
class _Attempt:
    info: AttemptInfo
    spec: BatchSpec
    slot: SlotInfo | None = None  # rank 0's
    slots: list[SlotInfo] = field(default_factory=list)  # every rank's, by rank
    worker: WorkerProcess | None = None
    started: bool = False  # batch_started seen: the worker's signal handlers are installed
    preempt_requested: bool = False
    aborted: bool = False
    stopping: bool = False  # the node manager is shutting down
    terminal: tuple[str, dict[str, Any]] | None = None
    task: asyncio.Task[None] | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)  # the worker is gone (or never started)


def classify_end(attempt: _Attempt, returncode: int, stderr_tail: str) -> AttemptExit:
    """How an attempt ended, from its terminal event (which wins) or else its exit."""
    if attempt.terminal is not None:
        kind, payload = attempt.terminal
        if kind == "batch_finished":
            return AttemptExit("finished")
        if kind == "batch_preempted":
            return AttemptExit("preempted")
        return AttemptExit(
            "failed",
            error=str(payload["error"]),
            traceback=str(payload["traceback"]),
            oom=bool(payload["oom"]),
            user_error=bool(payload.get("user_error", False)),
            host_problem=bool(payload.get("host_problem", False)),
        )
    if attempt.aborted:
        return AttemptExit("aborted", error="aborted by the master", by_worker=False)
    if attempt.worker is not None and attempt.worker.killed:
        if attempt.stopping:
            return AttemptExit("preempted", error=STOPPED, by_worker=False)
        return AttemptExit("failed", error="the node manager killed its worker after an error", by_worker=False)
    last = next((ln for ln in reversed(stderr_tail.strip().splitlines()) if ln.strip()), "")
    oom = False
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        error = f"worker killed by {name} before reporting an end"
        if -returncode == signal.SIGKILL:
            oom = True  # not sent from here: most likely the kernel's (or the cgroup's) OOM killer
            error += " (most likely the out-of-memory killer)"
    elif returncode == EXIT_USAGE:
        error = "worker refused the batch spec (exit status 2)"
    else:
        error = f"worker exited with status {returncode} before reporting an end"
    if last:
        error += f"; last output: {last[-300:]}"
    return AttemptExit("failed", error=error, traceback=stderr_tail, oom=oom, by_worker=False)


class NodeManager:
    """The node manager service. Build it from settings with ``app.build_node_manager`` (the CLI and
    the embedded mode), or from its parts::

        nm = NodeManager(link, reporter, slots, launcher, node_manager_id="nm-1", store=store)
        await nm.run(stop)  # until stop is set
    """

    def __init__(
        self,
        link: MasterLink,
        reporter: BatchReporter,
        slots: Sequence[SlotInfo],
        launcher: WorkerLauncher,
        *,
        node_manager_id: str,
        address: str = "",
        store: CheckpointStore | None = None,
        probe: GpuProbe | None = None,
        mps: MpsDaemon | None = None,
        heartbeat_interval_s: float | None = None,
        telemetry_interval_s: float = 10.0,
        reconnect_initial_s: float = 0.5,
        reconnect_max_s: float = 10.0,
        stop_grace_s: float = 30.0,
    ) -> None:
        if not slots:
            raise InvalidArgument("a node manager needs at least one slot")
        if not node_manager_id:
            raise InvalidArgument("node_manager_id: required (STAGETREE_NM_NODE_MANAGER_ID)")
        self.link = link
        self.reporter = reporter
        self.slots = list(slots)
        self.launcher = launcher
        self.id = node_manager_id
        self.address = address or node_manager_id
        self.store = store
        self.probe = probe
        self.mps = mps
        self.heartbeat_interval_s = heartbeat_interval_s
        self.telemetry_interval_s = telemetry_interval_s
        self.reconnect_initial_s = reconnect_initial_s
        self.reconnect_max_s = reconnect_max_s
        self.stop_grace_s = stop_grace_s

        self.connected = asyncio.Event()  # registered and consuming the stream (for tests, health)
        self.registrations = 0
        self._attempts: dict[tuple[int, int], _Attempt] = {}
        self._done = RecentKeys()  # attempts that ended here: a RUN for one of them is a duplicate
        self._queue: deque[_Attempt] = deque()
        self._free: dict[str, SlotInfo] = {s.id: s for s in self.slots}
        self._slot_ids = frozenset(self._free)
        self._rank_places = len({_rank_place(s) for s in self.slots})  # the most ranks a batch can have here
        self._background: set[asyncio.Task[Any]] = set()
        self._launcher_ready: asyncio.Task[None] | None = None  # started at the first registration
        self._stopping = False
        metrics.track(self)

    # -- the service ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set. Raises on a configuration error (a wrong token, MPS that cannot
        start); everything else (the master away, a crashed worker) is handled and logged."""
        try:
            if self.mps is not None:
                await asyncio.to_thread(self.mps.start)
            telemetry = self._spawn(self._telemetry_loop())
            connection = asyncio.create_task(self._connection_loop(), name=f"nm-{self.id}-connection")
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({connection, stopped}, return_when=asyncio.FIRST_COMPLETED)
            for t in (connection, stopped, telemetry):
                t.cancel()
            fatal: BaseException | None = None
            if connection.done() and not connection.cancelled():
                fatal = connection.exception()
            with contextlib.suppress(asyncio.CancelledError):
                await connection
            await self._shutdown()
            if fatal is not None:
                raise fatal
        finally:
            if self._launcher_ready is not None:
                with contextlib.suppress(Exception):
                    await self._launcher_ready
            await self.launcher.close()
            await self.reporter.close()  # delivers what it can of the last reports, then gives up
            if self._background:
                await asyncio.wait(set(self._background), timeout=10)
            if self.registrations:
                await self._leave()
            await self.link.close()
            metrics.untrack(self)
            if self.mps is not None:
                await asyncio.to_thread(self.mps.stop)
            if self.probe is not None:
                self.probe.close()

    async def _leave(self) -> None:
        """Tell the master this node manager is gone (``MasterLink.leave``), within ``LEAVE_TIMEOUT_S``:
        a master that cannot be reached finds out a heartbeat TTL later, as from a crash."""
        try:
            requeued = await asyncio.wait_for(self.link.leave(self.id, self.known_attempts()), LEAVE_TIMEOUT_S)
        except (StagetreeError, TimeoutError) as e:
            log.info("could not tell the master this node manager left: %s", e, extra={"node_manager_id": self.id})
            return
        log.info("left the master", extra={"node_manager_id": self.id, "requeued": requeued})

    async def workers_ready(self) -> None:
        """Until the worker launcher is ready (registered, fork server imported or workers prestarted):
        the first batch then starts without waiting for imports."""
        while self._launcher_ready is None:
            await asyncio.sleep(0.05)
        await asyncio.shield(self._launcher_ready)

    def known_attempts(self) -> list[tuple[int, int]]:
        """What this process runs, waits to run or recently ended (its report may still be on its way):
        sent at registration, so the master requeues only work this process never got."""
        return sorted(set(self._attempts) | set(self._done.latest(KNOWN_ENDED)))

    def running(self) -> list[tuple[int, int]]:
        """(batch id, attempt) of the attempts started or waiting for a slot."""
        return sorted(self._attempts)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- the connection -----------------------------------------------------------------------------

    async def _connection_loop(self) -> None:
        delay = self.reconnect_initial_s
        # Whether the last connection to the master ended in an error a retry cannot fix (a bug in the master, a refused
        # call): registering again then keeps the backoff, so a call the master keeps failing is repeated
        # ever more slowly (up to reconnect_max_s) instead of once per heartbeat.
        keep_backoff = False
        while True:
            try:
                interval = await self.link.register_known(self.id, self.address, self.slots, self.known_attempts())
                self.registrations += 1
                log.info(
                    "registered with the master",
                    extra={
                        "node_manager_id": self.id,
                        "slots": [s.id for s in self.slots],
                        "registrations": self.registrations,
                    },
                )
                if not keep_backoff:
                    delay = self.reconnect_initial_s
                if self._launcher_ready is None:  # not before: a wrong token should not wait for imports
                    self._launcher_ready = asyncio.create_task(self.launcher.start(self.slots))
                await self._serve(self.heartbeat_interval_s or interval or DEFAULT_HEARTBEAT_S)
            except (Unauthenticated, PermissionDenied):
                raise
            except InvalidArgument as e:
                if self.registrations == 0:
                    raise  # the master refuses what we register: a configuration error
                keep_backoff = True
                log.error("master refused a call; reconnecting: %s", e.message, extra={"node_manager_id": self.id})
            except StagetreeError as e:
                keep_backoff = not e.retriable
                ids = {"node_manager_id": self.id, "retry_in_s": delay}
                if e.retriable:
                    log.warning("master unreachable; retrying in %.1f s: %s", delay, e.message, extra=ids)
                else:  # its message says it is a bug and where to look
                    log.error("master failed a call; reconnecting in %.1f s: %s", delay, e.message, extra=ids)
            except Exception:
                keep_backoff = True
                log.exception(
                    "unexpected error talking to the master; reconnecting", extra={"node_manager_id": self.id}
                )
            finally:
                self.connected.clear()
            await asyncio.sleep(delay * (0.8 + 0.4 * random.random()))
            delay = min(self.reconnect_max_s, delay * 2)

    async def _serve(self, heartbeat_s: float) -> None:
        """Heartbeat and consume the stream until either fails (then raises)."""
        tasks = {
            asyncio.create_task(self._heartbeats(heartbeat_s), name="heartbeats"),
            asyncio.create_task(self._consume(), name="assignments"),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()  # raises the failure
            raise Unavailable("the assignment stream ended")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _heartbeats(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.link.heartbeat(self.id, self.known_attempts())

    async def _consume(self) -> None:
        self.connected.set()
        async for a in self.link.assignments(self.id):
            try:
                self.on_assignment(a)
            except Exception:
                log.exception("assignment not carried out", extra={"batch_id": a.batch_id, "kind": a.kind})

    # -- assignments ------------------------------------------------------------------------------

    def on_assignment(self, a: Assignment) -> None:
        """Carry out one assignment (called on the event loop)."""
        ids = {"batch_id": a.batch_id, "attempt": a.attempt, "kind": a.kind}
        log.info("assignment received", extra=ids)
        if a.kind == RUN:
            self._run(a)
        elif a.kind == ABORT:
            self._abort((a.batch_id, a.attempt))
        elif a.kind == PREEMPT:
            self._preempt((a.batch_id, a.attempt))
        elif a.kind == DELETE_CHECKPOINTS:
            self._spawn(self._delete(a.checkpoint_uris))
        else:
            log.error("unknown assignment kind ignored", extra=ids)

    def _run(self, a: Assignment) -> None:
        key = (a.batch_id, a.attempt)
        if key in self._attempts or key in self._done:
            log.warning("duplicate RUN ignored", extra={"batch_id": a.batch_id, "attempt": a.attempt})
            return
        try:
            spec = BatchSpec.from_json(json.loads(a.spec_json))
            if (spec.batch_id, spec.attempt) != key:
                raise InvalidArgument(f"spec is for batch {spec.batch_id} attempt {spec.attempt}")
        except (ValueError, StagetreeError) as e:
            info = AttemptInfo(a.batch_id, a.attempt)
            self._done.add(key)
            log.error("unreadable batch spec: %s", e, extra={"batch_id": a.batch_id})
            end = AttemptExit("failed", error=f"unreadable batch spec: {e}", by_worker=False)
            self._spawn(self.reporter.finish(info, end))
            return
        slot_hint = a.slot_id or str(spec.extra.get("slot_id", ""))
        att = _Attempt(AttemptInfo(a.batch_id, a.attempt, spec.plan_key, slot_hint), spec)
        self._attempts[key] = att
        self._queue.append(att)
        self._dispatch()

    def _dispatch(self) -> None:
        """Start queued attempts, in order, on free slots. An attempt on one slot that names a slot of
        this node manager waits for that slot (its batch before may still run there: the master sent this
        one ahead) and lets those behind it pass; one naming no slot here takes any free one. An attempt
        on ``n`` slots takes the named ones that are free and others, and waits, with those behind it,
        until ``n`` are free."""
        waiting: list[_Attempt] = []
        while self._queue and self._free and not self._stopping:
            att = self._queue.popleft()
            n = att.spec.slots
            if n > self._rank_places:
                self._refuse(att, self._too_wide(n))
                continue
            if n == 1 and att.info.slot_id in self._slot_ids and att.info.slot_id not in self._free:
                waiting.append(att)  # its slot is still busy
                continue
            hints = [att.info.slot_id, *(str(h) for h in att.spec.extra.get("slot_ids", ()))]
            chosen = rank_slots(n, [self._free[h] for h in dict.fromkeys(hints) if h in self._free], self._free)
            if chosen is None:
                self._queue.appendleft(att)
                break
            for slot in chosen:
                del self._free[slot.id]
            att.slot, att.slots = chosen[0], chosen
            att.task = self._spawn(self._supervise(att))
        self._queue.extendleft(reversed(waiting))  # in their order, ahead of those not looked at
        if self._queue:
            log.debug("attempts waiting for a slot", extra={"queued": len(self._queue)})

    def _too_wide(self, n: int) -> str:
        gpus = {s.gpu_index for s in self.slots if s.gpu_index >= 0}
        if gpus and len(self.slots) > len(gpus):
            return (
                f"the batch asks for {n} ranks and node manager {self.id} has {len(gpus)} GPU(s) "
                f"({len(self.slots)} slots share them; two ranks of one batch never share a GPU)"
            )
        return f"the batch asks for {n} slots and node manager {self.id} has {len(self.slots)}"

    def _refuse(self, att: _Attempt, why: str) -> None:
        """End a queued attempt that cannot run here, as failed (without starting anything)."""
        key = att.info.key
        self._attempts.pop(key, None)
        self._done.add(key)
        log.error("attempt refused: %s", why, extra={"batch_id": key[0], "attempt": key[1]})
        self._spawn(self.reporter.finish(att.info, AttemptExit("failed", error=why, by_worker=False)))

    async def _start_worker(self, att: _Attempt) -> WorkerProcess:
        """The attempt's worker: one process, or one per rank as a ``WorkerGroup``."""
        assert att.slot is not None
        if len(att.slots) <= 1:
            return await self.launcher.spawn(att.spec, att.slot)
        n, port = len(att.slots), free_port()
        workers: list[WorkerProcess] = []
        try:
            for rank, slot in enumerate(att.slots):
                info = RankInfo(rank, n, rank, LOOPBACK, port)
                spec = replace(att.spec, extra={**att.spec.extra, RANK_KEY: info.to_json()})
                workers.append(await self.launcher.spawn(spec, slot))
        except BaseException:
            for w in workers:
                w.kill()
            raise
        log.info(
            "rank processes started",
            extra={"batch_id": att.info.batch_id, "pids": [w.pid for w in workers], "port": port},
        )
        return WorkerGroup(workers)

    def _abort(self, key: tuple[int, int]) -> None:
        att = self._attempts.get(key)
        if att is None:
            log.info("ABORT of an attempt not running here", extra={"batch_id": key[0], "attempt": key[1]})
            return
        att.aborted = True
        if att in self._queue:
            self._queue.remove(att)
            self._attempts.pop(key, None)
            self._done.add(key)
            self._spawn(self.reporter.finish(att.info, AttemptExit("aborted", by_worker=False)))
        elif att.worker is not None:
            att.worker.kill()
        # else: the worker is being started; _supervise kills it as soon as it exists

    def _preempt(self, key: tuple[int, int]) -> None:
        att = self._attempts.get(key)
        if att is None:
            log.info("PREEMPT of an attempt not running here", extra={"batch_id": key[0], "attempt": key[1]})
            return
        att.preempt_requested = True
        if att.started and att.worker is not None:
            att.worker.send_signal(PREEMPT_SIGNAL)
        # else: sent when the worker says batch_started (before that, SIGUSR1 would kill it)

    async def _delete(self, uris: Sequence[str]) -> None:
        if self.store is None:
            log.warning("DELETE_CHECKPOINTS without a checkpoint store; ignored", extra={"uris": len(uris)})
            return
        store = self.store

        def delete_all() -> int:
            deleted = 0
            for uri in uris:
                try:
                    store.delete(uri)
                    deleted += 1
                except (StagetreeError, OSError) as e:
                    log.warning("checkpoint not deleted: %s", e, extra={"uri": uri})
            return deleted

        n = await asyncio.to_thread(delete_all)
        log.info("checkpoints deleted", extra={"deleted": n, "asked": len(uris)})

    # -- one attempt ------------------------------------------------------------------------------

    async def _supervise(self, att: _Attempt) -> None:
        info, key = att.info, att.info.key
        ids = {"batch_id": info.batch_id, "attempt": info.attempt}
        assert att.slot is not None
        end = AttemptExit("failed", error="the node manager lost track of its worker", by_worker=False)
        try:
            try:
                if self._launcher_ready is not None:
                    await asyncio.shield(self._launcher_ready)
                worker = await self._start_worker(att)
            except Exception as e:
                end = AttemptExit("failed", error=f"cannot start a worker: {e!r}", by_worker=False)
                log.error("cannot start a worker: %r", e, extra=ids)
                return
            att.worker = worker
            log.info("worker started", extra={**ids, "pid": worker.pid, "slot_id": att.slot.id})
            if att.aborted:
                worker.kill()
            rc = await self._watch(att, worker)
            if isinstance(worker, WorkerGroup):  # its cause is settled once every rank's report is in
                rc = worker.returncode if worker.returncode is not None else rc
            end = classify_end(att, rc, worker.stderr_tail() if att.terminal is None else "")
            if isinstance(worker, WorkerGroup) and worker.cause is not None and not end.by_worker:
                rank = worker.cause
                end = replace(
                    end,
                    error=f"rank {rank} of {worker.world_size} (pid {worker.workers[rank].pid}): {end.error}; "
                    "the other ranks were ended",
                )
            if end.status == "failed" and not end.by_worker:
                end = replace(end, error=f"{end.error}\n{self._log_note(worker)}")
            log.info(
                "worker exited",
                extra={**ids, "pid": worker.pid, "returncode": rc, "status": end.status, "error": end.error},
            )
        except asyncio.CancelledError:
            if att.worker is not None:
                att.worker.kill()
            end = AttemptExit("preempted", error=STOPPED, by_worker=False)
            raise
        finally:
            att.exited.set()
            for slot in att.slots or [att.slot]:
                self._free[slot.id] = slot
            self._attempts.pop(key, None)
            self._done.add(key)
            self._dispatch()
            metrics.ended(self.id, end.status)
            await self.reporter.finish(info, end)

    async def _watch(self, att: _Attempt, worker: WorkerProcess) -> int:
        """Follow the worker's events until it has exited and its pipe is drained; its exit status."""
        ids = {"batch_id": att.info.batch_id, "attempt": att.info.attempt}
        follow = asyncio.ensure_future(self._follow(att, worker))
        exited = asyncio.ensure_future(worker.wait())
        try:
            await asyncio.wait({follow, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not follow.done():
                # The worker is gone but the pipe is still open: something it forked holds it. Take
                # the lines already written, then end what is left of its session.
                done, _ = await asyncio.wait({follow}, timeout=EOF_GRACE_S)
                if not done:
                    log.warning("worker exited but its session lives on; killing it", extra=ids)
                    worker.kill_session()
                    await asyncio.wait({follow}, timeout=10)
            if follow.done() and not follow.cancelled() and follow.exception() is not None:
                log.error("error while following a worker; killing it", exc_info=follow.exception(), extra=ids)
                worker.kill()
            return await exited
        finally:
            for f in (follow, exited):
                f.cancel()

    async def _follow(self, att: _Attempt, worker: WorkerProcess) -> None:
        """Hand the worker's events to the reporter until it closes its pipe."""
        info = att.info
        async for kind, payload in worker.events():
            if kind == "batch_started":
                att.started = True
                if att.preempt_requested:
                    worker.send_signal(PREEMPT_SIGNAL)
            if kind in TERMINAL_EVENTS:
                if att.terminal is not None:
                    log.warning("second terminal event ignored", extra={"batch_id": info.batch_id, "kind": kind})
                    continue
                if kind == "batch_failed":  # say where the whole story is: the worker's log
                    payload = {**payload, "error": f"{payload['error']}\n{self._log_note(worker)}"}
                att.terminal = (kind, payload)
            metrics.event(self.id, kind, payload)
            await self.reporter.event(info, kind, payload)

    def _log_note(self, worker: WorkerProcess) -> str:
        return log_note(str(worker.log_path), self.id)

    # -- telemetry and shutdown ---------------------------------------------------------------------

    async def _telemetry_loop(self) -> None:
        if self.probe is None:
            return
        probe = self.probe
        if not await asyncio.to_thread(probe.gpus):
            return  # CPU-only: nothing to sample
        while True:
            await asyncio.sleep(self.telemetry_interval_s)
            try:
                samples = await asyncio.to_thread(probe.sample)
                if samples:
                    await self.reporter.telemetry(self.id, samples)
            except Exception:
                log.exception("telemetry sample not published", extra={"node_manager_id": self.id})

    async def _shutdown(self) -> None:
        """Preempt running workers, give them ``stop_grace_s`` to save and exit, kill the rest; queued
        attempts end as preempted without having started. Reports are delivered by ``reporter.close``."""
        self._stopping = True
        for att in list(self._queue):
            self._queue.remove(att)
            self._attempts.pop(att.info.key, None)
            self._done.add(att.info.key)
            self._spawn(self.reporter.finish(att.info, AttemptExit("preempted", error=STOPPED, by_worker=False)))
        running = list(self._attempts.values())
        if not running:
            return
        log.info("stopping: preempting running workers", extra={"workers": len(running)})
        for att in running:
            att.stopping = True
            self._preempt(att.info.key)
        exits = [asyncio.ensure_future(att.exited.wait()) for att in running]
        _, pending = await asyncio.wait(exits, timeout=self.stop_grace_s)
        if pending:
            for att in running:
                if not att.exited.is_set():
                    if att.worker is not None:
                        att.worker.kill()
                    elif att.task is not None:
                        att.task.cancel()  # still starting its worker
            _, pending = await asyncio.wait(pending, timeout=10)
        for fut in pending:
            fut.cancel()


def _rank_place(slot: SlotInfo) -> str:
    """What two ranks of one batch never share: a GPU (NCCL refuses two ranks on one device), else the
    slot (``core.slots.Slot.rank_place`` on the master's side)."""
    return f"gpu{slot.gpu_index}" if slot.gpu_index >= 0 else slot.id


def rank_slots(n: int, hinted: Sequence[SlotInfo], free: Mapping[str, SlotInfo]) -> list[SlotInfo] | None:
    """``n`` of the ``free`` slots for the ranks of one batch, the ``hinted`` ones first, no two on one
    GPU; None when fewer than ``n`` such are free."""
    chosen: list[SlotInfo] = []
    places: set[str] = set()
    for slot in [*hinted, *free.values()]:
        if len(chosen) == n:
            break
        place = _rank_place(slot)
        if place not in places:
            chosen.append(slot)
            places.add(place)
    return chosen if len(chosen) == n else None
