"""What the REST spec (``/api/v1/openapi.json``) declares beyond what FastAPI derives from the routes.

This module owns the schemas of the JSON the core parses (a trial config, its fixed part, every sequence
family, metric values) and the error answers each route can give. The core stays the one place that
decides what is valid (``stagetree.core.config``, ``stagetree.core.sequences``); these schemas describe
the shapes it accepts, and ``tests/unit/master/test_openapi.py`` checks every family's ``to_json`` against
them, so a new family or field cannot be left out of the spec.

Non-finite metric values (a diverged loss) are the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``
in every REST answer, as the store keeps them (JSON has no such numbers); gRPC carries the same values as
IEEE doubles, so both sides say the same thing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, WithJsonSchema

NON_FINITE = ("NaN", "Infinity", "-Infinity")

_NUMBER = {"type": "number"}
_STEPS = {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}
_SEQ = {"$ref": "#/components/schemas/Sequence"}


def _family(kind: str, required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    props = {"kind": {"type": "string", "enum": [kind]}, **required, **(optional or {})}
    return {"type": "object", "required": ["kind", *required], "properties": props}


# one schema per sequence family, keyed by its "kind" (stagetree.core.sequences._FAMILIES)
FAMILIES: dict[str, dict[str, Any]] = {
    "constant": _family("constant", {"value": {"type": ["number", "string", "boolean"]}}),
    "linear": _family("linear", {"init": _NUMBER, "slope": _NUMBER}),
    "exponential": _family("exponential", {"init": _NUMBER, "gamma": {"type": "number", "exclusiveMinimum": 0}}),
    "step": _family("step", {"init": _NUMBER, "step_size": _STEPS, "gamma": {"type": "number", "exclusiveMinimum": 0}}),
    "multistep": _family(
        "multistep",
        {
            "init": _NUMBER,
            "milestones": {"type": "array", "items": _STEPS, "description": "strictly increasing"},
            "gamma": {"type": "number", "exclusiveMinimum": 0},
        },
    ),
    "cosine": _family(
        "cosine",
        {"init": _NUMBER, "min_value": _NUMBER, "period": _STEPS},
        {"gamma": {"type": "number", "exclusiveMinimum": 0, "default": 1.0}},
    ),
    "cyclic": _family("cyclic", {"init": _NUMBER, "max_value": _NUMBER, "period_up": _STEPS, "period_down": _STEPS}),
    "warmup": _family("warmup", {"init": _NUMBER, "period": _STEPS, "then": _SEQ}),
    "piecewise": _family(
        "piecewise",
        {
            "pieces": {"type": "array", "items": _SEQ, "minItems": 1},
            "boundaries": {"type": "array", "items": _STEPS, "description": "one fewer than pieces, increasing"},
        },
    ),
    "segments": _family(
        "segments",
        {
            "segments": {
                "type": "array",
                "minItems": 1,
                "items": {"$ref": "#/components/schemas/Segment"},
            }
        },
    ),
}

SEGMENT = {
    "description": "[start, end (null: forever), kind, [dtype, ...params]]: the canonical form plan views give",
    "type": "array",
    "prefixItems": [
        {"type": "integer", "minimum": 0},
        {"type": ["integer", "null"], "minimum": 1},
        {"type": "string", "enum": ["const", "linear", "exp", "step", "cosine", "cyclic"]},
        {"type": "array", "minItems": 2, "maxItems": 5},
    ],
    "minItems": 4,
    "maxItems": 4,
}

SEQUENCE = {
    "description": "a hyper-parameter over training steps: a plain value (a constant), a family object, or "
    "canonical segments",
    "anyOf": [
        {"type": ["number", "string", "boolean"]},
        {"type": "array", "items": {"$ref": "#/components/schemas/Segment"}, "minItems": 1},
        {"oneOf": [{"$ref": f"#/components/schemas/Sequence_{k}"} for k in FAMILIES]},
    ],
}

FIXED_PART = {
    "description": "what must be equal for two trials to share anything: it names the search plan",
    "type": "object",
    "required": ["trainer"],
    "properties": {
        "trainer": {"type": "string", "minLength": 1, "maxLength": 128, "description": "module:Class"},
        "dataset": {"type": "string"},
        "model": {"type": "string"},
        "seed": {"type": "integer"},
        "values": {
            "type": "object",
            "additionalProperties": {"type": ["number", "string", "boolean", "null"]},
            "description": "fixed hyper-parameters",
        },
        "code_version": {"type": "string", "maxLength": 128},
    },
    "additionalProperties": False,
}

STUDY_FIXED = {
    **FIXED_PART,
    "description": "the study's default fixed part, and optionally its scheduling policies",
    "properties": {
        **FIXED_PART["properties"],  # type: ignore[dict-item]
        "policies": {"type": "object", "description": "the study's scheduling policies (docs/policies.md)"},
    },
}

TRIAL_CONFIG = {
    "description": "a trial: its fixed part (the study's when omitted) and one sequence per tuned hyper-parameter",
    "type": "object",
    "required": ["tuned"],
    "properties": {
        "fixed": {"$ref": "#/components/schemas/FixedPart"},
        "tuned": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": _SEQ,
            "description": "hyper-parameter name -> sequence",
        },
    },
}

METRIC_VALUE = {
    "description": 'a metric value; a non-finite one (a diverged loss) is the string "NaN", "Infinity" or '
    '"-Infinity" (gRPC carries the same values as doubles)',
    "anyOf": [{"type": "number"}, {"type": "string", "enum": list(NON_FINITE)}],
}

COMPONENTS: dict[str, dict[str, Any]] = {
    "Sequence": SEQUENCE,
    "Segment": SEGMENT,
    "FixedPart": FIXED_PART,
    "StudyFixed": STUDY_FIXED,
    "TrialConfig": TRIAL_CONFIG,
    "MetricValue": METRIC_VALUE,
    **{f"Sequence_{k}": v for k, v in FAMILIES.items()},
}


def _ref(name: str) -> WithJsonSchema:
    # under allOf: pydantic resolves a bare $ref with sibling keys (a description) among its own definitions
    return WithJsonSchema({"allOf": [{"$ref": f"#/components/schemas/{name}"}]})


# Typed in the spec; parsed (and judged) by the core.
TrialConfigJson = Annotated[dict[str, Any], _ref("TrialConfig")]
StudyFixedJson = Annotated[dict[str, Any], _ref("StudyFixed")]
MetricValue = Annotated[float, _ref("MetricValue")]


class ErrorOut(BaseModel):
    """Every error answer: the gRPC code's name, what to do, and for a 422 where the input was wrong."""

    error: str = Field(description="the status code's name (INVALID_ARGUMENT, NOT_FOUND, ...)")
    message: str
    detail: list[dict[str, Any]] | None = None
    retry_after_s: float | None = Field(None, description="with 429: when to come back (also the Retry-After header)")


_WHY: dict[int, str] = {
    401: "no token, or an unknown one",
    403: "the token may not do this (an admin call)",
    404: "no such study or request for this token's owner",
    409: "a name taken, or a client_request_id resent with other content",
    412: "not in a state to do it",
    413: "the body is over the size limit, or a batch over the item limit",
    422: "invalid input: which field and why",
    429: "the master is at its admission limit: retry after Retry-After seconds",
    503: "the database is unavailable: retry",
}
Status = Literal[401, 403, 404, 409, 412, 413, 422, 429, 503]


def responses(*statuses: Status) -> dict[int | str, dict[str, Any]]:
    """The error answers a route can give (FastAPI's ``responses=``): those listed plus 401, 422, 429 and
    503, which every authenticated route can give."""
    out: dict[int | str, dict[str, Any]] = {}
    for st in sorted({401, 422, 429, 503, *statuses}):
        entry: dict[str, Any] = {"model": ErrorOut, "description": _WHY[st]}
        if st == 429:
            entry["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
        out[st] = entry
    return out


def add_components(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec FastAPI generated, with the core's schemas added under ``components.schemas``."""
    spec.setdefault("components", {}).setdefault("schemas", {}).update(COMPONENTS)
    return spec
