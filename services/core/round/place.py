"""Place steps: which slots a batch goes to.

``SlotPool`` holds the round's slots: the free ones in the node managers' order, then (the lookahead)
the busy ones whose batch should end within ``lookahead_s``, soonest first. Each study's work goes
through the place step its policies give it (``PlaceStep``):

* ``FirstFit`` (the default): the free slot whose worker holds the trainer where the batch starts
  (``Work.warm``: it continues from memory), else the first free slot; when none is left and the work
  allows it, the busy slot that frees soonest (its node manager starts the batch there the moment it
  frees);
* ``TimeSharePlace`` (Hermes): a free slot of the device (a GPU: its slots of one ``gpu_index``; the CPU
  slots of a node manager: one device) the job is bound to (``round.learn.assign_devices``); a job in
  the global queue waits;
* ``PackingPlace`` (HyperSack): the device the study's packing policy picks under compute
  (``oversub`` x 100 %), memory and CPU constraints, given the demand the study declares; what fits
  nowhere waits.

Work on ``n > 1`` slots takes ``n`` free slots of one node manager (of those that have them, the one
with the fewest GPUs free: best fit), no two on one GPU, whatever its study chose; when no node manager
has them, the first of its other widths (``Work.others``) that one has, or it waits, and work that holds
(``Work.hold``: GENIE's, still in time) takes the free slots of the node manager with the most
(``SlotPool.hold``) for nothing, so that later work of the round leaves them to it. No step
places work on a node manager that cannot run its plan's trainer (``Work.avoid``). Devices, their
running jobs and their packed demands are only gathered in rounds where some study places by device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from stagetree.core.ids import StudyId
from stagetree.core.policies import packing
from stagetree.core.policies.study import PlacementParams, StudyPolicies
from stagetree.core.round.model import RunningAttempt
from stagetree.core.round.work import Work
from stagetree.core.slots import Slot


class SlotPool:
    """The round's slots and what is taken of them (see the module docstring)."""

    def __init__(
        self,
        free: Sequence[Slot],
        soon: Sequence[Slot],
        all_slots: Sequence[Slot],
        running: Sequence[RunningAttempt],
        policies: Mapping[StudyId, StudyPolicies],
        bound: Mapping[str, str] | None = None,
    ) -> None:
        self.free = list(free)
        self._free_set = frozenset(self.free)
        self.bound = bound if bound is not None else {}  # time-sharing job -> its device
        self.soon = list(soon)
        self.all_slots = all_slots
        self.running = running
        self.policies = policies
        self.taken: set[Slot] = set()
        self._free_at = 0  # free[:_free_at] are all taken
        self._soon_at = 0
        self._devices: _Devices | None = None

    def room(self, lookahead: bool = True) -> bool:
        """Whether some slot is left (with ``lookahead``, a busy one about to free counts)."""
        return self._first(self.free, "_free_at") is not None or (
            lookahead and self._first(self.soon, "_soon_at") is not None
        )

    def _first(self, slots: list[Slot], at: str, avoid: frozenset[str] = frozenset()) -> Slot | None:
        i = getattr(self, at)
        while i < len(slots) and slots[i] in self.taken:
            i += 1
        setattr(self, at, i)  # the cursor passes taken slots only: an avoided one is another work's
        if avoid:
            return next((s for s in slots[i:] if s not in self.taken and s.node_manager not in avoid), None)
        return slots[i] if i < len(slots) else None

    def free_now(self, slot: Slot) -> bool:
        """Whether ``slot`` is free and not taken this round."""
        return slot not in self.taken and slot in self._free_set

    def first_free(self, avoid: frozenset[str] = frozenset()) -> Slot | None:
        """The first free slot not taken, of a node manager not in ``avoid``."""
        return self._first(self.free, "_free_at", avoid)

    def first_soon(self, avoid: frozenset[str] = frozenset()) -> Slot | None:
        return self._first(self.soon, "_soon_at", avoid)

    def take(self, slots: Sequence[Slot], w: Work) -> None:
        self.taken.update(slots)
        if self._devices is not None:
            for s in slots:
                self._devices.placed(s, w)

    def wide(self, n: int, avoid: frozenset[str] = frozenset()) -> tuple[Slot, ...] | None:
        """``n`` free slots of one node manager not in ``avoid``, no two of them on one GPU
        (``Slot.rank_place``): of the node managers that have them, the one with the fewest such GPUs
        free (the first in the free slots' order on ties), so that work on fewer GPUs does not break up
        a node manager that wider work needs (best fit)."""
        by_host = self._free_by_host(avoid)
        fits = [got for got in by_host.values() if len(got) >= n]
        if not fits:
            return None
        return tuple(min(fits, key=len)[:n])

    def _free_by_host(self, avoid: frozenset[str]) -> dict[str, list[Slot]]:
        """The free slots not taken of each node manager not in ``avoid``, no two on one GPU
        (``Slot.rank_place``), in the free slots' order."""
        by_host: dict[str, list[Slot]] = {}
        for s in self.free[self._free_at :]:
            if s in self.taken or s.node_manager in avoid:
                continue
            got = by_host.setdefault(s.node_manager, [])
            if all(g.rank_place != s.rank_place for g in got):
                got.append(s)
        return by_host

    def hold(self, n: int, avoid: frozenset[str] = frozenset()) -> tuple[Slot, ...]:
        """Take, for no work, up to ``n - 1`` free slots (no two on one GPU) of the node manager not in
        ``avoid`` that has the most (the first in the free slots' order on ties): work on ``n`` slots
        that waits for them there keeps them from work that comes after it in the round. Returns them
        (none when no node manager has a free slot)."""
        by_host = self._free_by_host(avoid)
        if not by_host:
            return ()
        held = tuple(max(by_host.values(), key=len)[: max(n - 1, 0)])
        self.taken.update(held)
        return held

    def devices(self) -> _Devices:
        if self._devices is None:
            self._devices = _Devices(self)
        return self._devices


class PlaceStep(Protocol):
    def place(self, w: Work, pool: SlotPool) -> tuple[tuple[Slot, ...], bool] | None:
        """The slots for ``w`` (rank order) and whether the first is busy about to free; None: it waits."""
        ...


@dataclass(frozen=True)
class FirstFit:
    lookahead: bool = True

    def place(self, w: Work, pool: SlotPool) -> tuple[tuple[Slot, ...], bool] | None:
        if w.warm is not None and w.warm.node_manager not in w.avoid and pool.free_now(w.warm):
            return (w.warm,), False  # its worker holds the trainer where the batch starts: no checkpoint read
        s = pool.first_free(w.avoid)
        if s is not None:
            return (s,), False
        if self.lookahead:
            s = pool.first_soon(w.avoid)
            if s is not None:
                return (s,), True
        return None


@dataclass(frozen=True)
class TimeSharePlace:
    def place(self, w: Work, pool: SlotPool) -> tuple[tuple[Slot, ...], bool] | None:
        device = pool.bound.get(w.key)
        if device is None:
            return None  # the global queue: every device holds G_thres jobs
        dev = pool.devices()
        if dev.host(device) in w.avoid:  # its node manager cannot run it: a free slot of another may
            s = pool.first_free(w.avoid)
            return None if s is None else ((s,), False)
        if not dev.has_free(device):
            return None  # its device is busy: it waits for its turn there
        return (dev.free_slot(device),), False


@dataclass(frozen=True)
class PackingPlace:
    params: PlacementParams

    def place(self, w: Work, pool: SlotPool) -> tuple[tuple[Slot, ...], bool] | None:
        dev = pool.devices()
        pl = self.params
        cands = [dev.bin_of(d, pl.oversub) for d in dev.with_free() if dev.host(d) not in w.avoid]
        it = dev.item(f"w{w.key}", w.study, w.cost_s)
        got = packing.place(pl.policy, [it], cands, dev.node_cpus, _copy(dev.usage))
        chosen = got.get(it.id)
        if chosen is None:
            return None  # fits on no device now: waits for a later round
        return (dev.free_slot(chosen),), False


def _copy(u: packing.Usage) -> packing.Usage:
    """A copy for a trial placement (``packing.place`` adds what it places; the pool adds it on take)."""
    return packing.Usage(dict(u.compute), dict(u.memory), dict(u.cpus), {k: list(v) for k, v in u.items.items()})


class _Devices:
    """The pool's slots by device, with the jobs running and placed on each and their packed demand.
    Each lookup is kept per device or per GPU type, so that a round on a large cluster (1,600 devices,
    half of them running work) does not walk every device for each running or placed job."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.slots: dict[str, list[Slot]] = {}
        self.node_cpus: dict[str, float] = {}
        for s in pool.all_slots:
            self.slots.setdefault(s.device, []).append(s)
            self.node_cpus[s.node_manager] = self.node_cpus.get(s.node_manager, 0.0) + float(s.cpu_cores or 1)
        # a job's demand is given per GPU type, from the slots of the last device of that type
        self.type_slots: dict[str, int] = {sl[0].gpu_type: len(sl) for sl in self.slots.values()}
        self.free: dict[str, list[Slot]] = {}
        for s in pool.free:
            if s not in pool.taken:
                self.free.setdefault(s.device, []).append(s)
        self.untaken = {d: len(sl) for d, sl in self.free.items()}  # devices with a free slot, in order
        self.free_slots = {s for sl in self.free.values() for s in sl}
        self.usage = packing.Usage()
        self.bins: dict[tuple[str, float], packing.GpuBin] = {}
        self.load: dict[str, int] = {}  # running and placed jobs per device (Hermes Alg. 2)
        for r in pool.running:
            for s in r.slots:
                if s.device in self.slots:
                    self.load[s.device] = self.load.get(s.device, 0) + 1
                    self.usage.add(self.item(f"run{r.batch}.{s.id}", r.study, 0.0), self.bin_of(s.device, 1.0))

    def with_free(self) -> list[str]:
        return list(self.untaken)

    def has_free(self, device: str) -> bool:
        return device in self.untaken

    def host(self, device: str) -> str:
        """The node manager of a device ("" for one the round does not have)."""
        slots = self.slots.get(device)
        return slots[0].node_manager if slots else ""

    def free_slot(self, device: str) -> Slot:
        return next(s for s in self.free[device] if s not in self.pool.taken)

    def placed(self, s: Slot, w: Work) -> None:
        if s in self.free_slots:  # not a busy slot taken ahead
            left = self.untaken[s.device] - 1
            if left > 0:
                self.untaken[s.device] = left
            else:
                del self.untaken[s.device]
        self.load[s.device] = self.load.get(s.device, 0) + 1
        self.usage.add(self.item(f"w{w.key}.{s.id}", w.study, w.cost_s), self.bin_of(s.device, 1.0))

    def demand(self, study: StudyId | None, device_slots: int) -> packing.Demand:
        p = self.pool.policies.get(study) if study is not None else None
        if p is None or p.placement is None:  # a plain batch holds its slot's share of the device
            return packing.Demand(100.0 / max(device_slots, 1), 0.0, 0.0, 0.0)
        return packing.Demand(p.placement.compute, p.placement.memory_bytes, p.placement.cpus, 0.0)

    def item(self, key: str, study: StudyId | None, cost: float) -> packing.PackItem:
        d = {}
        for gpu_type, n in self.type_slots.items():
            base = self.demand(study, n)
            d[gpu_type] = packing.Demand(base.compute, base.memory, base.cpus, cost)
        return packing.PackItem(key, d)

    def bin_of(self, dev: str, oversub: float) -> packing.GpuBin:
        got = self.bins.get((dev, oversub))
        if got is None:
            slots = self.slots[dev]
            mem = sum(s.memory_bytes for s in slots) or math.inf
            got = self.bins[(dev, oversub)] = packing.GpuBin(
                Slot(dev, slots[0].node_manager, slots[0].gpu_type), mem, oversub
            )
        return got
