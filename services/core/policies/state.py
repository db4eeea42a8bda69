"""The live policy step's soft state across rounds, and its per-study snapshot.

``PolicyState`` is what the scheduling round's policies (``stagetree.core.round``) learn between
rounds: Hermes' per-job quanta and the start of each running batch's current quantum, the preemptions
in flight, POP's per-study policy objects and per trial what was fed to them and when it was last
suspended, the killed trials, and the decisions taken but not yet known to be carried out
(``pending_*``). A round takes it in its input and returns the next one (``clone``: the input's is never
changed). Every entry belongs to one study (the study whose work it serves, as last seen);
``snapshot(study)`` gives that study's entries as plain JSON data and ``restore(study, data, search)``
puts them back, so that a new leader decides from then on as the old one would have. Format (version 1;
``suspended_at`` and ``devices`` may be absent)::

    {"version": 1,
     "hermes": {"jobs": {job: TimeShareJob.snapshot()}, "devices": {job: device},
                "quantum_start": {batch: t}, "preempting": [batch]},
     "search": {"started": t, "policy": SearchPolicy.snapshot()} | null,
     "trials": {job: {"fed_at": t, "reports": [first t, last t, count], "epochs": n}},
     "suspended_at": {job: t},
     "killed": [job],
     "pending": {"preempts": [batch], "kills": [{"job", "reason"}]}}

A job is a ``JobKey`` as text (``"plan:node:step"``, the end point of its batches), a batch a batch id
(a string key in JSON); non-finite floats are strings (``plain``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from stagetree.core.errors import InvalidArgument
from stagetree.core.ids import JobKey
from stagetree.core.policies import hermes, pop
from stagetree.core.policies.plain import dec, enc

VERSION = 1


@dataclass(frozen=True)
class Kill:
    """A trial a study's search policy killed: the study's live requests at the trial's end point (its
    ``job``) are cancelled, and ``reason`` says why."""

    study: str
    job: JobKey
    reason: str

    @property
    def node(self) -> int:
        return self.job.node

    @property
    def step(self) -> int:
        return self.job.step


@dataclass
class PolicyState:
    jobs: dict[str, hermes.TimeShareJob] = field(default_factory=dict)  # Hermes: per job, its quanta
    device: dict[str, str] = field(default_factory=dict)  # Hermes: the device a job is placed on (Alg. 1-2)
    quantum_start: dict[int, float] = field(default_factory=dict)  # running batch -> its current quantum's start
    preempting: set[int] = field(default_factory=set)  # batches asked to yield, still running
    search: dict[str, pop.SearchPolicy] = field(default_factory=dict)  # study -> its search policy
    search_start: dict[str, float] = field(default_factory=dict)  # study -> its first round
    fed_at: dict[str, float] = field(default_factory=dict)  # trial -> when its last report fed was recorded
    reports: dict[str, tuple[float, float, int]] = field(default_factory=dict)  # trial -> first, last time, count
    epochs: dict[str, int] = field(default_factory=dict)  # trial -> reports fed (POP epochs)
    killed: set[str] = field(default_factory=set)
    suspended_at: dict[str, float] = field(default_factory=dict)  # trial -> when its search policy suspended it
    pending_preempts: set[int] = field(default_factory=set)  # decided; not yet known to be sent
    pending_kills: dict[str, Kill] = field(default_factory=dict)  # trial -> kill decided; not yet known done
    job_study: dict[str, str] = field(default_factory=dict)
    batch_study: dict[int, str] = field(default_factory=dict)

    def clone(self) -> PolicyState:
        """A copy that shares nothing mutable with this one (a round changes its copy only)."""
        return PolicyState(
            jobs={j: t.copy() for j, t in self.jobs.items()},
            device=dict(self.device),
            quantum_start=dict(self.quantum_start),
            preempting=set(self.preempting),
            search=copy.deepcopy(self.search),
            search_start=dict(self.search_start),
            fed_at=dict(self.fed_at),
            reports=dict(self.reports),
            epochs=dict(self.epochs),
            killed=set(self.killed),
            suspended_at=dict(self.suspended_at),
            pending_preempts=set(self.pending_preempts),
            pending_kills=dict(self.pending_kills),
            job_study=dict(self.job_study),
            batch_study=dict(self.batch_study),
        )

    def empty(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))

    def own_job(self, job: str, study: str) -> None:
        self.job_study[job] = study

    def own_batch(self, batch: int, study: str) -> None:
        self.batch_study[batch] = study

    def epoch_s(self, job: str) -> float:
        """A trial's mean seconds between reports (1 until two reports came at different times)."""
        first, last, n = self.reports.get(job, (0.0, 0.0, 0))
        return (last - first) / (n - 1) if n > 1 and last > first else 1.0

    def add_reports(self, job: str, times: list[float]) -> None:
        if not times:
            return
        first, _, n = self.reports.get(job, (times[0], times[0], 0))
        self.reports[job] = (first, times[-1], n + len(times))

    def forget_jobs(self, live: set[str]) -> None:
        """Drop the Hermes jobs whose work is no longer in the stage tree or running."""
        for j in [j for j in self.jobs if j not in live]:
            del self.jobs[j]
        for j in [j for j in self.device if j not in live]:
            del self.device[j]
        for j in [j for j in self.suspended_at if j not in live]:
            del self.suspended_at[j]
        keep = {
            *self.jobs,
            *self.fed_at,
            *self.reports,
            *self.epochs,
            *self.killed,
            *self.pending_kills,
            *self.suspended_at,
        }
        for j in [j for j in self.job_study if j not in keep]:
            del self.job_study[j]

    def forget_batches(self, alive: set[int]) -> None:
        """Drop what is kept about batches that no longer run (a pending preempt stays until sent)."""
        self.preempting &= alive
        for b in [b for b in self.quantum_start if b not in alive]:
            del self.quantum_start[b]
        keep = alive | self.pending_preempts
        for b in [b for b in self.batch_study if b not in keep]:
            del self.batch_study[b]

    def studies(self) -> set[str]:
        """The studies that own some entry."""
        return {*self.job_study.values(), *self.batch_study.values(), *self.search}

    def snapshot(self, study: str) -> dict[str, Any]:
        """The study's entries as plain JSON data (see the module docstring)."""
        jobs = {j for j, s in self.job_study.items() if s == study}
        batches = {b for b, s in self.batch_study.items() if s == study}
        sp = self.search.get(study)
        return {
            "version": VERSION,
            "hermes": {
                "jobs": {j: t.snapshot() for j, t in self.jobs.items() if j in jobs},
                "devices": {j: d for j, d in sorted(self.device.items()) if j in jobs},
                "quantum_start": {str(b): enc(t) for b, t in sorted(self.quantum_start.items()) if b in batches},
                "preempting": sorted(b for b in self.preempting if b in batches),
            },
            "search": None if sp is None else {"started": enc(self.search_start[study]), "policy": sp.snapshot()},
            "trials": {
                j: {"fed_at": enc(t), "reports": _span(self.reports.get(j)), "epochs": self.epochs.get(j, 0)}
                for j, t in self.fed_at.items()
                if j in jobs
            },
            "suspended_at": {j: enc(t) for j, t in sorted(self.suspended_at.items()) if j in jobs},
            "killed": sorted(j for j in self.killed if j in jobs),
            "pending": {
                "preempts": sorted(b for b in self.pending_preempts if b in batches),
                "kills": [{"job": j, "reason": k.reason} for j, k in sorted(self.pending_kills.items()) if j in jobs],
            },
        }

    def restore(self, study: str, data: Mapping[str, Any], search: pop.SearchPolicy | None) -> None:
        """Put back a ``snapshot(study)``; ``search`` is a fresh search policy of the study's config (None:
        the study has none), which takes over what the snapshot's one learnt. Entries already here win (a
        job two studies share is restored once). ``InvalidArgument`` when ``data`` is not a snapshot this
        version reads; nothing is changed then."""
        try:
            part = _of_snapshot(study, data, search)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, InvalidArgument) as e:
            raise InvalidArgument(f"policy state of study {study}: unreadable snapshot ({e!r})") from None
        for j, tsj in part.jobs.items():
            self.jobs.setdefault(j, tsj)
        for j, d in part.device.items():
            self.device.setdefault(j, d)
        for b, t in part.quantum_start.items():
            self.quantum_start.setdefault(b, t)
        self.preempting |= part.preempting
        for sid, sp in part.search.items():
            if sid not in self.search:
                self.search[sid], self.search_start[sid] = sp, part.search_start[sid]
        for j, t in part.fed_at.items():
            if j not in self.fed_at:
                self.fed_at[j], self.epochs[j] = t, part.epochs[j]
                if j in part.reports:
                    self.reports[j] = part.reports[j]
        for j, t in part.suspended_at.items():
            self.suspended_at.setdefault(j, t)
        self.killed |= part.killed
        self.pending_preempts |= part.pending_preempts
        for j, k in part.pending_kills.items():
            self.pending_kills.setdefault(j, k)
        for j, sid in part.job_study.items():
            self.job_study.setdefault(j, sid)
        for b, sid in part.batch_study.items():
            self.batch_study.setdefault(b, sid)


def _span(span: tuple[float, float, int] | None) -> list[float | str | int] | None:
    return None if span is None else [enc(span[0]), enc(span[1]), span[2]]


def _of_snapshot(study: str, data: Mapping[str, Any], search: pop.SearchPolicy | None) -> PolicyState:
    """One study's state from its snapshot."""
    if data.get("version") != VERSION:
        raise ValueError(f"version {data.get('version')!r}; this master reads version {VERSION}")
    out = PolicyState()
    h = data["hermes"]
    out.jobs = {str(j): hermes.TimeShareJob.restore(str(j), d) for j, d in h["jobs"].items()}
    out.device = {str(j): str(d) for j, d in h.get("devices", {}).items()}
    out.quantum_start = {int(b): dec(t) for b, t in h["quantum_start"].items()}
    out.preempting = {int(b) for b in h["preempting"]}
    if search is not None and data["search"] is not None:
        search.restore(data["search"]["policy"])
        out.search[study], out.search_start[study] = search, dec(data["search"]["started"])
    for j, d in data["trials"].items():
        out.fed_at[j], out.epochs[j] = dec(d["fed_at"]), int(d["epochs"])
        if d["reports"] is not None:
            first, last, n = d["reports"]
            out.reports[j] = (dec(first), dec(last), int(n))
    out.suspended_at = {str(j): dec(t) for j, t in data.get("suspended_at", {}).items()}
    out.killed = {str(j) for j in data["killed"]}
    out.pending_preempts = {int(b) for b in data["pending"]["preempts"]}
    out.pending_kills = {
        str(k["job"]): Kill(study, JobKey.parse(str(k["job"])), str(k["reason"])) for k in data["pending"]["kills"]
    }
    for j in {*out.jobs, *out.device, *out.fed_at, *out.killed, *out.pending_kills, *out.suspended_at}:
        out.job_study[j] = study
    for b in {*out.quantum_start, *out.preempting, *out.pending_preempts}:
        out.batch_study[b] = study
    return out
