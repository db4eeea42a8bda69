"""A study's trials as the platform stored them: what the exporters and tracker callbacks read.

This module owns ``TrialRecord`` and ``study_trials(study)``: every request of the study from the master
(``ListRequests``), grouped into trials by the label the driver gives them (``trial-<id>``; an unlabelled
request is a trial of its own). Metrics come from the store, so nothing is trained again to log or export
them. A trial's configuration is the one its tuner gave (``configs``, e.g. ``tuner_configs(tuner)``) when
known; otherwise the search plan's node at its last evaluated step, which is exact only up to that step
(the plan keeps a configuration from where trials diverge, not what a stopped trial would have done next).
With ``curves=True`` each trial also carries its learning curve (the step metrics its trainer's ``train()``
returned, as the master sampled them: ``Study.curve`` of its furthest finished request).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stagetree.client.sdk import EvalResult, Study
from stagetree.core.config import Config
from stagetree.core.errors import InvalidArgument
from stagetree.core.seqforms import family_of, to_text
from stagetree.core.sequences import Constant, Sequence
from stagetree.proto.stagetree.v1 import master_pb2 as pb


@dataclass
class TrialRecord:
    """One trial: its label, its configuration (None when the plan could not be read) and the metrics of
    every finished evaluation, by step; ``failed`` holds the errors of its failed evaluations. Labels repeat
    across code versions (each run of a tuner counts from trial 0): a trial is one label of one version."""

    label: str
    config: dict[str, Sequence] | None
    points: dict[int, dict[str, float]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    curve: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # step metrics, when asked for
    last_request: int | None = None  # the finished request at its furthest step
    code_version: str = ""  # the trainer code that trained it

    def last_step(self) -> int | None:
        return max(self.points) if self.points else None

    def value(self, metric: str) -> float | None:
        """``metric`` at the last evaluated step that has it."""
        for s in sorted(self.points, reverse=True):
            v = self.points[s].get(metric)
            if v is not None and not math.isnan(v):
                return v
        return None

    def flat_config(self) -> dict[str, Any]:
        """The configuration as plain loggable values: a constant as its value, a schedule as its printed
        form (``core.seqforms``, the same text the SDK, the CLI and REST show)."""
        out: dict[str, Any] = {}
        for name, seq in sorted((self.config or {}).items()):
            family = family_of(seq)
            out[name] = family.value(0) if isinstance(family, Constant) else to_text(family)
        return out


def group_results(results: Iterable[EvalResult], configs: Mapping[int, dict[str, Sequence]]) -> list[TrialRecord]:
    """Requests grouped into trials by label, in the order each trial first appears; ``configs`` maps a
    plan node to its configuration."""
    trials: dict[str, TrialRecord] = {}
    for r in sorted(results, key=lambda r: r.request_id):
        label = r.label or f"request-{r.request_id}"
        rec = trials.get(f"{r.code_version}/{label}")
        if rec is None:
            rec = trials[f"{r.code_version}/{label}"] = TrialRecord(
                label, r.config or configs.get(r.node), code_version=r.code_version
            )
        if r.state == "DONE" and (not rec.points or r.step >= max(rec.points)):
            rec.config = r.config or configs.get(r.node) or rec.config  # the deepest node knows the most
            rec.last_request = r.request_id
        if r.state == "DONE":
            rec.points[r.step] = dict(r.metrics)
        elif r.state == "FAILED":
            rec.failed.append(r.error)
    for rec in trials.values():
        rec.points = dict(sorted(rec.points.items()))
    return list(trials.values())


def tuner_configs(tuner: Any) -> dict[str, dict[str, Sequence]]:
    """Trial label -> configuration, from a tuner's ``trials`` (labels as the driver writes them)."""
    return {f"trial-{t.trial_id}": dict(t.config) for t in tuner.trials.values()}


async def study_trials(
    study: Study, configs: Mapping[str, dict[str, Sequence]] | None = None, *, curves: bool = False
) -> list[TrialRecord]:
    """Every trial of ``study`` with its stored metrics (see the module doc for ``configs`` and ``curves``)."""
    resp = await study.client.call("ListRequests", pb.ListRequestsRequest(study_id=study.id), idempotent=True)
    results = [
        EvalResult(
            r.request_id,
            r.client_request_id,
            str(pb.RequestState.Name(r.state)),
            r.step,
            r.node,
            dict(r.metrics),
            None,
            r.error,
            r.label,
            r.code_version,
            r.plan_key,
        )
        for r in resp.results
    ]
    nodes: dict[int, dict[str, Sequence]] = {}
    for key in sorted({r.plan_key for r in results}):  # each code version's plan (node ids are unique)
        try:
            plan = await study.plan(key)
        except InvalidArgument:  # a master that does not name plans: configs come from the tuner's
            continue
        for n in plan["nodes"]:
            cfg = Config.from_json(n["segments"])
            nodes[int(n["id"])] = {name: cfg.sequence(name) for name in cfg.names()}
    out = group_results(results, nodes)
    for rec in out:
        if configs and rec.label in configs and rec.code_version == study.code_version:
            rec.config = dict(configs[rec.label])
        if curves and rec.last_request is not None:
            rec.curve = await study.curve(rec.last_request)
    return out
