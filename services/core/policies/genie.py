"""GENIE (Chen et al., NUDT): QoS-guided placement of multi-GPU work, with its baselines, as pure plug-ins.

Performance model (§II-B), per task type (model, training or inference) on one platform:

* Eq. 1: throughput ``p = (n g - o) * pbar(b / (n g))`` for ``n`` nodes of ``g`` GPUs, where the per-GPU
  throughput ``pbar`` is quadratic in the local batch size (rising, then flat past its vertex);
* Eq. 2: latency ``l = b r / p + nu`` for ``r`` iterations of global batch ``b`` and start-up ``nu``;
* Eq. 3: ``o = (lambda1 (n - 1) g + lambda2 (g - 1)) / (n g - 1)`` (0 on one GPU): GPUs' worth lost to
  communication, weighting the average path between GPUs by ``lambda1`` across nodes and ``lambda2``
  within one (both 0 for inference).

``fit_perf_model`` fits it from the lightweight profile of §II-B: ``B`` single-GPU runs over batch sizes,
``N`` runs over node counts and ``G`` runs over GPUs per node (``B + N + G`` runs, not ``B * N * G``).

QoS (§III-A, Eq. 4): the expected completion time is ``arrival + e`` with ``e = 0`` (Urgent),
``lbar`` (Prior) or ``2 lbar`` (Normal), ``lbar`` the latency on one GPU. Cost (Eq. 5):
``c = n g / (N G) + theta n / N``; cost-effective ratio ``CER = p / c``.

QoS-guided order (Alg. 1): for each waiting task, among the placements that would meet its ECT if it
started now, the one with the highest CER (if none, the highest CER of all); its waiting allowance
``w = ECT - (now + l)``; the queue is served in increasing ``w``.

Baselines (§IV-A), served in arrival order: ``maxocc`` (the most GPUs free now), ``minocc`` (one GPU),
``perfpre`` (the highest predicted throughput), ``cerpre`` (the highest CER).

Plug-in interface (the master's Order + Place steps for multi-GPU stages and studies with deadlines)::

    plans = plan_queue("genie", waiting, now, models, shape, theta, free)  # -> [Planned(task, placement, w)]
    slots = fit_placement(plan.placement, free)        # -> {node: gpus} or None when it does not fit now

``free`` maps each node to its free GPUs; tasks are launched in the returned order while they fit.

In the scheduling round (``stagetree.core.round``), a batch's width is chosen by ``choose_width``: Alg. 1
for one task over widths ``n`` on one node, with the latency the master's cost model predicts on ``n``
slots standing in for Eq. 1-3 (it is fitted on the batches that ran, ``t = a + b / n`` per step); the
baselines are there too, by name (``WIDTH_POLICIES``). Alg. 1 picks a placement as if the task started
now; when the chosen width is not free together on one node, the task starts now on the next width of
``M'_i`` (``in_time_widths``) that is, else it holds the free GPUs of the node closest to having its
width (``WidthChoice.hold``), so that narrower work served after it does not take them meanwhile.

A task none of whose placements meets its ECT any more (``M'_i`` empty) has lost its QoS whatever it
runs on: Alg. 1 would give it a negative allowance, i.e. serve it before every task still in time, which
on a loaded cluster makes those late too (the domino effect of least-slack-first under overload). The
live round serves it after every task still in time instead (``LOST_TIER``), first come first served,
on its highest-CER placement. An Urgent task (ECT = arrival, never met) keeps its place at the front:
Eq. 4 gives it the top priority.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from stagetree.core.errors import InvalidArgument, NotFound

QOS_CLASSES = ("urgent", "prior", "normal")
# Eq. 5's node weight. Small: a placement's cost is mostly its share of the GPUs, so the CER favours the
# GPU-efficient placements and GENIE widens a task only when its deadline needs it.
DEFAULT_THETA = 0.02
PLATEAU = 0.97  # a single-GPU throughput this close to the best counts as saturated
# The order key of a non-Urgent task that can no longer meet its ECT: LOST_TIER + its arrival, after every
# key of a task still in time (a waiting allowance, at most 2 lbar of a task, or a baseline's arrival).
LOST_TIER = 1e12


def order_key(qos: str, arrival: float, allowance: float, in_time: bool) -> float:
    """A task's place in the queue: its waiting allowance while some placement meets its ECT (or it is
    Urgent), else ``LOST_TIER`` + its arrival."""
    return allowance if in_time or qos == "urgent" else LOST_TIER + arrival


@dataclass(frozen=True)
class Placement:
    nodes: int
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class PerfModel:
    """Eq. 1-3 for one task type: ``pbar(x) = a0 + a1 x + a2 x^2`` (samples/s per GPU at local batch x)."""

    a0: float
    a1: float
    a2: float
    lambda1: float = 0.0
    lambda2: float = 0.0
    startup_s: float = 0.0

    def per_gpu(self, local_batch: float) -> float:
        """The quadratic, held at its maximum past the vertex (the GPU is saturated), never below a
        trickle so a latency stays finite."""
        x = local_batch
        if self.a2 < 0:
            x = min(x, -self.a1 / (2.0 * self.a2))
        return max(self.a0 + self.a1 * x + self.a2 * x * x, 1e-6)

    def overhead(self, pl: Placement) -> float:
        """Eq. 3."""
        n, g = pl.nodes, pl.gpus_per_node
        if n * g == 1:
            return 0.0
        return (self.lambda1 * (n - 1) * g + self.lambda2 * (g - 1)) / (n * g - 1)

    def throughput(self, batch: float, pl: Placement) -> float:
        """Eq. 1."""
        k = pl.gpus
        return max(k - self.overhead(pl), 1e-6) * self.per_gpu(batch / k)

    def latency(self, batch: float, iterations: float, pl: Placement) -> float:
        """Eq. 2."""
        return batch * iterations / self.throughput(batch, pl) + self.startup_s


def _lstsq(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares by the normal equations (a few columns); a tiny ridge keeps them solvable."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    scale = max(max(abs(a[i][i]) for i in range(k)), 1e-300)
    for i in range(k):
        a[i][i] += 1e-12 * scale
    # Gaussian elimination with partial pivoting.
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(a[r][c]))
        a[c], a[p] = a[p], a[c]
        b[c], b[p] = b[p], b[c]
        for r in range(c + 1, k):
            f = a[r][c] / a[c][c]
            for j in range(c, k):
                a[r][j] -= f * a[c][j]
            b[r] -= f * b[c]
    x = [0.0] * k
    for r in range(k - 1, -1, -1):
        x[r] = (b[r] - sum(a[r][j] * x[j] for j in range(r + 1, k))) / a[r][r]
    return x


@dataclass(frozen=True)
class ProfileRun:
    """One profiling run: global batch, placement, measured throughput (samples/s)."""

    batch: float
    placement: Placement
    throughput: float


def fit_perf_model(runs: Sequence[ProfileRun], startup_s: float = 0.0, inference: bool = False) -> PerfModel:
    """Eq. 1-3 from a lightweight profile: the single-GPU runs fix the quadratic ``pbar`` (at least three
    batch sizes), the multi-GPU runs then give ``lambda1, lambda2`` by least squares on Eq. 3
    (``o (n g - 1) = lambda1 (n - 1) g + lambda2 (g - 1)`` with ``o = n g - p / pbar(b / (n g))``).

    The quadratic is fitted to the rising part of the single-GPU curve, up to the first batch size that
    comes within ``PLATEAU`` of the best throughput; ``PerfModel.per_gpu`` holds its top beyond. (A
    parabola through the plateau too would sag where the GPU is merely saturated.)"""
    single = sorted((r for r in runs if r.placement.gpus == 1), key=lambda r: r.batch)
    if len({r.batch for r in single}) < 3:
        raise InvalidArgument("fit_perf_model: need single-GPU runs at three or more batch sizes for the quadratic")
    top = max(r.throughput for r in single)
    knee = next(i for i, r in enumerate(single) if r.throughput >= PLATEAU * top)
    single = single[: max(knee + 1, 3)]
    scale = max(r.batch for r in single)  # fit in units of the largest batch: a well-conditioned system
    c0, c1, c2 = _lstsq(
        [[1.0, r.batch / scale, (r.batch / scale) ** 2] for r in single], [r.throughput for r in single]
    )
    a0, a1, a2 = c0, c1 / scale, c2 / scale**2
    base = PerfModel(a0, a1, a2, startup_s=startup_s)
    multi = [r for r in runs if r.placement.gpus > 1]
    if inference or not multi:
        return base
    rows, ys = [], []
    for r in multi:
        n, g = r.placement.nodes, r.placement.gpus_per_node
        o = n * g - r.throughput / base.per_gpu(r.batch / (n * g))
        rows.append([(n - 1) * g, g - 1])
        ys.append(o * (n * g - 1))
    if all(row[0] == 0 for row in rows):  # only one node profiled: no cross-node weight to fit
        lam2 = _lstsq([[row[1]] for row in rows], ys)[0]
        return PerfModel(a0, a1, a2, 0.0, max(lam2, 0.0), startup_s)
    if all(row[1] == 0 for row in rows):
        lam1 = _lstsq([[row[0]] for row in rows], ys)[0]
        return PerfModel(a0, a1, a2, max(lam1, 0.0), 0.0, startup_s)
    lam1, lam2 = _lstsq(rows, ys)
    return PerfModel(a0, a1, a2, max(lam1, 0.0), max(lam2, 0.0), startup_s)


def lightweight_profile_plan(
    batches: Sequence[int], max_nodes: int, max_gpus: int, batch: int
) -> list[tuple[int, Placement]]:
    """The ``B + N + G`` runs: every batch on one GPU, then ``batch`` on 2..N nodes of one GPU and on one
    node of 2..G GPUs. ``batches`` should reach down to the local batches that wide placements make."""
    plan = [(b, Placement(1, 1)) for b in batches]
    plan += [(batch, Placement(n, 1)) for n in range(2, max_nodes + 1)]
    plan += [(batch, Placement(1, g)) for g in range(2, max_gpus + 1)]
    return plan


@dataclass(frozen=True)
class Task:
    """A multi-GPU unit of work: a ``kind`` (its performance model), global batch, iterations, QoS class."""

    id: str
    kind: str
    batch: float
    iterations: float
    arrival: float
    qos: str = "normal"

    def __post_init__(self) -> None:
        if self.qos not in QOS_CLASSES:
            raise InvalidArgument(f"Task {self.id}: qos must be one of {QOS_CLASSES}, got {self.qos!r}")


@dataclass(frozen=True)
class ClusterShape:
    """``N`` nodes of up to ``G`` GPUs each (Eq. 5's upper limits)."""

    nodes: int
    gpus_per_node: int

    def placements(self) -> list[Placement]:
        return [Placement(n, g) for n in range(1, self.nodes + 1) for g in range(1, self.gpus_per_node + 1)]


def model_of(models: Mapping[str, PerfModel], task: Task) -> PerfModel:
    m = models.get(task.kind)
    if m is None:
        raise NotFound(f"no performance model for task kind {task.kind!r}; profile it first")
    return m


def ect(task: Task, model: PerfModel) -> float:
    """Eq. 4, as an absolute time: arrival + {0, lbar, 2 lbar} for Urgent, Prior, Normal."""
    lbar = model.latency(task.batch, task.iterations, Placement(1, 1))
    return task.arrival + {"urgent": 0.0, "prior": lbar, "normal": 2.0 * lbar}[task.qos]


def cost(pl: Placement, shape: ClusterShape, theta: float) -> float:
    """Eq. 5."""
    return pl.gpus / (shape.nodes * shape.gpus_per_node) + theta * pl.nodes / shape.nodes


def cer(task: Task, model: PerfModel, pl: Placement, shape: ClusterShape, theta: float) -> float:
    return model.throughput(task.batch, pl) / cost(pl, shape, theta)


@dataclass(frozen=True)
class Planned:
    task: Task
    placement: Placement
    latency: float
    allowance: float  # GENIE's w; for the baselines, -arrival (FIFO)


def fit_placement(pl: Placement, free: Mapping[str, int]) -> dict[str, int] | None:
    """Nodes to run ``pl`` on now: ``pl.nodes`` nodes with ``pl.gpus_per_node`` free GPUs each, the fullest
    such nodes first (keeps whole nodes free for wide work); None if it does not fit."""
    ok = sorted((n for n, f in free.items() if f >= pl.gpus_per_node), key=lambda n: (free[n], n))
    if len(ok) < pl.nodes:
        return None
    return {n: pl.gpus_per_node for n in ok[: pl.nodes]}


@dataclass(frozen=True)
class Option:
    """A placement of one task with its predicted throughput, latency and cost-effective ratio."""

    placement: Placement
    throughput: float
    latency: float
    cer: float


@functools.lru_cache(maxsize=1 << 16)
def options(model: PerfModel, batch: float, iterations: float, shape: ClusterShape, theta: float) -> tuple[Option, ...]:
    """Every placement of the cluster for this work, by decreasing CER (fewer GPUs, then nodes, on ties).
    Cached: a round re-plans the whole queue, and a task's options never change."""
    out = []
    for pl in shape.placements():
        thr = model.throughput(batch, pl)
        out.append(Option(pl, thr, batch * iterations / thr + model.startup_s, thr / cost(pl, shape, theta)))
    out.sort(key=lambda o: (-o.cer, o.placement.gpus, o.placement.nodes))
    return tuple(out)


def genie_plan(
    waiting: Sequence[Task], now: float, models: Mapping[str, PerfModel], shape: ClusterShape, theta: float
) -> list[Planned]:
    """Alg. 1: each task's placement and waiting allowance; the queue in increasing allowance, then the
    non-Urgent tasks that can no longer meet their ECT, in arrival order (see the module docstring)."""
    out = []
    keys = {}
    for t in waiting:
        m = model_of(models, t)
        e = ect(t, m)
        opts = options(m, t.batch, t.iterations, shape, theta)
        met = next((o for o in opts if now + o.latency <= e), None)  # opts go by decreasing CER
        best = met or opts[0]
        allowance = e - (now + best.latency)
        out.append(Planned(t, best.placement, best.latency, allowance))
        keys[t.id] = order_key(t.qos, t.arrival, allowance, met is not None)
    out.sort(key=lambda p: (keys[p.task.id], p.task.arrival, p.task.id))
    return out


def _fifo_plan(
    waiting: Sequence[Task],
    models: Mapping[str, PerfModel],
    choose: Callable[[Sequence[Option]], Option],
    shape: ClusterShape,
    theta: float,
) -> list[Planned]:
    out = []
    for t in sorted(waiting, key=lambda t: (t.arrival, t.id)):
        o = choose(options(model_of(models, t), t.batch, t.iterations, shape, theta))
        out.append(Planned(t, o.placement, o.latency, -t.arrival))
    return out


QueuePolicy = Callable[
    [Sequence[Task], float, Mapping[str, PerfModel], ClusterShape, float, Mapping[str, int]], list[Planned]
]


def _genie(
    waiting: Sequence[Task], now: float, models: Mapping[str, PerfModel], shape: ClusterShape, theta: float,
    free: Mapping[str, int],
) -> list[Planned]:  # fmt: skip
    return genie_plan(waiting, now, models, shape, theta)


def _maxocc(
    waiting: Sequence[Task], now: float, models: Mapping[str, PerfModel], shape: ClusterShape, theta: float,
    free: Mapping[str, int],
) -> list[Planned]:  # fmt: skip
    """The widest placement the free GPUs allow now (one GPU when nothing is free: the task waits)."""
    fitting = [pl for pl in shape.placements() if fit_placement(pl, free) is not None]
    widest = max(fitting, key=lambda p: (p.gpus, -p.nodes)) if fitting else Placement(1, 1)
    return _fifo_plan(waiting, models, lambda opts: next(o for o in opts if o.placement == widest), shape, theta)


def _minocc(
    waiting: Sequence[Task], now: float, models: Mapping[str, PerfModel], shape: ClusterShape, theta: float,
    free: Mapping[str, int],
) -> list[Planned]:  # fmt: skip
    one = Placement(1, 1)
    return _fifo_plan(waiting, models, lambda opts: next(o for o in opts if o.placement == one), shape, theta)


def _perfpre(
    waiting: Sequence[Task], now: float, models: Mapping[str, PerfModel], shape: ClusterShape, theta: float,
    free: Mapping[str, int],
) -> list[Planned]:  # fmt: skip
    return _fifo_plan(
        waiting, models, lambda opts: max(opts, key=lambda o: (o.throughput, -o.placement.gpus)), shape, theta
    )


def _cerpre(
    waiting: Sequence[Task], now: float, models: Mapping[str, PerfModel], shape: ClusterShape, theta: float,
    free: Mapping[str, int],
) -> list[Planned]:  # fmt: skip
    return _fifo_plan(waiting, models, lambda opts: opts[0], shape, theta)


QUEUE_POLICIES: Mapping[str, QueuePolicy] = {
    "genie": _genie,  # QoS-guided: highest CER among ECT-meeting placements, smallest waiting allowance first
    "maxocc": _maxocc,  # the most GPUs free now, arrival order
    "minocc": _minocc,  # one GPU, arrival order
    "perfpre": _perfpre,  # the highest predicted throughput, arrival order
    "cerpre": _cerpre,  # the highest cost-effective ratio, arrival order
}


def plan_queue(
    policy: str,
    waiting: Sequence[Task],
    now: float,
    models: Mapping[str, PerfModel],
    shape: ClusterShape,
    theta: float = DEFAULT_THETA,
    free: Mapping[str, int] | None = None,
) -> list[Planned]:
    """The waiting queue in launch order with a placement per task, under ``policy`` (a key of
    ``QUEUE_POLICIES``). ``free`` (node -> free GPUs) is only read by ``maxocc``."""
    fn = QUEUE_POLICIES.get(policy)
    if fn is None:
        raise InvalidArgument(f"unknown GENIE queue policy {policy!r}; known: {sorted(QUEUE_POLICIES)}")
    return fn(waiting, now, models, shape, theta, free or {})


def launch(
    plans: Sequence[Planned], free: Mapping[str, int], backfill: bool = True
) -> list[tuple[Planned, dict[str, int]]]:
    """Start tasks in plan order while their placement fits the free GPUs. With ``backfill`` a task that
    does not fit is passed over and later ones may start; without, the first that does not fit stops
    the round (strict order)."""
    avail = dict(free)
    out = []
    for plan in plans:
        nodes = fit_placement(plan.placement, avail)
        if nodes is None:
            if backfill:
                continue
            break
        for n, g in nodes.items():
            avail[n] -= g
        out.append((plan, nodes))
    return out


def deadline_met(task: Task, finish: float, model: PerfModel) -> bool:
    """The QoS guarantee: finished no later than the ECT. (An Urgent task's ECT is its arrival, which
    nothing meets: Eq. 4 gives it the top priority rather than a deadline it could keep.)"""
    return finish <= ect(task, model) + 1e-9


def _ect_of(qos: str, arrival: float, opts: Sequence[tuple[int, float]]) -> float:
    """Eq. 4 as an absolute time, from the latency on the fewest GPUs given."""
    if qos not in QOS_CLASSES:
        raise InvalidArgument(f"qos must be one of {QOS_CLASSES}, got {qos!r}")
    lbar = min(opts)[1]
    return arrival + {"urgent": 0.0, "prior": lbar, "normal": 2.0 * lbar}[qos]


def in_time_widths(
    qos: str,
    arrival: float,
    latency_by_width: Sequence[tuple[int, float]],
    now: float,
    shape: ClusterShape,
    theta: float = DEFAULT_THETA,
) -> list[tuple[int, float]]:
    """Alg. 1's ``M'_i`` for one task on ``n`` GPUs of one node: the ``(n, latency)`` that meet the ECT
    (Eq. 4) if started now, by decreasing CER (fewer GPUs on ties)."""
    opts = _width_options(latency_by_width, shape)
    ect_abs = _ect_of(qos, arrival, opts)
    return [o for o in _cer_order(opts, shape, theta) if now + o[1] <= ect_abs]


def choose_width(
    qos: str,
    arrival: float,
    latency_by_width: Sequence[tuple[int, float]],
    now: float,
    shape: ClusterShape,
    theta: float = DEFAULT_THETA,
) -> tuple[int, float, float]:
    """Alg. 1 for one task placed on ``n`` GPUs of one node, ``(n, latency)`` given per width: the ECT
    (Eq. 4) from its latency on the fewest GPUs; among the widths that meet it, the highest CER (Eq. 5:
    throughput ``1 / latency`` over ``c = n / (N G) + theta / N``), else the highest CER of all.
    Returns ``(n, latency, waiting allowance)``."""
    opts = _width_options(latency_by_width, shape)
    ect_abs = _ect_of(qos, arrival, opts)
    n, lat = next(iter(in_time_widths(qos, arrival, opts, now, shape, theta)), _cer_order(opts, shape, theta)[0])
    return n, lat, ect_abs - (now + lat)


def widths(most: int) -> list[int]:
    """The GPU counts a batch may run on when its study asks for up to ``most`` slots: every ``g`` in
    ``1..most``, the placements ``<1, g>`` of §II-B on one node (Alg. 1 weighs each by its CER)."""
    return list(range(1, max(most, 1) + 1))


def _cer_order(opts: Sequence[tuple[int, float]], shape: ClusterShape, theta: float) -> list[tuple[int, float]]:
    """Widths by decreasing cost-effective ratio (Eq. 5 with throughput ``1 / latency``), fewer on ties."""
    return sorted(opts, key=lambda o: (-(1.0 / o[1]) / cost(Placement(1, o[0]), shape, theta), o[0]))


def _width_options(latency_by_width: Sequence[tuple[int, float]], shape: ClusterShape) -> list[tuple[int, float]]:
    opts = [(int(n), float(lat)) for n, lat in latency_by_width if 1 <= n <= shape.gpus_per_node and lat > 0]
    if not opts:
        raise InvalidArgument(f"choose_width: no width of 1..{shape.gpus_per_node} with a positive latency")
    return opts


@dataclass(frozen=True)
class WidthChoice:
    """A batch's width and latency there, its order key (smaller serves first) and the other widths it
    may start on when its own are not free together on one node now, in preference order (GENIE: the
    other widths of ``M'_i``, which meet the ECT too; the baselines: none, their rule fixes the width)."""

    slots: int
    latency: float
    key: float
    others: tuple[tuple[int, float], ...] = ()
    # when none of its widths is free together on one node now: whether it holds the free GPUs of the
    # node closest to having them (GENIE, for a task still in time), so later work leaves them to it
    hold: bool = False


# (qos, arrival, (n, latency) per width, now, cluster shape, most free slots on one node now) -> choice
WidthPolicy = Callable[[str, float, Sequence[tuple[int, float]], float, ClusterShape, int], WidthChoice]


def _genie_width(
    qos: str, arrival: float, widths: Sequence[tuple[int, float]], now: float, shape: ClusterShape, most_free: int
) -> WidthChoice:
    n, lat, allowance = choose_width(qos, arrival, widths, now, shape)
    in_time = in_time_widths(qos, arrival, widths, now, shape)
    key = order_key(qos, arrival, allowance, bool(in_time))
    if not in_time:  # no width meets its ECT: nothing else to start on, nothing to hold for
        return WidthChoice(n, lat, key)
    return WidthChoice(n, lat, key, tuple(o for o in in_time if o[0] != n), hold=True)


def _maxocc_width(
    qos: str, arrival: float, widths: Sequence[tuple[int, float]], now: float, shape: ClusterShape, most_free: int
) -> WidthChoice:
    opts = _width_options(widths, shape)
    fitting = [o for o in opts if o[0] <= max(most_free, 1)] or [min(opts)]
    n, lat = max(fitting)
    return WidthChoice(n, lat, arrival)


def _minocc_width(
    qos: str, arrival: float, widths: Sequence[tuple[int, float]], now: float, shape: ClusterShape, most_free: int
) -> WidthChoice:
    n, lat = min(_width_options(widths, shape))
    return WidthChoice(n, lat, arrival)


def _perfpre_width(
    qos: str, arrival: float, widths: Sequence[tuple[int, float]], now: float, shape: ClusterShape, most_free: int
) -> WidthChoice:
    n, lat = min(_width_options(widths, shape), key=lambda o: (o[1], o[0]))
    return WidthChoice(n, lat, arrival)


def _cerpre_width(
    qos: str, arrival: float, widths: Sequence[tuple[int, float]], now: float, shape: ClusterShape, most_free: int
) -> WidthChoice:
    n, lat = _cer_order(_width_options(widths, shape), shape, DEFAULT_THETA)[0]
    return WidthChoice(n, lat, arrival)


# How the live round picks the width of a batch of a study with a QoS class, by the name the study gives
# (``"width"``): GENIE's Alg. 1 (served by waiting allowance) or one of §IV-A's baselines (served in
# arrival order): ``maxocc`` the most slots one node has free now, ``minocc`` one slot, ``perfpre`` the
# lowest predicted latency, ``cerpre`` the highest cost-effective ratio.
WIDTH_POLICIES: Mapping[str, WidthPolicy] = {
    "genie": _genie_width,
    "maxocc": _maxocc_width,
    "minocc": _minocc_width,
    "perfpre": _perfpre_width,
    "cerpre": _cerpre_width,
}
DEFAULT_WIDTH_POLICY = "genie"


def width_policy(name: str) -> WidthPolicy:
    fn = WIDTH_POLICIES.get(name)
    if fn is None:
        raise InvalidArgument(f"unknown width policy {name!r}; known: {sorted(WIDTH_POLICIES)}")
    return fn
