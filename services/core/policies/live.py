"""The four papers' policies as one pure step of the live round: a study's policy config in, decisions out.

``parse_policies`` validates what a study chose (its fixed config's ``"policies"`` object);
``plan_round`` takes the round's ready work, the free and busy slots and the per-study choices and
returns which work goes to which slot, in which order and which running batches to preempt;
``on_reports`` feeds a trial's reports to its study's POP policy (kill / suspend verdicts) and
``eval_points`` says where batches report them. Everything is plain data: the master (``stagetree.master.policies``)
gathers it from the database and carries the decisions out.

A study's ``"slots": n`` (an integer, default 1) trains each of its batches data-parallel on ``n``
slots of one node manager; it is not a scheduling step of its own (the master's round places such
batches, and counts their stages at ``n`` slots), so a study that chooses only ``slots`` keeps the
master's default steps.

Steps, in the order ``plan_round`` applies them:

1. **Order** (GENIE, ``qos``): when some pending work belongs to a study with a QoS class, all ready
   work is served in increasing waiting allowance ``w = ECT - (now + l)`` (GENIE Alg. 1 through
   ``genie.plan_queue``), with ``l`` the work's estimated seconds on one slot and ``ECT`` from its class
   (Eq. 4); work of studies without a class counts as ``normal``.
   **Search** (POP, ``search``): within the positions the work of POP studies holds, promising trials
   first (highest confidence ``p``), then the rest in arrival order.
   **Time-sharing order** (Hermes, ``time_share``): within the work of time-sharing studies the job
   with the largest score (Hermes: convergence ``C_j(i)``; never-run jobs first) goes first.
   With a QoS class and ``slots`` above 1, GENIE also picks each batch's width (multi-GPU placement,
   ``genie.choose_width``): among widths 1, 2, 4, ... up to ``slots``, the highest cost-effective
   ratio (Eq. 5) that meets the work's expected completion time, with latencies from the master's cost
   model on ``n`` slots (``Work.widths``).
2. **Place** (HyperSack, ``placement``): slots are grouped into devices (a GPU: its slots of one
   ``gpu_index``; the CPU slots of a node manager: one device). Work of a study with a placement
   policy goes to the device that policy picks under compute (``oversub`` x 100 %), memory and CPU
   constraints, given the demand the study declares (``compute`` %, ``memory_bytes``, ``cpus``), then
   to a free slot of it; what fits nowhere waits. Work on ``n > 1`` slots takes ``n`` free slots of one
   node manager (the first that has them), or waits. Work of a time-sharing study (Hermes Alg. 1-2) goes
   to the device with the fewest running and placed jobs among those holding fewer than ``g_thres``
   (``time_share_params``, 4): when every device holds that many, it waits in the global queue. Other
   work takes the first free slot.
3. **Preempt** (Hermes ``node_round``): a busy slot running a time-sharing job whose quantum expired
   yields to the best waiting job of a time-sharing study when that one scores higher.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies import genie, hermes, packing, pop
from stagetree.core.scheduler import ORDER_POLICIES
from stagetree.core.slots import Slot

# -- the study's choice -------------------------------------------------------------------------


@dataclass(frozen=True)
class TimeShareParams:
    policy: str
    quantum_s: float = 10.0
    growth: float = 2.0
    milestones: tuple[float, ...] = (0.3, 0.45, 0.6)
    eval_every: int = 5  # steps between the losses a running batch reports (Hermes' L_j(i))
    metric: str = "loss"
    g_thres: int = hermes.G_THRES  # Hermes' global placement cap: time-sharing jobs per device

    def make(self) -> hermes.TimeSharePolicy:
        if self.policy == "hermes":
            return hermes.Hermes(self.quantum_s, self.growth, self.milestones)
        if self.policy == "rr":
            return hermes.RoundRobin(self.quantum_s)
        if self.policy == "slaq":
            return hermes.Slaq(self.quantum_s)
        return hermes.time_share_policy(self.policy)


@dataclass(frozen=True)
class PlacementParams:
    policy: str
    compute: float = 100.0  # % of one device a batch of the study uses
    memory_bytes: float = 0.0
    cpus: float = 0.0
    oversub: float = 1.0


@dataclass(frozen=True)
class SearchParams:
    """POP and its baselines, live: a trial reports ``metric`` (higher is better) every ``report_every``
    steps; each report is one of POP's epochs, and every ``eval_every`` reports is an evaluation boundary."""

    policy: str
    target: float = 1.0
    t_max_s: float = 3600.0
    kill_threshold: float = 0.0
    eval_every: int = 10
    report_every: int = 10
    metric: str = "accuracy"
    p_floor: float = 0.05
    k: int = 1
    max_epochs: int = 0  # 0: none
    y_min: float = 0.0
    y_max: float = 1.0

    def config(self) -> pop.PopConfig:
        return pop.PopConfig(
            target=self.target,
            t_max_s=self.t_max_s,
            kill_threshold=self.kill_threshold,
            eval_every=self.eval_every,
            p_floor=self.p_floor,
            k=self.k,
            max_epochs=self.max_epochs or None,
            y_min=self.y_min,
            y_max=self.y_max,
        )

    def make(self, slots: int) -> pop.SearchPolicy:
        return pop.search_policy(self.policy, self.config(), max(slots, 1))


@dataclass(frozen=True)
class StudyPolicies:
    """What one study chose; ``None`` for a step it leaves to the master's default."""

    order: str | None = None
    time_share: TimeShareParams | None = None
    placement: PlacementParams | None = None
    qos: str | None = None
    search: SearchParams | None = None
    slots: int = 1  # slots per batch (data parallel, on one node manager)

    @property
    def schedules(self) -> bool:
        """Whether it chooses a scheduling step (anything but ``slots``)."""
        return any(x is not None for x in (self.order, self.time_share, self.placement, self.qos, self.search))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.slots != 1:
            out["slots"] = self.slots
        if self.order is not None:
            out["order"] = self.order
        if self.time_share is not None:
            ts = self.time_share
            out["time_share"] = ts.policy
            out["time_share_params"] = {
                "quantum_s": ts.quantum_s,
                "growth": ts.growth,
                "milestones": list(ts.milestones),
                "eval_every": ts.eval_every,
                "metric": ts.metric,
                "g_thres": ts.g_thres,
            }
        if self.placement is not None:
            pl = self.placement
            out["placement"] = pl.policy
            out["placement_params"] = {
                "compute": pl.compute,
                "memory_bytes": pl.memory_bytes,
                "cpus": pl.cpus,
                "oversub": pl.oversub,
            }
        if self.qos is not None:
            out["qos"] = self.qos
        if self.search is not None:
            sp = self.search
            out["search"] = sp.policy
            out["search_params"] = {k: getattr(sp, k) for k in _PARAMS["search_params"]}
        return out


# The names each key accepts (a typed registry; an unknown name is an error that lists them).
POLICY_NAMES: Mapping[str, tuple[str, ...]] = {
    "order": tuple(sorted(ORDER_POLICIES)),
    "time_share": tuple(sorted(hermes.TIME_SHARE_POLICIES)),
    "placement": tuple(sorted(packing.PLACE_POLICIES)),
    "qos": genie.QOS_CLASSES,
    "search": tuple(sorted(pop.SEARCH_POLICIES)),
}
_PARAMS: Mapping[str, Mapping[str, type]] = {
    "time_share_params": {
        "quantum_s": float,
        "growth": float,
        "milestones": list,
        "eval_every": int,
        "metric": str,
        "g_thres": int,
    },
    "placement_params": {"compute": float, "memory_bytes": float, "cpus": float, "oversub": float},
    "search_params": {
        "target": float,
        "t_max_s": float,
        "kill_threshold": float,
        "eval_every": int,
        "report_every": int,
        "metric": str,
        "p_floor": float,
        "k": int,
        "max_epochs": int,
        "y_min": float,
        "y_max": float,
    },
}


def _params(obj: Mapping[str, Any], key: str) -> dict[str, Any]:
    raw = obj.get(key, {})
    if not isinstance(raw, Mapping):
        raise InvalidArgument(f"policies.{key}: must be an object")
    known = _PARAMS[key]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise InvalidArgument(f"policies.{key}: unknown parameters {unknown}; known: {sorted(known)}")
    out: dict[str, Any] = {}
    for k, v in raw.items():
        want = known[k]
        if want is float and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
        elif (want is int and isinstance(v, int) and not isinstance(v, bool)) or (want is str and isinstance(v, str)):
            out[k] = v
        elif want is list and isinstance(v, list) and all(isinstance(x, int | float) for x in v):
            out[k] = tuple(float(x) for x in v)
        else:
            raise InvalidArgument(f"policies.{key}.{k}: must be a {want.__name__}, got {v!r}")
    return out


def parse_policies(obj: Any) -> StudyPolicies:
    """Validate a study's ``"policies"`` object (see the master's ``stagetree.master.policies``)."""
    if not isinstance(obj, Mapping):
        raise InvalidArgument("policies: must be an object of step name -> policy name")
    allowed = set(POLICY_NAMES) | set(_PARAMS) | {"slots"}
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise InvalidArgument(f"policies: unknown keys {unknown}; known: {sorted(allowed)}")
    names: dict[str, str] = {}
    for key, valid in POLICY_NAMES.items():
        v = obj.get(key)
        if v is None:
            continue
        if v not in valid:
            raise InvalidArgument(f"policies.{key}: unknown policy {v!r}; valid: {list(valid)}")
        names[key] = v
    for key, step in (
        ("time_share_params", "time_share"),
        ("placement_params", "placement"),
        ("search_params", "search"),
    ):
        if key in obj and step not in names:
            raise InvalidArgument(f"policies.{key}: given without policies.{step}")
    ts = pl = None
    if "time_share" in names:
        p = _params(obj, "time_share_params")
        ts = TimeShareParams(names["time_share"], **p)
        if ts.quantum_s <= 0 or ts.growth < 1 or ts.eval_every < 1 or ts.g_thres < 1:
            raise InvalidArgument(
                "policies.time_share_params: need quantum_s > 0, growth >= 1, eval_every >= 1, g_thres >= 1"
            )
    if "placement" in names:
        p = _params(obj, "placement_params")
        pl = PlacementParams(names["placement"], **p)
        if not 0 < pl.compute <= 100 * pl.oversub or pl.memory_bytes < 0 or pl.cpus < 0 or pl.oversub < 1:
            raise InvalidArgument(
                "policies.placement_params: need 0 < compute <= 100 * oversub, memory_bytes >= 0, cpus >= 0, "
                "oversub >= 1"
            )
    sp = None
    if "search" in names:
        sp = SearchParams(names["search"], **_params(obj, "search_params"))
        if sp.report_every < 1 or sp.max_epochs < 0:
            raise InvalidArgument("policies.search_params: need report_every >= 1 and max_epochs >= 0")
        try:
            sp.make(1)  # PopConfig's own checks, and what the baseline needs (earlyterm: max_epochs)
        except InvalidArgument as e:
            raise InvalidArgument(f"policies.search_params: {e.message}") from None
    slots = obj.get("slots", 1)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise InvalidArgument(f"policies.slots: must be an integer >= 1 (slots per batch), got {slots!r}")
    return StudyPolicies(names.get("order"), ts, pl, names.get("qos"), sp, slots)


# -- the round's inputs -------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    """One ready batch of the round (``key`` is the caller's handle), with its study and job."""

    key: int
    study: str
    job: str  # the trial it advances (the time-sharing job)
    cost_s: float  # estimated seconds on ``slots`` slots
    arrival: float  # when its oldest request arrived
    slots: int = 1  # the slots it takes (data-parallel ranks on one node manager)
    widths: tuple[tuple[int, float], ...] = ()  # (n, estimated seconds on n slots): GENIE may pick n


@dataclass(frozen=True)
class Running:
    batch: int
    slot: str
    study: str
    job: str
    started: float  # when its current quantum started


@dataclass
class RoundPlan:
    dispatch: list[tuple[int, str]] = field(default_factory=list)  # (work key, slot id), in launch order
    preempt: list[int] = field(default_factory=list)  # running batch ids to preempt
    order: list[int] = field(default_factory=list)  # every work key, in the order served


# -- the step -----------------------------------------------------------------------------------


def _unit_model() -> genie.PerfModel:
    # throughput 1 on one slot: a task of batch 1 and ``iterations = seconds`` has latency = seconds
    return genie.PerfModel(1.0, 0.0, 0.0)


def order_work(
    work: Sequence[Work],
    policies: Mapping[str, StudyPolicies],
    jobs: Mapping[str, hermes.TimeShareJob],
    now: float,
    search: Mapping[str, pop.SearchPolicy] | None = None,
    shape: genie.ClusterShape | None = None,
) -> list[Work]:
    """Step 1: GENIE's waiting allowance across studies when one has a QoS class (and its width for work
    with ``widths``, on a cluster of ``shape``: node managers x their most slots); then, within the
    positions the work of POP studies holds, POP's promising trials first (highest ``p``) and the rest in
    arrival order (``next_job``); then Hermes' score among the time-sharing studies' work."""
    out = list(work)
    if shape is not None and any(w.widths and policies.get(w.study, StudyPolicies()).qos for w in out):
        out = _genie_widths(out, policies, now, shape)
    elif any(policies.get(w.study, StudyPolicies()).qos for w in out):
        model = _unit_model()
        tasks = [
            genie.Task(
                str(i),
                "unit",
                1.0,
                max(w.cost_s, 1e-6),
                w.arrival,
                policies.get(w.study, StudyPolicies()).qos or "normal",
            )
            for i, w in enumerate(out)
        ]
        planned = genie.plan_queue("genie", tasks, now, {"unit": model}, genie.ClusterShape(1, 1))
        out = [out[int(p.task.id)] for p in planned]
    search = search or {}
    pop_pos = [i for i, w in enumerate(out) if w.study in search]
    if pop_pos:

        def prio(w: Work) -> tuple[float, float]:
            p = search[w.study].priority(w.job)
            return (-(p if p is not None else -1.0), w.arrival)

        items = sorted((out[i] for i in pop_pos), key=prio)
        for i, w in zip(pop_pos, items, strict=True):
            out[i] = w
    ts_pos = [i for i, w in enumerate(out) if _ts(policies, w.study) is not None]
    if ts_pos:
        items = [out[i] for i in ts_pos]

        def key(w: Work) -> tuple[float, float]:
            ts = _ts(policies, w.study)
            assert ts is not None
            job = jobs.get(w.job) or hermes.TimeShareJob(w.job, w.arrival)
            return (-ts.make().score(job, now), w.arrival)

        items.sort(key=key)
        for i, w in zip(ts_pos, items, strict=True):
            out[i] = w
    return out


def _genie_widths(
    work: Sequence[Work], policies: Mapping[str, StudyPolicies], now: float, shape: genie.ClusterShape
) -> list[Work]:
    """GENIE Alg. 1 with each work's width chosen (``genie.choose_width``), served in increasing waiting
    allowance; work without ``widths`` keeps its slots."""
    planned = []
    for i, w in enumerate(work):
        qos = policies.get(w.study, StudyPolicies()).qos or "normal"
        widths = w.widths or ((w.slots, w.cost_s),)
        n, latency, allowance = genie.choose_width(qos, w.arrival, widths, now, shape)
        planned.append((allowance, w.arrival, i, replace(w, slots=n, cost_s=latency)))
    planned.sort(key=lambda p: p[:3])
    return [p[3] for p in planned]


def _ts(policies: Mapping[str, StudyPolicies], study: str) -> TimeShareParams | None:
    p = policies.get(study)
    return None if p is None else p.time_share


def place_work(
    ordered: Sequence[Work],
    free: Sequence[Slot],
    busy: Mapping[str, Slot],
    running: Sequence[Running],
    policies: Mapping[str, StudyPolicies],
) -> list[tuple[int, str]]:
    """Step 2: (work key, slot id) for the work that gets a slot now, in ``ordered``'s order."""
    free_by_dev: dict[str, list[Slot]] = {}
    for s in free:
        free_by_dev.setdefault(s.device, []).append(s)
    all_slots = [*free, *busy.values()]
    devices: dict[str, list[Slot]] = {}
    for s in all_slots:
        devices.setdefault(s.device, []).append(s)
    node_cpus: dict[str, float] = {}
    for s in all_slots:
        node_cpus[s.node_manager] = node_cpus.get(s.node_manager, 0.0) + float(s.cpu_cores or 1)

    def demand(study: str, device_slots: int) -> packing.Demand:
        p = policies.get(study)
        if p is None or p.placement is None:  # a plain batch holds its slot's share of the device
            return packing.Demand(100.0 / max(device_slots, 1), 0.0, 0.0, 0.0)
        return packing.Demand(p.placement.compute, p.placement.memory_bytes, p.placement.cpus, 0.0)

    def item(key: str, study: str, cost: float) -> packing.PackItem:
        d = {}
        for slots in devices.values():
            base = demand(study, len(slots))
            d[slots[0].gpu_type] = packing.Demand(base.compute, base.memory, base.cpus, cost)
        return packing.PackItem(key, d)

    def bin_of(dev: str, oversub: float) -> packing.GpuBin:
        slots = devices[dev]
        mem = sum(s.memory_bytes for s in slots) or math.inf
        return packing.GpuBin(Slot(dev, slots[0].node_manager, slots[0].gpu_type), mem, oversub)

    usage = packing.Usage()
    slot_dev = {s.id: s.device for s in all_slots}
    for r in running:
        dev = slot_dev.get(r.slot)
        if dev is not None:
            usage.add(item(f"run{r.batch}", r.study, 0.0), bin_of(dev, 1.0))

    # decreasing policies serve their items longest first, in the positions those items hold
    order = list(ordered)
    by_pol: dict[str, list[int]] = {}
    for i, w in enumerate(order):
        p = policies.get(w.study)
        if p is not None and p.placement is not None and packing.place_policy(p.placement.policy).decreasing:
            by_pol.setdefault(p.placement.policy, []).append(i)
    for idx in by_pol.values():
        items = sorted((order[i] for i in idx), key=lambda w: -w.cost_s)
        for i, w in zip(idx, items, strict=True):
            order[i] = w

    load: dict[str, int] = {}  # running and placed jobs per device (Hermes Alg. 2)
    for r in running:
        dev = slot_dev.get(r.slot)
        if dev is not None:
            load[dev] = load.get(dev, 0) + 1

    out: list[tuple[int, str]] = []
    for w in order:
        if not any(free_by_dev.values()):
            break
        p = policies.get(w.study)
        if w.slots > 1:
            taken = _wide(free_by_dev, w.slots)
            if taken is None:
                continue  # no node manager has that many free now: waits for a later round
            for dev, slot in taken:
                usage.add(item(f"w{w.key}.{slot.id}", w.study, w.cost_s), bin_of(dev, 1.0))
                load[dev] = load.get(dev, 0) + 1
            out.append((w.key, ",".join(slot.id for _, slot in taken)))
            continue
        if p is not None and p.placement is None and p.time_share is not None:
            counts = {d: load.get(d, 0) for d, sl in free_by_dev.items() if sl}
            chosen = hermes.find_available_gpu(counts, p.time_share.g_thres)
            if chosen is None:
                continue  # every device holds G_thres jobs: the global queue
            slot = free_by_dev[chosen].pop(0)
            load[chosen] = load.get(chosen, 0) + 1
            usage.add(item(f"w{w.key}", w.study, w.cost_s), bin_of(chosen, 1.0))
            out.append((w.key, slot.id))
            continue
        if p is None or p.placement is None:
            dev = next(d for d, sl in free_by_dev.items() if sl)
            slot = free_by_dev[dev].pop(0)
            usage.add(item(f"w{w.key}", w.study, w.cost_s), bin_of(dev, 1.0))
            out.append((w.key, slot.id))
            continue
        pl = p.placement
        cands = [bin_of(d, pl.oversub) for d, sl in free_by_dev.items() if sl]
        it = item(f"w{w.key}", w.study, w.cost_s)
        got = packing.place(pl.policy, [it], cands, node_cpus, usage)
        dev = got.get(it.id)
        if dev is None:
            continue  # fits on no device now: waits for a later round
        load[dev] = load.get(dev, 0) + 1
        out.append((w.key, free_by_dev[dev].pop(0).id))
    return out


def _wide(free_by_dev: dict[str, list[Slot]], n: int) -> list[tuple[str, Slot]] | None:
    """``n`` free slots of one node manager (the first that has them, its devices in order), taken out
    of ``free_by_dev``; None, nothing taken, when none has."""
    by_nm: dict[str, list[tuple[str, Slot]]] = {}
    for dev, slots in free_by_dev.items():
        for s in slots:
            by_nm.setdefault(s.node_manager, []).append((dev, s))
    pick = next((lst[:n] for lst in by_nm.values() if len(lst) >= n), None)
    if pick is not None:
        for dev, s in pick:
            free_by_dev[dev].remove(s)
    return pick


def preempt_for(
    waiting: Sequence[Work],
    running: Sequence[Running],
    policies: Mapping[str, StudyPolicies],
    jobs: Mapping[str, hermes.TimeShareJob],
    now: float,
) -> list[int]:
    """Step 3: Hermes' node scheduler (Alg. 3) over the busy slots of time-sharing studies, with one
    global queue: each waiting job may displace one running job whose quantum expired."""
    queue = [w for w in waiting if _ts(policies, w.study) is not None]
    out: list[int] = []
    taken: set[str] = set()
    for r in sorted(running, key=lambda r: r.started):
        ts = _ts(policies, r.study)
        if ts is None:
            continue
        pol = ts.make()
        cur = jobs.get(r.job) or hermes.TimeShareJob(r.job)
        cands = [
            jobs.get(w.job) or hermes.TimeShareJob(w.job, w.arrival)
            for w in queue
            if w.job not in taken and w.job != r.job
        ]
        switches = hermes.node_round(pol, {r.slot: hermes.RunningJob(cur, r.started)}, {r.slot: cands}, now)
        for sw in switches:
            if sw.stop is not None:
                out.append(r.batch)
                taken.add(sw.start)
    return out


def plan_round(
    work: Sequence[Work],
    free: Sequence[Slot],
    busy: Mapping[str, Slot],
    running: Sequence[Running],
    policies: Mapping[str, StudyPolicies],
    jobs: Mapping[str, hermes.TimeShareJob],
    now: float,
    search: Mapping[str, pop.SearchPolicy] | None = None,
) -> RoundPlan:
    """Steps 1-3 for one round; ``work`` is the ready work in the master's base order. A dispatch of work
    on several slots names them all, ``"a,b"`` (rank order)."""
    per_nm: dict[str, int] = {}
    for s in [*free, *busy.values()]:
        per_nm[s.node_manager] = per_nm.get(s.node_manager, 0) + 1
    shape = genie.ClusterShape(len(per_nm), max(per_nm.values())) if per_nm else None
    ordered = order_work(work, policies, jobs, now, search, shape)
    dispatch = place_work(ordered, free, busy, running, policies)
    placed = {k for k, _ in dispatch}
    waiting = [w for w in ordered if w.key not in placed]
    preempt = preempt_for(waiting, running, policies, jobs, now)
    return RoundPlan(dispatch, preempt, [w.key for w in ordered])


def eval_points(stages: Sequence[tuple[int, int, int]], every: int) -> list[tuple[int, int]]:
    """(node, step) every ``every`` steps inside ``(node, start, end)`` stages: where a time-sharing
    batch reports its losses."""
    out: list[tuple[int, int]] = []
    for node, start, end in stages:
        first = (start // every + 1) * every
        out.extend((node, s) for s in range(first, end + 1, every))
    return out


_STRENGTH = {pop.Verdict.CONTINUE: 0, pop.Verdict.SUSPEND: 1, pop.Verdict.TERMINATE: 2}


def on_reports(
    policy: pop.SearchPolicy,
    job: str,
    first_epoch: int,
    values: Sequence[float],
    now: float,
    epoch_s: float,
    waiting: int,
) -> pop.Verdict:
    """Feed a trial's new reports to its study's search policy as epochs ``first_epoch``, ``+1``, ...;
    the strongest verdict wins (TERMINATE over SUSPEND over CONTINUE), and nothing is fed after a kill."""
    verdict = pop.Verdict.CONTINUE
    for i, v in enumerate(values):
        got = policy.on_epoch(job, first_epoch + i, v, now, epoch_s, waiting)
        if _STRENGTH[got] > _STRENGTH[verdict]:
            verdict = got
        if got is pop.Verdict.TERMINATE:
            break
    return verdict


def losses_of(points: Sequence[tuple[float, Mapping[str, float]]], metric: str) -> list[float]:
    """The quantum's losses (``metric``) in recording order, from (recorded_at, values) pairs."""
    return [float(v[metric]) for _, v in sorted(points, key=lambda p: p[0]) if metric in v]
