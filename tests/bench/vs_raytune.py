"""stagetree (embedded mode) side by side with Ray Tune on real PyTorch CPU training.

    pip install ".[bench]"        # ray[tune]
    python -m tests.bench.vs_raytune [--runs 3] [--minibatches 200] [--hidden 256] [--nm-bus-max-age S]

Workloads (``raytune_workloads``), the digits MLP (``stagetree.nodemanager.examples.digits``):

* S1: 48 trials x 40 steps whose learning rate branches in three phases (2 / 4 / 6 choices): merge rate
  3.2. Both systems train every trial to step 40 and evaluate there.
* S2: an ASHA study (reduction 4, rungs 4 / 16 / 64) over 64 warmup -> cosine / multistep schedules x
  4 batch-size sequences. ASHA runs once live on stagetree (untimed; it also warms stagetree up); its
  decisions are then replayed on both systems: each trial is trained to the last step ASHA took it to
  and evaluated at every rung ASHA asked for (stagetree: all those evals submitted at once; Ray Tune:
  one trial at a time per actor, from scratch to its last rung, reporting at each). The live run's own
  figures are printed too (its ASHA decisions depend on timing, so they are taken once).

The trainer is the digits MLP in a user's module (``tests/bench/userstyle/digits_user.py``) that imports
what users' modules import (optuna, scikit-learn, scipy), so each process that imports it pays for them.
Both systems get 2 workers with ``torch.set_num_threads(1)``: stagetree ``Embedded(workers=2)``, Ray Tune
``ray.init(num_cpus=2)`` with one CPU per trial and ``reuse_actors=True``. Every run of a system on a
workload is its own process tree, started by this bench (``--child``) and counted whole by
``tests.bench.proctree`` (a subreaper wrapper: Ray's raylet, GCS and workers; stagetree's master, node
manager, fork server and workers; whatever outlives its parent), from launch to exit, start-up
included. The runs alternate which system goes first; each figure is the median of ``--runs``.

Figures:

* e2e: wall-clock seconds of the tree, from launch to the last process's exit (the child's own time from
  submitting the work to its last result is printed beside it as ``work``). ``--nm-bus-max-age`` sets
  how long stagetree's node manager may hold worker events before publishing them (0.5 s by default).
* cpu_s (the headline, the GPU-hours analog): user + system CPU-seconds of every process of the tree.

Correctness: every trial's final metrics on stagetree equal a straight run of that trial in this process
(``raytune_train.train_straight``, the same seed) to 1e-6; the steps stagetree's batches trained equal
the unique steps of the work (each shared prefix ran once); and Ray's final metrics equal the straight
run too (so both systems did the same training).

Last line: ``merge_rate=<m> cpu_s_ratio_s1=<x> e2e_ratio_s1=<y> cpu_s_ratio_s2=<x2> e2e_ratio_s2=<y2>
exact=<true|false>``; each ratio is Ray Tune's figure over stagetree's; ``merge_rate`` is S1's. The
figures and every run are kept in ``tests/bench/results/vs_raytune.json`` (``tests.bench.record``).
Target: cpu_s_ratio_s1 >= 0.9 x merge_rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.bench.baseline import installed_bytecode
from tests.bench.raytune_workloads import (
    DATASET,
    SEED,
    TRAINER,
    TUNED,
    TrialWork,
    max_abs_diff,
    merge_rate,
    replay_work,
    s1_work,
    s2_asha_params,
    s2_space,
    trial_steps,
    unique_steps,
)
from tests.bench.record import record

ROOT = Path(__file__).resolve().parents[2]
USERSTYLE = Path(__file__).resolve().parent / "userstyle"  # the user's trainer module (raytune_workloads.TRAINER)
USERSTYLE_PATH = str(USERSTYLE)
INSTALL = 'pip install ".[bench]"   (or: pip install "ray[tune]==2.60.0")'
TOLERANCE = 1e-6
TIMEOUT_S = 1800.0
CLK_TCK = os.sysconf("SC_CLK_TCK")

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# CPU accounting from /proc


STAGETREE_WORKERS = 2


def _stat(pid: int) -> tuple[int, float, float] | None:
    """``(ppid, own cpu s, reaped children's cpu s)`` of a live process, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, (utime + stime) / CLK_TCK, (cutime + cstime) / CLK_TCK


def _tree_cpu(roots: list[int]) -> float:
    """CPU-seconds of ``roots`` and every live descendant, each with its reaped children."""
    table: dict[int, tuple[int, float, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                table[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo, seen = 0.0, [p for p in roots if p in table], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        _, own, reaped = table[pid]
        total += own + reaped
        todo.extend(children.get(pid, []))
    return total


def _live_children(pid: int) -> int:
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[0] == pid:
                n += 1
    return n


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _forkserver_pid() -> int | None:
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # type: ignore[attr-defined]
    return int(pid) if pid else None


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class RunFigures:
    system: str
    workload: str
    e2e_s: float
    cpu_s: float
    cpu_all_s: float
    metrics: dict[int, dict[str, float]]  # trial id -> final metrics
    executed: int | None = None  # stagetree: steps its batches trained
    notes: dict[str, Any] = field(default_factory=dict)
    # seconds slots were held for the work: stagetree's batch attempts from sent to finished, Ray's trials
    # from the trainable's start to its last report (times a slot's GPU share: GPU-seconds)
    slot_s: float = 0.0

    def line(self) -> str:
        extra = "" if self.executed is None else f"  executed steps {self.executed}"
        return (
            f"  {self.workload} {self.system:9s} e2e {self.e2e_s:7.1f} s   cpu_s {self.cpu_s:7.1f}   "
            f"cpu_all {self.cpu_all_s:7.1f}{extra}"
        )


# ---------------------------------------------------------------------------------------------
# stagetree


class StagetreeSide:
    """One embedded cluster (2 CPU workers, or ``slots_per_gpu`` slots of each GPU on a GPU machine)
    reused by every run; each run gets a plan of its own (the fixed value ``bench_run`` differs), so
    nothing is answered from an earlier run's results."""

    def __init__(self, home: Path, fixed: dict[str, Any], *, slots_per_gpu: int = 1, cpu_figures: bool = True) -> None:
        self.home = home
        self.fixed = fixed
        self.slots_per_gpu = slots_per_gpu
        # without CPU figures (the GPU bench) a run waits for no worker to exit: on a GPU slot a spare worker
        # with its CUDA context waits beside the slot's warm one, and neither exits between runs
        self.cpu_figures = cpu_figures
        self.cluster: Any = None
        self.client: Any = None
        self.runs = 0

    async def __aenter__(self) -> StagetreeSide:
        from stagetree.client.sdk import connect
        from stagetree.embedded import Embedded, EmbeddedSettings

        self._embedded = Embedded(
            EmbeddedSettings(
                home=self.home,
                workers=STAGETREE_WORKERS,
                threads_per_worker=1,
                slots_per_gpu=self.slots_per_gpu,
                user_path=(USERSTYLE_PATH, str(ROOT)),
            )
        )
        self.cluster = await self._embedded.__aenter__()
        self._connect = connect(self.cluster.target, token=self.cluster.token)
        self.client = await self._connect.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self._connect.__aexit__(None, None, None)
        if self.cluster is not None:
            await self._embedded.__aexit__(None, None, None)

    async def _study(self, name: str) -> Any:
        from stagetree.client.sdk import Study

        self.runs += 1
        return await Study.create(
            self.client,
            f"{name}-{self.runs}",
            trainer=TRAINER,
            dataset=DATASET,
            model=f"mlp-{self.fixed['hidden']}",
            seed=SEED,
            values={**self.fixed, "bench_run": self.runs},
            tuned=list(TUNED),
        )

    async def _idle(self) -> None:
        """Until every batch has finished and its worker process has exited (its CPU is then counted);
        what is left are the slots' warm workers, waiting for a batch (their CPU is counted live)."""
        store = self.cluster.app.store
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = await asyncio.to_thread(store.rounds.busy_slots)
            if not busy and not self.cpu_figures:
                return
            fs = _forkserver_pid()
            if not busy and (fs is None or _live_children(fs) <= STAGETREE_WORKERS):
                return
            await asyncio.sleep(0.05)
        log.warning("stagetree workers still busy after 60 s; CPU figures may be short")

    def _cpu(self) -> tuple[float, float]:
        fs = _forkserver_pid()
        workers = _tree_cpu([fs]) - (_stat(fs) or (0, 0.0, 0.0))[1] if fs is not None else 0.0
        return workers + _children_cpu(), _self_cpu()

    async def run(self, workload: str, work: list[TrialWork]) -> RunFigures:
        await self._idle()
        store = self.cluster.app.store
        executed0 = await asyncio.to_thread(store.batches.executed_steps)
        workers0, self0 = self._cpu()
        since = time.time()
        t0 = time.perf_counter()
        study = await self._study(workload)

        # The decisions are known (a replay): every eval goes in at once, as every Ray trial is started
        # knowing its last step. (Submitted rung by rung, a rung's request can arrive after the batch
        # that would have shared its prefix has passed the branch point: see asha_live.)
        handles = [(w, s, study.submit(w.config, s)) for w in work for s in w.evals]
        results = await asyncio.wait_for(asyncio.gather(*(h for _, _, h in handles)), TIMEOUT_S)
        e2e = time.perf_counter() - t0
        finals = [m for (w, s, _), m in zip(handles, results, strict=True) if s == w.stop]
        await self._idle()
        workers1, self1 = self._cpu()
        executed = await asyncio.to_thread(store.batches.executed_steps) - executed0
        slot_s = await asyncio.to_thread(attempt_slot_seconds, store, since)
        held_s = await asyncio.to_thread(slot_held_seconds, store, since)
        cpu = workers1 - workers0
        return RunFigures(
            "stagetree",
            workload,
            e2e,
            cpu,
            cpu + (self1 - self0),
            {w.trial_id: m for w, m in zip(work, finals, strict=True)},
            executed=executed,
            slot_s=slot_s,
            notes={"slot_held_s": held_s},
        )

    async def asha_live(self) -> tuple[list[TrialWork], float, int]:
        """S2's ASHA driven live (``stagetree.client.driver.drive``): its work, its wall time and the
        steps stagetree trained for it (more than the unique steps when a promotion's request arrives
        after the batch it could have shared with has passed the branch point)."""
        from stagetree.client.driver import drive
        from stagetree.client.tuners import ASHA

        store = self.cluster.app.store
        executed0 = await asyncio.to_thread(store.batches.executed_steps)
        t0 = time.perf_counter()
        study = await self._study("s2-asha-live")
        run = await asyncio.wait_for(drive(study, ASHA(s2_space(), **s2_asha_params())), TIMEOUT_S)
        wall = time.perf_counter() - t0
        await self._idle()
        executed = await asyncio.to_thread(store.batches.executed_steps) - executed0
        return replay_work(run.submits()), wall, executed


# ---------------------------------------------------------------------------------------------
# Ray Tune


class RaySide:
    """``ray.init(num_cpus=2)`` once; each run is one ``Tuner.fit`` of the function trainable with one
    CPU per trial and ``reuse_actors=True``. With ``gpu_per_trial`` (a GPU machine), Ray also gets the
    machine's GPU and each trial that share of it, and trains on CUDA."""

    def __init__(self, home: Path, fixed: dict[str, Any], *, gpu_per_trial: float = 0.0) -> None:
        self.home = home
        self.fixed = fixed
        self.gpu_per_trial = gpu_per_trial
        self.runs = 0

    def start(self) -> None:
        import ray

        # The actors import the trainable from this checkout (tests.bench.raytune_train).
        # ... and the trainer from the user's module (raytune_workloads.TRAINER)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), USERSTYLE_PATH, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the legacy reporter: silent at verbose=0
        ray.init(
            num_cpus=2,
            num_gpus=1 if self.gpu_per_trial else 0,
            _node_ip_address="127.0.0.1",  # one machine; a host without a route out (the GPU machine) has no other
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
            configure_logging=True,
        )

    def stop(self) -> None:
        import ray

        ray.shutdown()

    def _ray_pids(self) -> list[int]:
        import ray

        node = ray._private.worker._global_node
        pids: list[int] = []
        if node is None:
            return pids
        for infos in node.all_processes.values():
            for info in infos:
                proc = getattr(info, "process", None)
                if proc is not None and proc.pid:
                    pids.append(int(proc.pid))
        return pids

    def run(self, workload: str, work: list[TrialWork], time_budget_s: float | None = None) -> RunFigures:
        """One ``Tuner.fit`` of ``work``. With ``time_budget_s``, Ray stops the experiment after that many
        seconds (``TuneConfig.time_budget_s``): ``notes["complete"]`` counts the trials that reached their
        last step, and the figures are then lower bounds of the whole run's."""
        from ray import tune

        from tests.bench.raytune_train import ray_trainable

        self.runs += 1
        device = "cuda" if self.gpu_per_trial else "cpu"
        params = [
            {
                "trial": w.trial_id,
                "config": w.config_json(),
                "evals": list(w.evals),
                "fixed": self.fixed,
                "seed": SEED,
                "device": device,
            }
            for w in work
        ]
        resources: dict[str, float] = {"cpu": 1}
        if self.gpu_per_trial:
            resources["gpu"] = self.gpu_per_trial
        tuner = tune.Tuner(
            tune.with_resources(ray_trainable, resources),
            param_space={"work": tune.grid_search(params)},
            tune_config=tune.TuneConfig(reuse_actors=True, max_concurrent_trials=2, time_budget_s=time_budget_s),
            run_config=tune.RunConfig(
                name=f"{workload}-{self.runs}", storage_path=str(self.home / "ray_results"), verbose=0
            ),
        )
        ray_pids = self._ray_pids()
        ctrl0, self0, children0 = _tree_cpu(ray_pids), _self_cpu(), _children_cpu()
        t0 = time.perf_counter()
        grid = tuner.fit()
        e2e = time.perf_counter() - t0
        ctrl1, self1, children1 = _tree_cpu(ray_pids), _self_cpu(), _children_cpu()
        finals: dict[int, dict[str, float]] = {}
        spans: dict[int, tuple[float, float]] = {}
        slot_s = 0.0
        errors = []
        stops = {w.trial_id: w.stop for w in work}
        complete = 0
        for r in (grid[i] for i in range(len(grid))):
            if r.error is not None:
                errors.append(str(r.error))
                continue
            m = dict(r.metrics or {})
            if "trial" not in m:  # stopped by the time budget before its first report
                continue
            trial = int(m["trial"])
            if int(m["step"]) == stops[trial]:
                complete += 1
            finals[trial] = {"accuracy": float(m["accuracy"]), "loss": float(m["loss"])}
            pid, start, now = int(m["pid"]), float(m["cpu_start"]), float(m["cpu_now"])
            lo, hi = spans.get(pid, (start, now))
            spans[pid] = (min(lo, start), max(hi, now))
            slot_s += float(m["wall_now"]) - float(m["wall_start"])
        if errors:
            raise RuntimeError(f"{len(errors)} Ray trials failed; first: {errors[0]}")
        actors = sum(hi - lo for lo, hi in spans.values())
        cpu = actors + (children1 - children0)
        # The actors' processes are the raylet's children: their whole lives show in ctrl (when reaped).
        ctrl_all = (ctrl1 - ctrl0) + (self1 - self0) + (children1 - children0)
        return RunFigures(
            "ray-tune",
            workload,
            e2e,
            cpu,
            max(ctrl_all, cpu + (self1 - self0)),
            finals,
            notes={"actors": len(spans), "complete": complete, "trials": len(work)},
            slot_s=slot_s,
        )


# ---------------------------------------------------------------------------------------------
# Straight runs (the reference of the exactness check)


def attempt_slot_seconds(store: Any, since: float) -> float:
    """Seconds slots were held by the batch attempts dispatched at or after ``since`` (unix time): each
    from being sent to its node manager to its end, as the ledger recorded them."""
    from sqlalchemy import select

    from stagetree.master.store import models as m

    a = m.BatchAttempt
    with store.ledger.db.tx("bench slot seconds") as s:
        rows = s.execute(select(a.sent_at, a.dispatched_at, a.finished_at).where(a.dispatched_at >= since)).all()
    return sum(float(end) - float(disp if sent is None else sent) for sent, disp, end in rows if end is not None)


def slot_held_seconds(store: Any, since: float) -> float:
    """Seconds the slots were held for the batch attempts dispatched at or after ``since``: on each slot,
    the union of its attempts' spans (sent to its node manager, or dispatched, to the end). Beside
    ``attempt_slot_seconds``, which adds the spans up, this does not count twice the time a batch sent
    ahead waits while the batch before it still trains on the slot."""
    from sqlalchemy import select

    from stagetree.master.store import models as m

    a = m.BatchAttempt
    with store.ledger.db.tx("bench slot occupancy") as s:
        rows = s.execute(
            select(a.node_manager_id, a.slot_id, a.sent_at, a.dispatched_at, a.finished_at).where(
                a.dispatched_at >= since
            )
        ).all()
    spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for nm, slots, sent, disp, end in rows:
        if end is None:
            continue
        for slot in str(slots).split(","):
            spans.setdefault((nm, slot), []).append((float(disp if sent is None else sent), float(end)))
    return sum(union_seconds(got) for got in spans.values())


def union_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """The length of the union of the ``(start, end)`` spans."""
    held, lo, hi = 0.0, 0.0, -math.inf
    for a0, a1 in sorted(spans):
        if a0 > hi:
            held += max(hi - lo, 0.0)
            lo, hi = a0, a1
        else:
            hi = max(hi, a1)
    return held + max(hi - lo, 0.0)


def straight_finals(work: list[TrialWork], fixed: dict[str, Any], device: str = "cpu") -> dict[int, dict[str, float]]:
    import torch

    from tests.bench.raytune_train import train_straight

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for w in work:
            out[w.trial_id] = train_straight(w.config_json(), w.evals, fixed=fixed, seed=SEED, device=device)[w.stop]
        return out
    finally:
        torch.set_num_threads(threads)


def check_exact(
    name: str, straight: dict[int, dict[str, float]], runs: list[RunFigures], unique: int
) -> tuple[bool, list[str]]:
    ok, lines = True, []
    for r in runs:
        worst = max(max_abs_diff(straight[t], r.metrics.get(t, {})) for t in straight)
        good = worst <= TOLERANCE and set(r.metrics) == set(straight)
        steps_ok = r.executed is None or r.executed == unique
        ok = ok and good and steps_ok
        steps = "" if r.executed is None else f"; executed {r.executed} vs unique {unique} steps"
        lines.append(f"  {name} {r.system:9s}: max |metric - straight| = {worst:.2e}{steps}")
    return ok, lines


# ---------------------------------------------------------------------------------------------
# The bench


def _median(runs: list[RunFigures], attr: str) -> float:
    return float(statistics.median(float(getattr(r, attr)) for r in runs))


def _ratio(ray: list[RunFigures], st: list[RunFigures], attr: str) -> float:
    return _median(ray, attr) / _median(st, attr)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def work_to_json(work: list[TrialWork]) -> list[dict[str, Any]]:
    return [
        {"trial": w.trial_id, "config": {k: v.to_json() for k, v in w.config.items()}, "evals": list(w.evals)}
        for w in work
    ]


def work_from_json(rows: list[dict[str, Any]]) -> list[TrialWork]:
    from stagetree.core.sequences import from_json

    return [
        TrialWork(int(r["trial"]), {k: from_json(v) for k, v in r["config"].items()}, tuple(int(e) for e in r["evals"]))
        for r in rows
    ]


async def child(ns: argparse.Namespace, home: Path) -> int:
    """One system, one workload, in this process (which the parent counts as a whole tree): start the
    system, run the work, write what it measured to ``ns.out``, stop."""
    fixed = {"hidden": ns.hidden, "minibatches": ns.minibatches}
    out: dict[str, Any]
    if ns.child == "ray":
        work = work_from_json(json.loads(Path(ns.work).read_text()))
        ray_side = RaySide(home, fixed)
        with _quiet():
            ray_side.start()
            try:
                fig = ray_side.run(ns.workload, work)
            finally:
                ray_side.stop()
        out = {"e2e_s": fig.e2e_s, "metrics": fig.metrics, "executed": None, "actors": fig.notes.get("actors")}
    else:
        async with StagetreeSide(home / "stagetree", fixed) as st:
            if ns.workload == "asha":
                s2, wall, executed = await st.asha_live()
                out = {"work": work_to_json(s2), "e2e_s": wall, "executed": executed}
            else:
                work = work_from_json(json.loads(Path(ns.work).read_text()))
                fig = await st.run(ns.workload, work)
                out = {"e2e_s": fig.e2e_s, "metrics": fig.metrics, "executed": fig.executed}
    Path(ns.out).write_text(json.dumps(out))
    return 0


def run_child(
    ns: argparse.Namespace, home: Path, system: str, workload: str, work: Path | None
) -> tuple[Any, dict[str, Any]]:
    """``system`` on ``workload`` as its own process tree (``tests.bench.proctree``), start-up included."""
    from tests.bench.proctree import run_counted

    out = home / f"{system}-{workload}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "tests.bench.vs_raytune", "--child", system, "--workload", workload,
           "--out", str(out), "--home", str(home / f"{system}-{workload}"),
           "--hidden", str(ns.hidden), "--minibatches", str(ns.minibatches)]  # fmt: skip
    if work is not None:
        cmd += ["--work", str(work)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(USERSTYLE), env.get("PYTHONPATH")]))
    usage = run_counted(cmd, env=env, cwd=ROOT, timeout_s=TIMEOUT_S, grace_s=30.0)
    if usage.rc != 0:
        raise RuntimeError(f"{system} on {workload} exited {usage.rc}")
    return usage, json.loads(out.read_text())


def figures_of(system: str, workload: str, usage: Any, out: dict[str, Any]) -> RunFigures:
    """A child's run as ``RunFigures``: ``cpu_s`` and ``cpu_all_s`` are its whole tree's CPU, start-up
    included; ``e2e_s`` from its launch to its last process's exit; ``notes['work_s']`` the child's own
    submit-to-last-result time."""
    metrics = {int(t): {str(k): float(v) for k, v in m.items()} for t, m in out["metrics"].items()}
    return RunFigures(
        system, workload, usage.wall_s, usage.cpu_s, usage.cpu_s, metrics, executed=out.get("executed"),
        notes={"work_s": out["e2e_s"], "peak_procs": usage.peak_procs, "names": usage.names},
    )  # fmt: skip


def bench(ns: argparse.Namespace, home: Path) -> int:
    from tests.bench.proctree import summary

    fixed = {"hidden": ns.hidden, "minibatches": ns.minibatches}
    s1 = s1_work()
    if ns.s1_trials:
        s1 = s1[: ns.s1_trials]
    m1 = merge_rate(s1)
    print(f"vs_raytune: digits MLP (hidden {ns.hidden}, {ns.minibatches} minibatches per step), CPU only")
    print(
        f"  S1: {len(s1)} trials x 40 steps, lr branching 2/4/6: {trial_steps(s1)} trial steps, "
        f"{unique_steps(s1)} unique, merge rate {m1:.2f}"
    )
    print(
        "  both systems: 2 workers, torch.set_num_threads(1); Ray Tune with reuse_actors=True, 1 CPU per trial, "
        "ray.init(num_cpus=2); each run its own process tree, counted whole from launch to exit",
        flush=True,
    )
    t_start = time.perf_counter()
    usage, out = run_child(ns, home, "stagetree", "asha", None)
    s2 = work_from_json(out["work"])
    stops = sorted({w.stop for w in s2})
    per_stop = {s: sum(w.stop == s for w in s2) for s in stops}
    print(
        f"  S2: ASHA (eta 4, rungs 4/16/64) live on stagetree: {len(s2)} trials stopped at {per_stop} "
        f"in {out['e2e_s']:.1f} s, trained {out['executed']} steps for {unique_steps(s2)} unique "
        f"(the process: cpu {usage.cpu_s:.1f} s, {usage.wall_s:.1f} s)",
        flush=True,
    )
    if ns.s2_trials:
        s2 = s2[: ns.s2_trials]
    m2 = merge_rate(s2)
    print(f"  S2 replayed: {len(s2)} trials, {trial_steps(s2)} trial steps, {unique_steps(s2)} unique, merge {m2:.2f}")
    files = {}
    for name, work in (("S1", s1), ("S2", s2)):
        files[name] = home / f"work-{name}.json"
        files[name].write_text(json.dumps(work_to_json(work)))
    runs: dict[tuple[str, str], list[RunFigures]] = {}
    for i in range(ns.runs):
        for workload in ("S1", "S2"):
            order = ("stagetree", "ray") if (i % 2 == 0) else ("ray", "stagetree")
            for system in order:
                usage, out = run_child(ns, home, system, workload, files[workload])
                fig = figures_of("ray-tune" if system == "ray" else "stagetree", workload, usage, out)
                runs.setdefault((workload, fig.system), []).append(fig)
                print(
                    f"{fig.line()}  work {out['e2e_s']:.1f} s  procs {usage.peak_procs} at once "
                    f"({summary(usage.names)})   (run {i + 1})",
                    flush=True,
                )

    print("straight runs (the reference) ...", flush=True)
    t0 = time.perf_counter()
    ref1 = straight_finals(s1, fixed)
    ref2 = straight_finals(s2, fixed)
    print(f"  {len(ref1) + len(ref2)} trials in {time.perf_counter() - t0:.1f} s")
    ok1, lines1 = check_exact("S1", ref1, runs[("S1", "stagetree")] + runs[("S1", "ray-tune")], unique_steps(s1))
    ok2, lines2 = check_exact("S2", ref2, runs[("S2", "stagetree")] + runs[("S2", "ray-tune")], unique_steps(s2))
    for line in lines1 + lines2:
        print(line)
    exact = ok1 and ok2

    print("medians (Ray Tune / stagetree), whole process trees from launch to exit:")
    ratios = {}
    for workload in ("S1", "S2"):
        st_runs, ray_runs = runs[(workload, "stagetree")], runs[(workload, "ray-tune")]
        for attr, label in (("e2e_s", "e2e"), ("cpu_s", "cpu_s")):
            a, b = _median(ray_runs, attr), _median(st_runs, attr)
            ratios[(workload, label)] = a / b
            print(f"  {workload} {label:8s} ray {a:8.1f}   stagetree {b:8.1f}   ratio {a / b:5.2f}")
    print(f"  total bench time {time.perf_counter() - t_start:.0f} s")
    line = (
        f"merge_rate={m1:.2f} cpu_s_ratio_s1={ratios[('S1', 'cpu_s')]:.2f} e2e_ratio_s1={ratios[('S1', 'e2e')]:.2f} "
        f"cpu_s_ratio_s2={ratios[('S2', 'cpu_s')]:.2f} e2e_ratio_s2={ratios[('S2', 'e2e')]:.2f} "
        f"exact={'true' if exact else 'false'}"
    )
    details = {
        "merge_rate_s2": round(m2, 4),
        "runs": [
            {"workload": w, "system": f.system, "e2e_s": f.e2e_s, "cpu_s": f.cpu_s, "executed": f.executed} | f.notes
            for (w, _), figs in runs.items()
            for f in figs
        ],
    }
    print(record("vs_raytune", line, extra=details))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.bench.vs_raytune", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="timed runs per system and workload (median)")
    p.add_argument("--hidden", type=int, default=256, help="the MLP's hidden width")
    p.add_argument("--minibatches", type=int, default=200, help="minibatches per training step")
    p.add_argument("--s1-trials", type=int, default=0, help="only the first N S1 trials (a quick try)")
    p.add_argument("--s2-trials", type=int, default=0, help="only the first N S2 trials (a quick try)")
    p.add_argument("--home", type=Path, default=None, help="work directory (default: a temporary one)")
    p.add_argument("--child", choices=("stagetree", "ray"), help=argparse.SUPPRESS)  # one side, in this process
    p.add_argument("--workload", choices=("S1", "S2", "asha"), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument(
        "--nm-bus-max-age",
        type=float,
        default=None,
        help="stagetree node manager's STAGETREE_NM_BUS__BATCH_MAX_AGE_S (default: the platform's, 0.5 s): how "
        "long its batcher may hold worker events before publishing them",
    )
    return p


def main(argv: list[str] | None = None, *, runner: Callable[..., Any] = asyncio.run) -> int:
    ns = _parser().parse_args(argv)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # Ray forks while gRPC runs here: one info line a fork
    if ns.nm_bus_max_age is not None:
        os.environ["STAGETREE_NM_BUS__BATCH_MAX_AGE_S"] = str(ns.nm_bus_max_age)
    try:
        import ray  # noqa: F401
        from ray import tune  # noqa: F401
    except ImportError as e:
        print(f"vs_raytune needs Ray Tune ({e}); install it with:\n  {INSTALL}", file=sys.stderr)
        return 2
    if ns.runs < 1:
        print("--runs must be at least 1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    home = ns.home or Path(tempfile.mkdtemp(prefix="vs-raytune-"))
    if ns.home is not None and home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True, exist_ok=True)
    try:
        if ns.child:
            return int(runner(child(ns, home.resolve())))
        if USERSTYLE_PATH not in sys.path:
            sys.path.insert(0, USERSTYLE_PATH)  # the straight runs import the user's module
        installed_bytecode()  # as a pip install of stagetree has it (Ray's has its own from pip)
        return bench(ns, home.resolve())
    finally:
        if ns.home is None:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
