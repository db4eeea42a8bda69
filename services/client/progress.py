"""What a run shows the person who watches it: ``drive``'s progress line and its failures.

This module owns ``LiveProgress``, a view of a driven tuner: a ``tqdm`` bar of finished trials (of the planned
number when the tuner knows it) with the trials running, done, pruned and failed, the best value so far
and the steps the study executed against what trial-by-trial training would run; each failed trial printed
once, with the last lines of its error (the trainer's traceback) and the worker's log path; and the one
line a run ends with when Ctrl-C stopped it. ``watching(stream)`` says whether a person watches: a
terminal, or a Jupyter notebook (where ``tqdm.auto`` draws a widget when ipywidgets is installed).

The view only reads the tuner's records (``Tuner.trials``) and the study's stats; it changes nothing.
"""

from __future__ import annotations

import logging
import shutil
import sys
from collections import Counter
from typing import IO, Any

from stagetree.client.tuners.base import Tuner
from stagetree.core.seqforms import config_text

log = logging.getLogger(__name__)

ERROR_LINES = 6  # lines of a failed trial's error shown (a traceback's end says the most)
LOG_NOTE = "worker log:"  # how the node manager names the log of a failed batch (nodemanager.agent)


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (IPython's ZMQ shell)."""
    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    ip = get() if callable(get) else None
    return type(ip).__name__ == "ZMQInteractiveShell"


def watching(stream: IO[str] | None = None) -> bool:
    """Whether a person watches ``stream`` (stderr by default): a terminal or a notebook."""
    s = sys.stderr if stream is None else stream
    try:
        tty = bool(s.isatty())
    except (AttributeError, ValueError):
        tty = False
    return tty or in_notebook()


def planned_trials(tuner: Tuner) -> int | None:
    """How many trials the tuner will draw, when it says (``max_trials``, ``n_trials``)."""
    for name in ("max_trials", "n_trials"):
        n = getattr(tuner, name, None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    return None


def error_tail(error: str, lines: int = ERROR_LINES) -> list[str]:
    """The last ``lines`` lines of an error, the worker-log note kept last when the error names one."""
    rows = [ln.rstrip() for ln in error.strip().splitlines() if ln.strip()]
    notes = [ln for ln in rows if ln.lstrip().startswith(LOG_NOTE)]
    body = [ln for ln in rows if ln not in notes]
    return [*body[-lines:], *notes[-1:]]


def _size() -> dict[str, int]:
    """The terminal's size for tqdm, which draws nothing on one that reports 0 rows (a bare pty)."""
    size = shutil.get_terminal_size((120, 24))
    return {"ncols": size.columns, "nrows": size.lines}


class LiveProgress:
    """A live view of ``tuner`` driving ``study`` (see the module doc); ``enabled=False`` draws nothing but
    still reports each failed trial once, through ``logging``."""

    def __init__(self, study_name: str, tuner: Tuner, *, enabled: bool, stream: IO[str] | None = None) -> None:
        self.study_name = study_name
        self.tuner = tuner
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.reported: set[int] = set()  # trials whose failure was shown
        self.steps: tuple[int, int] | None = None  # (executed, trial by trial) from the study's stats
        self._bar: Any = None
        if enabled:
            if in_notebook():
                from tqdm.auto import tqdm
            else:
                from tqdm import tqdm
            self._bar = tqdm(
                total=planned_trials(tuner),
                desc=f"{study_name}: trials",
                unit="trial",
                file=self.stream,
                leave=True,
                **({} if in_notebook() else _size()),
            )

    def counts(self) -> Counter[str]:
        """Trials by what they are doing: running, done, pruned (stopped, or paused when the tuner
        finished), failed, paused (waiting for a promotion)."""
        out: Counter[str] = Counter()
        for t in self.tuner.trials.values():
            status: str = t.status
            if status == "stopped" or (status == "paused" and self.tuner.finished):
                status = "pruned"
            out[status] += 1
        return out

    def line(self) -> str:
        """The progress line's text after the bar: ``running 2 · done 1 · pruned 3 · failed 1 · best
        accuracy 0.970 (trial 3 @ 40) · steps 67 vs 80 trial by trial``."""
        c = self.counts()
        parts = [f"{k} {c[k]}" for k in ("running", "paused", "done", "pruned", "failed") if c[k]]
        best = self.tuner.best()
        if best is not None:
            parts.append(f"best {self.tuner.metric} {best.value:.4g} (trial {best.trial_id} @ {best.step})")
        if self.steps is not None:
            parts.append(f"steps {self.steps[0]} vs {self.steps[1]} trial by trial")
        return " · ".join(parts)

    def update(self) -> None:
        """Redraw after an event (and report any trial that failed since the last one)."""
        for t in self.tuner.trials.values():
            if t.status == "failed" and t.trial_id not in self.reported:
                self.failed(t.trial_id, t.error or "")
        if self._bar is None:
            return
        c = self.counts()
        self._bar.n = c["done"] + c["pruned"] + c["failed"]
        self._bar.set_postfix_str(self.line(), refresh=False)
        self._bar.refresh()

    def set_steps(self, executed: int, trial_by_trial: int) -> None:
        self.steps = (executed, trial_by_trial)
        if self._bar is not None:
            self._bar.set_postfix_str(self.line())

    def failed(self, trial_id: int, error: str) -> None:
        """Show one failed trial, once: its config, the last lines of its error and its log path."""
        if trial_id in self.reported:
            return
        self.reported.add(trial_id)
        trial = self.tuner.trials.get(trial_id)
        config = config_text(trial.config) if trial is not None else ""
        head = f"trial {trial_id} failed" + (f" ({config})" if config else "")
        tail = error_tail(error)
        if not self.enabled:
            log.warning("%s: %s", head, "\n".join(tail), extra={"trial_id": trial_id})
            return
        self.write("\n".join([f"✗ {head}:", *(f"    {ln}" for ln in tail)]))

    def write(self, text: str, *, always: bool = False) -> None:
        """A message above the bar (the bar is redrawn under it); without a bar, printed only when the view
        is enabled or ``always`` (what a person asked for, such as the answer to Ctrl-C)."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        elif self.enabled or always:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self.update()
            self._bar.close()
            self._bar = None
