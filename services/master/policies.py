"""Per-study scheduling policies in the live master: a study's choice and the state its policies keep.

This module owns taking a study's ``"policies"`` key off its fixed object (``split_policies``: the rest
alone names the search plan) and ``PolicyStates``, which keeps the state the round's policies learn
across rounds (``core.policies.state.PolicyState``: Hermes' quanta and devices, POP's policies and
kills) and saves it per study, so that a new leader restores it. The round itself decides everything
(``stagetree.core.round.plan_round``); the keys, parameters and semantics a study chooses from are in
docs/policies.md.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from stagetree.core.errors import InvalidArgument
from stagetree.core.ids import StudyId
from stagetree.core.policies.state import PolicyState
from stagetree.core.policies.study import StudyPolicies, parse_policies
from stagetree.master.store.policy_state import PolicyStateStore
from stagetree.master.store.store import Store

log = logging.getLogger(__name__)

POLICIES_KEY = "policies"


def split_policies(fixed_obj: Any) -> tuple[Any, StudyPolicies | None]:
    """A study's fixed object without its ``"policies"`` key, and the validated policies (None if absent)."""
    if not isinstance(fixed_obj, Mapping) or POLICIES_KEY not in fixed_obj:
        return fixed_obj, None
    rest = {k: v for k, v in fixed_obj.items() if k != POLICIES_KEY}
    return rest, parse_policies(fixed_obj[POLICIES_KEY])


def fixed_without_policies(fixed_json: str) -> Any:
    """The stored study fixed json as the plain fixed object (policies dropped, not validated again)."""
    obj = json.loads(fixed_json)
    if isinstance(obj, dict):
        obj.pop(POLICIES_KEY, None)
    return obj


class PolicyStates:
    """The policies' state between rounds, and each study's saved snapshot of it.

    A round reads ``state`` and returns the next one, which ``keep`` takes. The state survives a change
    of leader: each study's snapshot is saved in ``policy_states`` (``save``) and a leader loads it
    before the first round that serves the study (``load``; ``reset`` on taking the lease).
    Consistency:

    * write-ahead: a round that preempts or kills saves the state, with those decisions as pending,
      before anything of the round is carried out (``save(force=True)`` before the dispatches); once one
      is carried out it is no longer pending (``preempted``, ``killed``), and a leader that restores
      pending ones carries them out again (cancelling a study's live requests at a point, and PREEMPT for
      a running batch, may be repeated harmlessly). A killed trial is in the saved ``killed`` set before
      any of its requests is cancelled, so no master decides to kill it a second time;
    * other changes (reports fed to a search policy, Hermes quanta recorded) are saved when changed, at
      most once per round and once per ``save_every_s``. A crash loses at most what was learnt in that
      last ``save_every_s``, which preempted and killed nothing (at most it ordered the dispatches of
      those rounds); the saved state says up to which report (``fed_at``) and from which quantum start
      it learnt, so the next leader reads the same metrics again and learns it anew (decisions that
      depend on the clock, such as POP's time left, are then taken at the new time);
    * a deposed leader still in its round may write once more after the next leader loaded; the next
      leader's own saves then replace that.
    """

    def __init__(self, store: Store, save_every_s: float = 1.0) -> None:
        self.store = store
        self.states = PolicyStateStore(store.db)
        self.save_every_s = save_every_s
        self.parsed: dict[str, StudyPolicies] = {}  # study id -> policies (a study's never change)
        self.reset()

    def reset(self) -> None:
        """Forget the soft state; each study's is loaded from the database before the next round that
        serves it (a master that starts leading calls this)."""
        self.state = PolicyState()
        self.loaded: set[str] = set()
        self.saved: dict[str, str] = {}  # study -> the snapshot (as canonical JSON) last saved or loaded
        self.saved_at = -math.inf

    def active(self, rows: Sequence[tuple[str, str]]) -> dict[StudyId, StudyPolicies]:
        """The policies of the studies among ``rows`` (``store.rounds.policy_studies``: studies with live
        requests that chose some)."""
        out: dict[StudyId, StudyPolicies] = {}
        for sid, fixed_json in rows:
            pol = self.parsed.get(sid)
            if pol is None:
                try:
                    _, got = split_policies(json.loads(fixed_json))
                except (InvalidArgument, ValueError):
                    log.warning("study policies unreadable; ignored", extra={"study_id": sid})
                    got = None
                pol = self.parsed[sid] = got or StudyPolicies()
            out[StudyId(sid)] = pol
        return out

    def load(self, policies: Mapping[StudyId, StudyPolicies]) -> None:
        """Restore the saved state of the studies among ``policies`` not loaded since the last ``reset``."""
        new = [sid for sid, p in policies.items() if sid not in self.loaded and p.stateful]
        if not new:
            return
        for sid, data in self.states.load(new).items():
            sp = policies[StudyId(sid)].search
            try:
                self.state.restore(sid, data, None if sp is None else sp.make(1))
            except InvalidArgument as e:
                log.warning("saved policy state unreadable; the study's starts afresh: %s", e.message)
                continue
            self.saved[sid] = _canonical(data)
            log.info("policy state restored", extra={"study_id": sid})
        self.loaded.update(new)

    def keep(self, state: PolicyState) -> None:
        """The state a round returned becomes the current one."""
        self.state = state

    def save(self, force: bool = False) -> list[str]:
        """Save the snapshot of each study whose state changed since it was last saved; unless ``force``,
        not within ``save_every_s`` of the last look. Returns the studies saved."""
        now = time.monotonic()
        if not force and now - self.saved_at < self.save_every_s:
            return []
        self.saved_at = now
        changed: dict[str, tuple[dict[str, Any], str]] = {}
        for sid in sorted(self.state.studies()):
            pol = self.parsed.get(sid)
            if pol is None or not pol.stateful:
                continue
            snap = self.state.snapshot(sid)
            text = _canonical(snap)
            if self.saved.get(sid) != text:
                changed[sid] = (snap, text)
        if changed:
            self.states.save({sid: snap for sid, (snap, _) in changed.items()})
            self.saved.update({sid: text for sid, (_, text) in changed.items()})
        return sorted(changed)

    def preempted(self, batch: int) -> None:
        self.state.pending_preempts.discard(batch)

    def killed(self, job: str) -> None:
        self.state.pending_kills.pop(job, None)


def _canonical(snapshot: Mapping[str, Any]) -> str:
    return json.dumps(snapshot, sort_keys=True, separators=(",", ":"))
