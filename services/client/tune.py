"""The common path in one call: ``stagetree.tune(Trainer, space, "asha", ...)``, in a script or a notebook.

This module owns ``tune`` and ``TuneResult``. ``tune`` starts an embedded cluster (``stagetree.embedded``),
creates (or loads, ``load_if_exists``) a study of the trainer, drives the tuner with progress where a person
watches, and returns the best trial (``Study.best``: of the trials that reached the last step) with every
trial as a row (``TuneResult.trials``, a pandas DataFrame). It is synchronous: in a script it runs its own
event loop; where a loop already runs in this thread (a Jupyter cell) it runs in a thread of its own.
Ctrl-C (in a notebook: interrupt the kernel) stops the run cleanly and returns what finished.

The trainer is an entry point ``"module:Class"`` or the class itself. The workers import it in processes of
their own, so a class defined in the running script is named by the script's file (``quickstart:Net`` for
``quickstart.py``, which needs its ``if __name__ == "__main__":`` guard), and one defined in a notebook
cell cannot be imported at all: that is an error that says to move it to a file.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from stagetree.client.progress import in_notebook
from stagetree.client.sdk import EvalResult
from stagetree.client.spaces import SearchSpace
from stagetree.client.tuners.base import Tuner
from stagetree.client.tuners.registry import make_tuner
from stagetree.core.entrypoints import check_entry_point
from stagetree.core.errors import InvalidArgument
from stagetree.core.seqforms import to_text
from stagetree.core.sharing import SharingStats

T = TypeVar("T")
_MAIN_GUARD = re.compile(r"""^if\s+__name__\s*==\s*["']__main__["']\s*:""", re.M)


@dataclass
class TuneResult:
    """What ``tune`` found: the ``best`` eval (None when no trial finished), one row per trial in
    ``rows`` (``trials`` gives them as a pandas DataFrame), the study's sharing ``stats``, and whether
    Ctrl-C stopped the run early (``interrupted``)."""

    study: str
    best: EvalResult | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    stats: SharingStats | None = None
    interrupted: bool = False

    @property
    def trials(self) -> Any:
        """Every trial as a row of a pandas DataFrame: ``trial``, ``status`` (done, pruned, failed, ...),
        ``step`` (its last), each hyper-parameter in the printed form, each metric at that step, ``error``."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError(
                "TuneResult.trials needs pandas: pip install pandas (or 'stagetree[embedded]'); "
                "TuneResult.rows has the same rows as dicts"
            ) from None
        return pd.DataFrame(self.rows).set_index("trial") if self.rows else pd.DataFrame()


def entry_point_of(trainer: Any) -> str:
    """The entry point ``"module:Class"`` of a trainer class (or the checked string itself)."""
    if isinstance(trainer, str):
        return check_entry_point(trainer, "trainer")
    if not isinstance(trainer, type):
        raise InvalidArgument(f"trainer: must be a Trainer class or its entry point 'module:Class', got {trainer!r}")
    qual = trainer.__qualname__
    if "<locals>" in qual:
        raise InvalidArgument(
            f"trainer: {qual} is defined inside a function; the workers import it by name, so define it at the "
            "top level of a module"
        )
    module = trainer.__module__
    if module != "__main__":
        return check_entry_point(f"{module}:{qual}", "trainer")
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is None or in_notebook():
        raise InvalidArgument(
            f"trainer: {qual} is defined in this notebook (or an interactive session); the workers run in "
            "processes of their own and import the trainer from a file. Put the class, with its imports, in a "
            f"file next to the notebook (for instance in a cell starting with %%writefile mytrainer.py), then "
            f"`from mytrainer import {qual}` and pass that class, or pass 'mytrainer:{qual}'"
        )
    path = Path(main_file)
    if not path.stem.isidentifier():
        raise InvalidArgument(
            f"trainer: {qual} is defined in {path.name}, which the workers cannot import by name; rename the "
            "script to a valid module name (letters, digits, underscores)"
        )
    if not _MAIN_GUARD.search(path.read_text(errors="replace")):
        raise InvalidArgument(
            f"trainer: the workers import {path.name} to find {qual}; put the code that runs the study under "
            'if __name__ == "__main__": so that importing the script does not run it again'
        )
    return check_entry_point(f"{path.stem}:{qual}", "trainer")


def _space_of(tuner: Tuner) -> Any:
    space = getattr(tuner, "space", None)
    source = getattr(tuner, "source", None)
    return space if space is not None else getattr(source, "space", None)


def _rows(tuner: Tuner) -> list[dict[str, Any]]:
    rows = []
    for t in tuner.trials.values():
        status: str = t.status
        if status == "stopped" or (status == "paused" and tuner.finished):
            status = "pruned"
        last = t.last_step()
        row: dict[str, Any] = {"trial": t.trial_id, "status": status, "step": last}
        row.update({name: to_text(seq) for name, seq in sorted(t.config.items())})
        row.update(t.results.get(last, {}) if last is not None else {})
        row["error"] = t.error or ""
        rows.append(row)
    return rows


async def _tune(
    entry_point: str,
    tuner: Tuner,
    tuned: list[str],
    stop: asyncio.Event | None,
    *,
    name: str,
    home: str | os.PathLike[str],
    workers: int,
    progress: bool | None,
    study_options: Mapping[str, Any],
) -> TuneResult:
    from stagetree.client.driver import drive
    from stagetree.client.sdk import Study, connect
    from stagetree.embedded import Embedded, EmbeddedSettings

    settings = EmbeddedSettings(home=Path(home), workers=workers, progress=progress)
    async with Embedded(settings) as cluster, connect(cluster.target, token=cluster.token) as client:
        study = await Study.create(client, name, trainer=entry_point, tuned=tuned, load_if_exists=True, **study_options)
        run = await drive(study, tuner, progress=progress, stop=stop)
        best = await study.best(tuner.metric, tuner.mode)
        stats = await study.stats()
    return TuneResult(study.name, best, _rows(tuner), stats, run.interrupted)


def tune(
    trainer: type | str,
    space: SearchSpace | None = None,
    tuner: Tuner | str = "asha",
    *,
    metric: str | None = None,
    mode: str = "max",
    name: str | None = None,
    home: str | os.PathLike[str] = ".stagetree",
    workers: int = 2,
    progress: bool | None = None,
    code: Iterable[str | os.PathLike[str]] = (),
    code_version: str | None = None,
    values: Mapping[str, Any] | None = None,
    dataset: str = "",
    model: str = "",
    seed: int = 0,
    **tuner_options: Any,
) -> TuneResult:
    """Tune ``trainer`` over ``space`` with ``tuner`` on an embedded cluster here; see the module doc.

    ``tuner`` is a tuner (``ASHA(space, metric=..., ...)``; then ``space`` may be left out) or a tuner's
    name (``"grid"``, ``"random"``, ``"sha"``, ``"asha"``, ``"hyperband"``, ``"median"``, ``"pbt"``) built
    with ``space``, ``metric``, ``mode`` and ``tuner_options`` (``max_step=40, max_concurrent=4, ...``).
    The study is named ``name`` (default: the entry point) and loaded when it exists, so running the same
    call again answers what finished from the search plan; an edit of the trainer's file trains on a new
    plan (``docs/studies.md``). ``home`` holds the database, checkpoints and worker logs; ``workers`` CPU
    worker slots when there is no GPU; ``progress`` as ``drive``'s; ``code``, ``code_version``, ``values``,
    ``dataset``, ``model`` and ``seed`` as ``Study.create``'s."""
    entry_point = entry_point_of(trainer)
    if isinstance(tuner, str):
        if metric is None:
            raise InvalidArgument(f"metric: name the metric to optimize, e.g. tune(..., {tuner!r}, metric='acc')")
        if space is None:
            raise InvalidArgument(f"space: the {tuner!r} tuner needs a search space")
        tuner = make_tuner(tuner, space, metric=metric, mode=mode, **tuner_options)
    elif not isinstance(tuner, Tuner):
        raise InvalidArgument(f"tuner: must be a tuner or a tuner's name, got {tuner!r}")
    elif tuner_options or metric is not None:
        raise InvalidArgument("tune: metric and tuner options go to the tuner you built, not to tune()")
    names = getattr(space if space is not None else _space_of(tuner), "names", None)
    if not names:
        raise InvalidArgument("space: need a GridSearchSpace or RandomSearchSpace naming the tuned hyper-parameters")
    options: dict[str, Any] = {"code": tuple(code), "code_version": code_version, "values": values}
    options |= {"dataset": dataset, "model": model, "seed": seed}
    t = tuner

    def run(stop: asyncio.Event | None) -> Coroutine[Any, Any, TuneResult]:
        return _tune(
            entry_point,
            t,
            list(names),
            stop,
            name=name or entry_point,
            home=home,
            workers=workers,
            progress=progress,
            study_options=options,
        )

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run(None))
    return _in_own_thread(run)  # a loop runs here already (a notebook cell): ours gets a thread


def _in_own_thread(make: Callable[[asyncio.Event], Coroutine[Any, Any, T]]) -> T:
    """Run ``make(stop)`` on an event loop in a thread of its own; a KeyboardInterrupt here (a notebook's
    interrupt) sets ``stop`` and waits for the run to end as Ctrl-C would end it."""
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> T:
        box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
        started.set()
        return await make(box["stop"])

    with ThreadPoolExecutor(1, thread_name_prefix="stagetree-tune") as pool:
        future = pool.submit(asyncio.run, main())
        while True:
            try:
                return future.result()
            except KeyboardInterrupt:
                if started.wait(5):
                    box["loop"].call_soon_threadsafe(box["stop"].set)
