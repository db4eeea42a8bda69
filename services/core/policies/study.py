"""What a study chooses from the four papers' policies: its ``"policies"`` object, validated.

``parse_policies`` checks a study's choice (its fixed config's ``"policies"`` object) and returns the
``StudyPolicies`` the scheduling round (``stagetree.core.round``) builds the study's steps from; every
name is checked against the registry of its step (``POLICY_NAMES``), and an unknown one is an error that
lists the known ones. What each key decides, and its parameters, is in docs/policies.md.

A study's ``"slots": n`` (an integer, default 1) trains each of its batches data-parallel on ``n``
slots of one node manager; it is not a scheduling step of its own, so a study that chooses only
``slots`` keeps the default steps. With a ``qos`` class, ``width`` names how a batch's number of slots
(up to ``slots``) is chosen: GENIE's cost-effective ratio under the deadline (``genie``, the default) or
one of its paper's baselines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies import genie, hermes, packing, pop
from stagetree.core.scheduler import ORDER_POLICIES

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
    width: str = genie.DEFAULT_WIDTH_POLICY  # with a qos class: how a batch's slots are chosen

    @property
    def schedules(self) -> bool:
        """Whether it chooses a scheduling step (anything but ``slots``)."""
        return any(x is not None for x in (self.order, self.time_share, self.placement, self.qos, self.search))

    @property
    def stateful(self) -> bool:
        """Whether its steps learn across rounds (time-sharing quanta, search curves and kills)."""
        return self.time_share is not None or self.search is not None

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
            if self.width != genie.DEFAULT_WIDTH_POLICY:
                out["width"] = self.width
        if self.search is not None:
            sp = self.search
            out["search"] = sp.policy
            out["search_params"] = {k: getattr(sp, k) for k in POLICY_PARAMS["search_params"]}
        return out


# The names each key accepts (a typed registry; an unknown name is an error that lists them).
POLICY_NAMES: Mapping[str, tuple[str, ...]] = {
    "order": tuple(sorted(ORDER_POLICIES)),
    "time_share": tuple(sorted(hermes.TIME_SHARE_POLICIES)),
    "placement": tuple(sorted(packing.PLACE_POLICIES)),
    "qos": genie.QOS_CLASSES,
    "width": tuple(sorted(genie.WIDTH_POLICIES)),
    "search": tuple(sorted(pop.SEARCH_POLICIES)),
}
POLICY_PARAMS: Mapping[str, Mapping[str, type]] = {
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
    known = POLICY_PARAMS[key]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise InvalidArgument(f"policies.{key}: unknown parameters {unknown}; known: {sorted(known)}")
    out: dict[str, Any] = {}
    for k, v in raw.items():
        want = known[k]
        if want is float and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
        elif want is int and isinstance(v, float) and v.is_integer():  # JSON's 5.0 is the integer 5
            out[k] = int(v)
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
    allowed = set(POLICY_NAMES) | set(POLICY_PARAMS) | {"slots"}
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
    if "width" in names and "qos" not in names:
        raise InvalidArgument("policies.width: given without policies.qos")
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
    if isinstance(slots, float) and slots.is_integer():
        slots = int(slots)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise InvalidArgument(f"policies.slots: must be an integer >= 1 (slots per batch), got {slots!r}")
    width = names.get("width", genie.DEFAULT_WIDTH_POLICY)
    return StudyPolicies(names.get("order"), ts, pl, names.get("qos"), sp, slots, width)
