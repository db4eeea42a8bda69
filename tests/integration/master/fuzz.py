"""Property-based fuzzing of a live master's REST API from its own OpenAPI spec (schemathesis), shared by
``test_fuzz_rest.py`` (a bounded run in the suite) and ``tests.bench.faults`` (the long run).

Every operation gets schema-valid cases (positive) and schema-breaking ones (negative); each answer is
checked for a server error (5xx), a status the spec does not list for the route, a content type or a
body the spec does not declare, and a schema-valid case refused (``positive_data_acceptance``: anything
but 2xx, 401, 403, 404, 409 or 429 to a positive case), counted apart in ``rejected_valid`` as well and
each kept in ``refused`` with the server's answer. A refusal for a rule the spec can state in words only
(``openapi.CROSS_ITEM_RULES``) is counted per rule in ``cross_item_refusals``, not as a valid case
refused.
Half of the generated study ids are swapped for a real study of the caller, so the routes behind the
404 are reached too; the node routes go with the admin token.
"""

from __future__ import annotations

import json
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.errors import UnsupportedSchema
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from stagetree.master.api.openapi import CROSS_ITEM_RULES

SPEC_CHECKS = [content_type_conformance, response_headers_conformance, response_schema_conformance]
CHECKS = [not_a_server_error, status_code_conformance, *SPEC_CHECKS, positive_data_acceptance]
# the dashboard's reads still have a rule the spec cannot state (a trial by label or by request_id, one
# of the two): their schema-valid cases are checked for everything but acceptance
DASHBOARD_CHECKS = [not_a_server_error, status_code_conformance, *SPEC_CHECKS]


@dataclass
class FuzzReport:
    requests: int = 0
    server_errors: int = 0
    spec_violations: int = 0
    rejected_valid: int = 0  # of spec_violations: schema-valid cases the server refused
    cross_item_refusals: Counter[str] = field(default_factory=Counter)  # per rule of CROSS_ITEM_RULES, apart
    statuses: Counter[int] = field(default_factory=Counter)
    by_method: dict[str, set[str]] = field(default_factory=dict)  # the outcomes seen per call (gRPC)
    failures: list[str] = field(default_factory=list)  # the first few, with the case that caused each
    refused: list[str] = field(default_factory=list)  # every schema-valid case refused, with the server's answer
    gave_up: list[str] = field(default_factory=list)  # operations whose case generation stopped early

    def __str__(self) -> str:
        return (
            f"{self.requests} requests, {self.server_errors} server errors, {self.spec_violations} outside the "
            f"spec ({self.rejected_valid} valid cases refused); statuses {dict(sorted(self.statuses.items()))}; "
            f"refused for a rule stated in words {dict(self.cross_item_refusals)}; "
            f"generation gave up on {self.gave_up}\n"
            + "\n".join(self.failures[:10])
            + "".join(f"\nrefused: {r}" for r in self.refused)
        )


STREAMS = ("/dashboard/events",)  # operations that answer text/event-stream


def fuzz(
    base_url: str,
    user_token: str,
    admin_token: str,
    study_id: str,
    *,
    examples_per_operation: int = 50,
    budget_s: float = 120.0,
    seed: int | None = 0,
) -> FuzzReport:
    """Fuzz every operation of the master at ``base_url`` (``http://host:port``); returns what was seen.
    Stops starting new operations once ``budget_s`` is spent."""
    schema = schemathesis.openapi.from_url(f"{base_url}/api/v1/openapi.json")
    report = FuzzReport()
    deadline = time.monotonic() + budget_s
    # an event stream never ends: a request/response fuzz cannot read its answer (tests/browser covers it)
    operations = [r.ok() for r in schema.get_all_operations() if not r.ok().path.endswith(STREAMS)]
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        for op in operations:
            if time.monotonic() > deadline:
                return report
            token = admin_token if op.path.startswith(("/api/v1/hosts", "/api/v1/nodes")) else user_token
            _fuzz_operation(op, mode, base_url, token, study_id, examples_per_operation, seed, report)
    return report


def _cross_item_rule(answer: str) -> str | None:
    """The rule of ``CROSS_ITEM_RULES`` a 422's message names, if any: a schema-valid case refused for a rule
    the spec states in words only (JSON Schema cannot: steps strictly increasing, segments that cover
    [0, forever), ...), and only for it, is counted apart per rule, not as a valid case refused."""
    try:
        message = str(json.loads(answer).get("message", ""))
    except (ValueError, AttributeError):
        return None
    return next((rule for rule, phrases in CROSS_ITEM_RULES.items() if any(p in message for p in phrases)), None)


def _fuzz_operation(
    op: Any,
    mode: GenerationMode,
    base_url: str,
    token: str,
    study_id: str,
    examples: int,
    seed: int | None,
    report: FuzzReport,
) -> None:
    try:
        strategy = op.as_strategy(generation_mode=mode)
    except Exception:  # an operation with nothing to negate (no parameters) has no negative cases
        return

    # a seed fixes the cases (None: a fresh draw each run); the swaps below hash with crc32, not hash(),
    # whose per-process salt would pick other cases for the real study and for no token in each run
    @hypothesis.seed(seed)
    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=hypothesis.Verbosity.quiet,
    )
    @hypothesis.given(case=strategy)
    def run(case: Any) -> None:
        params = case.path_parameters or {}
        if "study_id" in params and zlib.crc32(str(params["study_id"]).encode()) % 2 == 0:
            params["study_id"] = study_id
        headers = {"Authorization": f"Bearer {token}"} if zlib.crc32(repr(case.body).encode()) % 8 else {}
        response = case.call(base_url=base_url, headers=headers, timeout=30)
        report.requests += 1
        report.statuses[response.status_code] += 1
        try:
            checks = DASHBOARD_CHECKS if case.path.startswith("/api/v1/dashboard/") else CHECKS
            case.validate_response(response, checks=checks, headers=headers)
        except BaseException as exc:  # schemathesis's FailureGroup is a BaseExceptionGroup
            if isinstance(exc, KeyboardInterrupt):
                raise
            failures = list(getattr(exc, "exceptions", [exc]))
            rule = _cross_item_rule(response.text) if response.status_code == 422 else None
            if rule is not None and all(isinstance(f, RejectedPositiveData) for f in failures):
                report.cross_item_refusals[rule] += 1
                return
            refused = response.status_code < 500 and any(isinstance(f, RejectedPositiveData) for f in failures)
            if response.status_code >= 500:
                report.server_errors += 1
            else:
                report.spec_violations += 1
                report.rejected_valid += refused
            what = "; ".join(str(getattr(f, "title", f))[:200] for f in failures)
            seen = f"{case.method} {case.formatted_path} -> {response.status_code}: {what}\n" + (
                f"  body={case.body!r:.300} query={case.query!r:.200}\n  answer={response.text[:300]}"
            )
            if refused:
                report.refused.append(seen)
            elif len(report.failures) < 20:
                report.failures.append(seen)

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        pass
    except UnsupportedSchema as exc:  # schemathesis cannot negate some schema of this operation: the cases
        report.gave_up.append(f"{op.method.upper()} {op.path} ({mode.value}): {str(exc)[:120]}")  # so far count
