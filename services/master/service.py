"""The master's use-case layer: the one place both API adapters (gRPC and REST) call.

Owns input validation, authorization (a study is visible only to its owner; node-manager calls need
the admin token) and the order of effects: everything is validated before anything is written, so a
bad item changes nothing. Methods are synchronous (the store is); the async adapters run them in a
worker thread. Results and new work are announced on wake-up channels (``CH_*``), never awaited here.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stagetree.bus.messages import BatchMessage
from stagetree.core.batch import CurveSampling, Point
from stagetree.core.config import Config, FixedPart, divergence
from stagetree.core.entrypoints import check_entry_point
from stagetree.core.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, StagetreeError
from stagetree.core.lifecycle import AssignmentKind, RetryPolicy
from stagetree.core.searchplan import check_step
from stagetree.core.sharing import SharingStats
from stagetree.core.text import INT64_MAX, check_id, check_json_depth, check_text
from stagetree.master import metrics
from stagetree.master.auth import Principal, scope_of
from stagetree.master.plans import PlanCache, config_text
from stagetree.master.policies import fixed_without_policies, split_policies
from stagetree.master.settings import LimitSettings
from stagetree.master.store.ingest import Ingestor
from stagetree.master.store.paths import PathChange
from stagetree.master.store.records import (
    Assignment,
    LoggedLine,
    NewRequest,
    NodeManagerRecord,
    RequestRecord,
    SlotInfo,
    StudyRecord,
)
from stagetree.master.store.retention import Forgotten
from stagetree.master.store.stats import Overview
from stagetree.master.store.store import Store

log = logging.getLogger(__name__)

MAX_ID_LEN = 128  # client request ids, labels, node manager and slot ids, plan keys, study ids
MAX_CORES = 1 << 16
MAX_GPU_INDEX = 1 << 10

# a direct report's message ids are kept this long (a node manager retries a report for minutes at most)
APPLIED_RETENTION_S = 7 * 24 * 3600.0
PRUNE_APPLIED_EVERY_S = 3600.0

CH_ROUND = "round"  # something a scheduling round should look at happened
CH_RESULTS = "results"  # some requests finished
CH_CURVES = "curves"  # learning-curve points were stored (the dashboard's live curves)


def ch_node_manager(nm_id: str) -> str:
    return f"nm:{nm_id}"


class Wakeups(Protocol):
    def notify(self, channel: str) -> None: ...


class NoWakeups:
    def notify(self, channel: str) -> None:
        pass


@dataclass(frozen=True)
class SubmitItem:
    client_request_id: str
    config_json: str
    step: int
    label: str = ""  # the tuner's trial (shown by REST and the CLI; groups requests in the study's stats)


@dataclass(frozen=True)
class NodeView:
    id: int
    parent: int | None
    start: int
    config_json: str
    requests: dict[str, int]
    checkpoints: list[int]
    metrics: list[int]
    # where training resumed a checkpoint on another number of ranks at this node (issue 22)
    path_changes: list[PathChange] = field(default_factory=list)


@dataclass(frozen=True)
class PlanView:
    key: str
    fixed_json: str
    nodes: list[NodeView] = field(default_factory=list)


def _json_object(text: str, what: str, limit: int) -> Any:
    if not isinstance(text, str) or not text:
        raise InvalidArgument(f"{what}: must be a non-empty JSON string")
    if len(text) > limit:
        raise InvalidArgument(f"{what}: {len(text)} bytes is over the {limit}-byte limit")
    check_json_depth(text, what)  # before the parser recurses into it
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"{what}: not valid JSON ({e})") from None


@functools.lru_cache(maxsize=1024)
def _study_fixed(fixed_json: str) -> FixedPart:
    """A study's stored fixed part (its policies dropped), parsed once: every item of every submission
    that names no fixed part of its own uses it. (A ``FixedPart`` is never changed once made.)"""
    return FixedPart.from_json(fixed_without_policies(fixed_json))


class MasterService:
    """Studies, requests, metrics, plans and node managers, for an authenticated principal."""

    def __init__(
        self, store: Store, limits: LimitSettings, wakeups: Wakeups | None = None, plans: PlanCache | None = None
    ) -> None:
        self.store = store
        self.limits = limits
        self.wakeups: Wakeups = wakeups or NoWakeups()
        self.plans = plans or PlanCache(store.plans)
        self.retry = RetryPolicy()  # how often a request's work may fail before the request fails
        # an attempt sent this long ago that its node manager's heartbeat does not list never arrived
        self.assignment_grace_s = 15.0
        # node manager -> when a heartbeat's list of attempts was last judged (requeue_unknown): a query
        # per heartbeat was a twentieth of a busy master's CPU with 200 node managers (tests.bench.scale)
        self._unknown_checked: dict[str, float] = {}
        self.teams: dict[str, str] = {}  # owner -> team: the scope its plans are shared within
        # where the master can see the workers' code (embedded mode): trainer entry point -> why it does
        # not import (None: it does), checked at study creation instead of at the first batch
        self.trainer_check: Callable[[str], str | None] | None = None
        self._plan_versions: dict[int, tuple[str, str]] = {}  # plan_versions' memory (plans are immutable)
        self._applied_pruned_at = time.monotonic()  # when the direct reports' applied ids were last pruned

    # -- studies --------------------------------------------------------------------------------

    def create_study(
        self,
        who: Principal,
        name: str,
        fixed_json: str = "",
        *,
        retry_user_errors: bool = False,
        curve_every_steps: int | None = None,
        curve_max_per_s: float | None = None,
    ) -> StudyRecord:
        """A new study of the caller. ``retry_user_errors``: retry its requests' work when the user's
        code raised (off by default: such an error fails the request on its first attempt).
        ``curve_every_steps``/``curve_max_per_s``: how its learning curves are sampled (``CurveSampling``;
        None: the master's settings)."""
        check_text(name, "study name", self.limits.max_name_len)
        if curve_every_steps is not None:
            CurveSampling(every_steps=curve_every_steps)  # raises InvalidArgument, naming the field
        if curve_max_per_s is not None:
            CurveSampling(max_per_s=curve_max_per_s)
        if not name.strip():
            raise InvalidArgument("study name: must not be blank")
        stored = None
        if fixed_json:
            # a "policies" key picks the study's scheduling policies (master.policies); the rest names the plan
            fixed_obj, policies = split_policies(_json_object(fixed_json, "fixed", self.limits.max_config_bytes))
            fixed_part = FixedPart.from_json(fixed_obj)
            check_entry_point(fixed_part.trainer, "fixed.trainer")
            problem = self.trainer_check(fixed_part.trainer) if self.trainer_check is not None else None
            if problem is not None:
                raise InvalidArgument(f"fixed.trainer: {problem}")
            stored = fixed_part.to_json()
            if policies is not None:
                stored["policies"] = policies.to_json()
        fixed = None if stored is None else json.dumps(stored, sort_keys=True)
        rec = self.store.studies.create_study(
            who.name,
            name,
            fixed,
            retry_user_errors=bool(retry_user_errors),
            curve_every_steps=curve_every_steps,
            curve_max_per_s=None if curve_max_per_s is None else float(curve_max_per_s),
        )
        log.info("study created", extra={"study_id": rec.id, "owner": who.name})
        return rec

    def get_study(self, who: Principal, study_id: str) -> StudyRecord:
        check_text(study_id, "study_id", MAX_ID_LEN)
        try:
            rec = self.store.studies.get_study(study_id)
        except NotFound:
            rec = None
        if rec is None or (rec.owner != who.name and not who.admin):
            # another owner's study is invisible, not forbidden: its existence is not disclosed
            raise NotFound(f"study {study_id!r} does not exist")
        return rec

    def list_studies(self, who: Principal) -> list[StudyRecord]:
        return self.store.studies.list_studies(who.name)

    def find_study(self, who: Principal, name: str) -> StudyRecord:
        """The caller's study named ``name``."""
        check_text(name, "name", self.limits.max_name_len)
        return self.store.studies.find_study(who.name, name)

    def delete_study(self, who: Principal, study_id: str) -> int:
        """Cancel the study's live requests (aborting batches nothing else needs), then delete it and its
        requests; returns how many requests went. Its plans stay, shared within the owner's scope: their
        metrics and checkpoints keep answering the scope's other studies until ``forget_plan``."""
        study = self.get_study(who, study_id)
        for r in self.store.requests.get_requests(study.id):
            if r.state.is_live():
                self.cancel(who, study.id, r.id)
        n = self.store.retention.delete_study(study.id)
        self.store.studies.forget_study(study.id)
        log.info("study deleted", extra={"study_id": study.id, "owner": study.owner, "requests": n})
        return n

    def overview(self, who: Principal) -> Overview:
        """Studies, requests by state and slots busy, over every owner (admin token)."""
        who.require_admin()
        return self.store.stats.overview()

    def study_stats(self, who: Principal, study_id: str, code_version: str | None = None) -> SharingStats:
        """What sharing bought the study; with ``code_version``, over the requests of that trainer code
        version's plans only (a study loaded by edited code holds both versions' requests)."""
        study = self.get_study(who, study_id)
        if code_version is None:
            return self.store.stats.study_stats(study.id)
        check_text(code_version, "code_version", MAX_ID_LEN, empty=True)
        plans = self.plan_versions(self.store.plans.study_plan_ids(study.id))
        return self.store.stats.study_stats(study.id, [p for p, (_, v) in plans.items() if v == code_version])

    def _scope(self, study: StudyRecord) -> str:
        return scope_of(study.owner, self.teams.get(study.owner, ""))

    # -- requests -------------------------------------------------------------------------------

    def _parse_config(self, study: StudyRecord, text: str, what: str) -> tuple[FixedPart, Config]:
        obj = _json_object(text, what, self.limits.max_config_bytes)
        if not isinstance(obj, dict) or "tuned" not in obj:
            raise InvalidArgument(f'{what}: must be an object {{"fixed": {{...}}, "tuned": {{name: sequence}}}}')
        unknown = set(obj) - {"fixed", "tuned"}
        if unknown:
            raise InvalidArgument(f"{what}: unknown fields {sorted(unknown)}")
        fixed_obj = obj.get("fixed")
        try:
            if fixed_obj is not None:  # a fixed part of its own names a plan the study's creation did not check
                fixed = FixedPart.from_json(fixed_obj)
                check_entry_point(fixed.trainer, "fixed.trainer")
            elif study.fixed_json is not None:
                fixed = _study_fixed(study.fixed_json)
            else:
                raise InvalidArgument("no 'fixed' part and the study has no default one")
            return fixed, Config.of(obj["tuned"])
        except StagetreeError as e:
            raise InvalidArgument(f"{what}: {e.message}") from None

    def submit(self, who: Principal, study_id: str, items: Sequence[SubmitItem]) -> list[RequestRecord]:
        """Record requests (one per item, in order); a retried client request id returns the first
        record. Items whose metrics exist come back DONE with them."""
        study = self.get_study(who, study_id)
        if not items:
            raise InvalidArgument("submit: at least one item is needed")
        if len(items) > self.limits.max_batch_items:
            raise ResourceExhausted(
                f"submit: {len(items)} items is over the limit of {self.limits.max_batch_items}; split the batch"
            )
        parsed: list[tuple[str, FixedPart, Config, int]] = []
        labels: list[str] = []
        first_of: dict[str, int] = {}  # client request id -> its entry in parsed
        entry: list[int] = []  # item -> its entry in parsed: an item repeated in the batch is one request
        configs: dict[str, tuple[FixedPart, Config]] = {}  # a trial asked at several steps is parsed once
        for i, it in enumerate(items):
            cid = check_text(it.client_request_id, f"items[{i}].client_request_id", MAX_ID_LEN)
            check_text(it.label, f"items[{i}].label", MAX_ID_LEN, empty=True)
            step = check_step(it.step, f"items[{i}].step")
            got = configs.get(it.config_json)
            if got is None:
                got = configs[it.config_json] = self._parse_config(study, it.config_json, f"items[{i}].config")
            fixed, config = got
            j = first_of.get(cid)
            if j is not None:  # as a resend in a later call: the same item is the same request
                if parsed[j][1:] != (fixed, config, step):
                    raise AlreadyExists(
                        f"items[{i}].client_request_id: {cid!r} is also the id of another item in this batch; "
                        "an id names one request (use a new client_request_id for a new request)"
                    )
                entry.append(j)
                continue
            first_of[cid] = len(parsed)
            entry.append(len(parsed))
            parsed.append((cid, fixed, config, step))
            labels.append(it.label)
        by_plan: dict[str, list[int]] = {}
        fixed_of: dict[str, FixedPart] = {}
        scope = self._scope(study)
        keys: dict[int, str] = {}  # the items of a study's default fixed part share one FixedPart
        for i, (_, fixed, _, _) in enumerate(parsed):
            key = keys.get(id(fixed))
            if key is None:
                key = keys[id(fixed)] = fixed.key(scope)
            by_plan.setdefault(key, []).append(i)
            fixed_of[key] = fixed
        self._check_resends(study, parsed, by_plan)
        out: list[RequestRecord | None] = [None] * len(parsed)
        for key, idxs in by_plan.items():
            plan_id = self.store.plans.ensure_plan(key, json.dumps(fixed_of[key].to_json(), sort_keys=True), scope)
            points = self.plans.locate_many(plan_id, [(parsed[i][2], parsed[i][3]) for i in idxs])
            recs = self.store.requests.add_requests(
                study.id,
                plan_id,
                [NewRequest(parsed[i][0], p.node, p.step, labels[i]) for i, p in zip(idxs, points, strict=True)],
            )
            for i, r in zip(idxs, recs, strict=True):
                out[i] = r
        log.debug("requests submitted", extra={"study_id": study.id, "items": len(items)})
        self.wakeups.notify(CH_ROUND)
        return [r for r in (out[k] for k in entry) if r is not None]

    def _check_resends(
        self, study: StudyRecord, parsed: Sequence[tuple[str, FixedPart, Config, int]], by_plan: dict[str, list[int]]
    ) -> None:
        """A client request id sent again must carry the same item (then the first request answers it):
        one that differs is refused, before anything is written, naming the difference."""
        known = self.store.requests.by_client_ids(study.id, [cid for cid, _, _, _ in parsed])
        if not known:
            return
        plan_of = {i: key for key, idxs in by_plan.items() for i in idxs}
        plan_ids = self.store.plans.plan_ids_by_key(set(plan_of.values()))
        for i, (cid, _, config, step) in enumerate(parsed):
            first = known.get(cid)
            if first is None:
                continue
            plan_id = plan_ids.get(plan_of[i])
            if first.step != step:
                why = f"step {first.step}, now {step}"
            elif plan_id != first.plan_id:
                why = "another fixed part"
            elif not self._same_path(plan_id, first.node, config, step):
                why = "another config"
            else:
                continue
            raise AlreadyExists(
                f"items[{i}].client_request_id: {cid!r} was used for request {first.id} with {why}; a resend "
                "must repeat the item exactly (use a new client_request_id for a new request)"
            )

    def _same_path(self, plan_id: int, node_id: int, config: Config, step: int) -> bool:
        """Whether ``config`` trained to ``step`` is the model at ``(node_id, step)``: its values agree with
        the node's config on every step before (the plan's own test, ``core.config.divergence``)."""
        node = self.plans.ensure(plan_id, [node_id]).nodes.get(node_id)
        return node is not None and divergence(node.config, config, 0, step) >= step

    def cancel(self, who: Principal, study_id: str, request_id: int) -> RequestRecord:
        check_id(request_id, "request_id")
        study = self.get_study(who, study_id)
        rec, abort = self.store.requests.cancel_request(study.id, request_id)
        if abort is not None:
            nm = self.store.ledger.abort_batch(abort)
            if nm is not None:
                self.wakeups.notify(ch_node_manager(nm))
            log.info("batch aborted: no live request needs it", extra={"batch_id": abort, "request_id": request_id})
        self.wakeups.notify(CH_ROUND)
        self.wakeups.notify(CH_RESULTS)
        return rec

    def get_requests(self, who: Principal, study_id: str, request_ids: Sequence[int] | None) -> list[RequestRecord]:
        for rid in request_ids or ():
            check_id(rid, "request_ids")
        study = self.get_study(who, study_id)
        return self.store.requests.get_requests(study.id, request_ids)

    def request_log(self, who: Principal, study_id: str, request_id: int) -> list[LoggedLine]:
        """The text lines the trainers of the batches that carried the request logged (``Trainer.log_text``),
        in the order they ran; a request of another study (or owner) does not exist for the caller."""
        check_id(request_id, "request_id")
        if not self.get_requests(who, study_id, [request_id]):
            raise NotFound(f"request {request_id} does not exist in study {study_id!r}")
        return self.store.batches.request_log_lines(request_id)

    def plan_versions(self, plan_ids: Iterable[int]) -> dict[int, tuple[str, str]]:
        """Plan id -> (plan key, trainer code version) for the plans of listed requests; a plan's key and
        fixed part never change, so they are kept once read."""
        out: dict[int, tuple[str, str]] = {}
        for pid in plan_ids:
            known = self._plan_versions.get(pid)
            if known is None:
                key, fixed_json = self.store.plans.plan_fixed(pid)
                version = str(json.loads(fixed_json).get("code_version", "")) if fixed_json else ""
                known = self._plan_versions[pid] = (key, version)
            out[pid] = known
        return out

    def finished(self, who: Principal, study_id: str, request_ids: Sequence[int]) -> list[RequestRecord]:
        for rid in request_ids:
            check_id(rid, "request_ids")
        study = self.get_study(who, study_id)
        return self.store.requests.done_since(study.id, request_ids)

    def get_metrics(
        self, who: Principal, study_id: str, config_json: str, step: int
    ) -> tuple[Point | None, dict[str, float] | None]:
        """Metrics of a config at a step if they exist; never creates anything."""
        study = self.get_study(who, study_id)
        step = check_step(step)
        fixed, config = self._parse_config(study, config_json, "config")
        key = fixed.key(self._scope(study))
        plan_id = self.store.plans.plan_ids_by_key([key]).get(key)
        if plan_id is None:
            return None, None
        point = self.plans.find(plan_id, config, step)
        if point is None:
            return None, None
        return point, self.store.requests.metrics_at(point.node, point.step)

    def study_plan(self, who: Principal, study_id: str, plan_key: str = "") -> tuple[str, int]:
        """(key, id) of the plan ``plan_key`` of the caller's study, or of its only plan when no key is
        given (NotFound for another owner's study or a plan it does not use)."""
        return self._study_plan(self.get_study(who, study_id), plan_key)

    def _study_plan(self, study: StudyRecord, plan_key: str) -> tuple[str, int]:
        """(key, id) of the plan ``plan_key`` of the study; without a key, of the study's own plan (that of
        its fixed part), or of its only plan when it has no own one."""
        check_text(plan_key, "plan_key", MAX_ID_LEN, empty=True)
        plan_ids = self.store.plans.study_plan_ids(study.id)
        keys = {self.store.plans.plan_fixed(pid)[0]: pid for pid in plan_ids}
        default_key = None
        if study.fixed_json is not None:
            default_key = FixedPart.from_json(fixed_without_policies(study.fixed_json)).key(self._scope(study))
            keys.update(self.store.plans.plan_ids_by_key([default_key]))
        if not plan_key:
            if not keys:
                raise NotFound(f"study {study.id!r} has no plan yet: its plans start with its first request")
            if default_key not in keys and len(keys) > 1:
                raise InvalidArgument(f"plan_key: the study uses {len(keys)} plans; name one of {sorted(keys)}")
            plan_key = default_key if default_key in keys else next(iter(keys))
        pid = keys.get(plan_key)
        if pid is None:
            raise NotFound(f"plan {plan_key!r} is not used by study {study.id!r}")
        return plan_key, pid

    def forget_plan(self, who: Principal, study_id: str, plan_key: str = "") -> Forgotten:
        """Drop what a plan of the study computed: its checkpoints (files deleted by the node managers),
        its metrics, and the finished requests they answered, in every study of the scope. Refused while
        a request on it is live. The next eval on it trains from scratch."""
        study = self.get_study(who, study_id)
        plan_key, pid = self._study_plan(study, plan_key)
        out = self.store.retention.forget_plan(pid)
        log.info(
            "plan forgotten",
            extra={
                "study_id": study.id,
                "plan_key": plan_key,
                "bytes_freed": out.bytes_freed,
                "requests": out.requests,
            },
        )
        self.wakeups.notify(CH_ROUND)
        return out

    def get_plan(self, who: Principal, study_id: str, plan_key: str = "") -> PlanView:
        study = self.get_study(who, study_id)
        plan_key, pid = self._study_plan(study, plan_key)
        plan = self.plans.refresh(pid)
        counts, ckpts, mets = self.store.plans.plan_state(pid)
        changes = self.store.paths.of_nodes(list(plan.nodes))
        nodes = [
            NodeView(
                n.id,
                n.parent,
                n.start,
                config_text(n.config),
                counts.get(n.id, {}),
                sorted(ckpts.get(n.id, [])),
                sorted(mets.get(n.id, [])),
                changes.get(n.id, []),
            )
            for n in sorted(plan.nodes.values(), key=lambda n: n.id)
        ]
        return PlanView(plan_key, self.store.plans.plan_fixed(pid)[1], nodes)

    # -- node managers --------------------------------------------------------------------------

    def register_node_manager(
        self,
        who: Principal,
        nm_id: str,
        address: str,
        slots: Sequence[SlotInfo | tuple[str, str]],
        *,
        known: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Register (or re-register) a node manager. ``known``: every attempt the registering process
        runs or recently ended; its other sent, running attempts are requeued (see
        ``BatchLedger.requeue_unknown``). None (a node manager that does not say) requeues nothing."""
        who.require_admin()
        check_text(nm_id, "node_manager_id", MAX_ID_LEN)
        check_text(address, "address", 256, empty=True)
        infos = [s if isinstance(s, SlotInfo) else SlotInfo(s[0], s[1]) for s in slots]
        if not infos:
            raise InvalidArgument("slots: a node manager needs at least one slot")
        for i, info in enumerate(infos):
            if not 0.0 <= info.share <= 1.0:
                raise InvalidArgument(f"slots[{i}].share: must be in [0, 1] (0 = the whole GPU), got {info.share}")
            check_text(info.id, f"slots[{i}].id", MAX_ID_LEN)
            check_text(info.gpu_type, f"slots[{i}].gpu_type", 64)
            check_text(info.compute_capability, f"slots[{i}].compute_capability", 16, empty=True)
            if not (0 <= info.memory_bytes <= INT64_MAX and 0 <= info.cpu_cores <= MAX_CORES):
                raise InvalidArgument(
                    f"slots[{i}]: memory_bytes must be in [0, {INT64_MAX}] and cpu_cores in [0, {MAX_CORES}]"
                )
            if not -1 <= info.gpu_index <= MAX_GPU_INDEX:
                raise InvalidArgument(f"slots[{i}].gpu_index: must be in [-1, {MAX_GPU_INDEX}] (-1: a CPU slot)")
        slots = infos
        first_of: dict[str, int] = {}
        for i, info in enumerate(infos):
            j = first_of.setdefault(info.id, i)
            if j != i:
                raise AlreadyExists(f"slots[{i}].id: {info.id!r} is slots[{j}]'s already; slot ids must be distinct")
        self.store.nodes.register_node_manager(nm_id, address, slots)
        log.info("node manager registered", extra={"node_manager_id": nm_id, "slots": len(slots)})
        if known is not None:
            lost = self.store.ledger.requeue_unknown(nm_id, known)
            if lost:
                log.warning(
                    "node manager registered without some of its running work; requeued",
                    extra={"node_manager_id": nm_id, "batches": lost},
                )
        self.wakeups.notify(CH_ROUND)

    def list_node_managers(self, who: Principal) -> list[NodeManagerRecord]:
        """Every registered node manager with its slots and liveness (admin only)."""
        who.require_admin()
        return self.store.nodes.node_managers()

    def heartbeat(self, who: Principal, nm_id: str, known: Sequence[tuple[int, int]] | None = None) -> None:
        """A node manager is alive. ``known``: the attempts it runs or recently ended; those sent to it
        more than ``assignment_grace_s`` ago that it does not list never arrived (the stream took them
        but the process never saw them) and are requeued. None requeues nothing."""
        err = self.heartbeats([(who, nm_id, known)])[0]
        if err is not None:
            raise err

    def heartbeats(
        self, beats: Sequence[tuple[Principal, str, Sequence[tuple[int, int]] | None]]
    ) -> list[StagetreeError | None]:
        """``heartbeat`` for the heartbeats that arrived together, in two statements for all of them
        (200 node managers beat 40 times a second: a transaction each was a seventh of a busy master's
        CPU; tests.bench.scale). Per beat, None or the error for it alone (not an admin, not registered)."""
        out: list[StagetreeError | None] = []
        for who, _, _ in beats:
            try:
                who.require_admin()
                out.append(None)
            except StagetreeError as e:
                out.append(e)
        found = self.store.nodes.heartbeat_many([nm for (_, nm, _), err in zip(beats, out, strict=True) if not err])
        now, grace = time.monotonic(), self.assignment_grace_s / 3
        due: dict[str, Sequence[tuple[int, int]]] = {}
        for i, (_, nm, known) in enumerate(beats):
            if out[i] is not None:
                continue
            if nm not in found:
                out[i] = NotFound(f"node manager {nm!r} is not registered; register it first")
            # judged lately: a lost assignment is found at most a third of the grace later
            elif known is not None and now - self._unknown_checked.get(nm, float("-inf")) >= grace:
                self._unknown_checked[nm] = now
                due[nm] = known
        if due:
            lost = self.store.ledger.requeue_unknown_many(
                sorted(due.items()), sent_before=time.time() - self.assignment_grace_s
            )
            for nm, batches in lost.items():
                log.warning(
                    "work sent to a node manager never reached it; requeued",
                    extra={"node_manager_id": nm, "batches": batches},
                )
            if lost:
                self.wakeups.notify(CH_ROUND)
        return out

    def leave_node_manager(self, who: Principal, nm_id: str, known: Sequence[tuple[int, int]]) -> list[int]:
        """A node manager stopping gracefully, once its workers stopped and their reports were sent: it
        gets no more work, and what it was given but does not list in ``known`` is requeued now
        (``BatchLedger.leave``), where waiting out its heartbeat TTL would send work there meanwhile.
        The batch ids requeued."""
        who.require_admin()
        check_text(nm_id, "node_manager_id", MAX_ID_LEN)
        requeued = self.store.ledger.leave(nm_id, known)
        if requeued is None:
            raise NotFound(f"node manager {nm_id!r} is not registered; register it first")
        log.info("node manager left", extra={"node_manager_id": nm_id, "batches": requeued})
        self.wakeups.notify(CH_ROUND)
        return requeued

    def take_assignments(self, who: Principal, nm_id: str) -> list[Assignment]:
        """What the node manager should do next: batch attempts to run, then control actions."""
        who.require_admin()
        return self.take_assignments_many([nm_id])[nm_id]

    def take_assignments_many(self, nm_ids: Sequence[str]) -> dict[str, list[Assignment]]:
        """``take_assignments`` of several node managers in one transaction (their streams' callers are
        checked to be admins when the streams open)."""
        out = self.store.nodes.take_assignments_many(nm_ids)
        metrics.taken(a.batch_id for got in out.values() for a in got if a.kind == AssignmentKind.RUN)
        return out

    def preempt(self, who: Principal, batch_id: int) -> bool:
        """Ask a running batch to yield (finish the step, save, exit); its rest is rescheduled."""
        who.require_admin()
        asked = self.store.ledger.preempt_batch(batch_id)
        if asked:
            batch = self.store.batches.get_batch(batch_id)
            if batch.node_manager_id:
                self.wakeups.notify(ch_node_manager(batch.node_manager_id))
        return asked

    def report_batch(self, who: Principal, report: Sequence[BatchMessage]) -> list[int]:
        """A node manager reports what a batch attempt produced and how it ended: its bus messages
        (``stagetree.bus.messages``), applied as an aggregator applies them. Returns the requests it
        completed. What becomes of the rest is ``core.lifecycle.end_attempt``'s decision (bounded
        retries of failures; a preempted attempt's work is rescheduled from its checkpoint)."""
        got = self.report_batches(who, [report])[0]
        if isinstance(got, StagetreeError):
            raise got
        return got

    def report_batches(
        self, who: Principal, reports: Sequence[Sequence[BatchMessage]]
    ) -> list[list[int] | StagetreeError]:
        """``report_batch`` of several attempts in one ``Ingestor.apply`` (one transaction: reports that
        arrive together, see ``api.grouping``). Each gets the requests its metrics completed, or the
        first reason one of its messages can never apply (an unknown batch, a bad step; its other
        messages are applied all the same, as on the bus). Messages are idempotent by ``msg_id``: a
        report sent again after a lost answer changes nothing."""
        who.require_admin()
        metrics.reported(len(reports))
        ingestor = Ingestor(self.store, self.plans, max_failures=self.retry.max_failures)
        result = ingestor.apply([msg for report in reports for msg in report])
        if time.monotonic() - self._applied_pruned_at > PRUNE_APPLIED_EVERY_S:  # no aggregator may run to do it
            self._applied_pruned_at = time.monotonic()
            ingestor.prune_applied(APPLIED_RETENTION_S)
        out: list[list[int] | StagetreeError] = []
        for report in reports:
            why = next((e for msg in report if (e := result.rejected_why.get(msg.msg_id)) is not None), None)
            if why is not None:
                out.append(why)
                continue
            out.append(sorted({i for msg in report for i in result.completed_by.get(msg.msg_id, ())}))
        if result.results_changed:
            self.wakeups.notify(CH_RESULTS)
        if result.round_needed:
            self.wakeups.notify(CH_ROUND)
        return out
