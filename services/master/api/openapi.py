"""What the REST spec (``/api/v1/openapi.json``) declares beyond what FastAPI derives from the routes.

This module owns the schemas of the JSON the core parses (a trial config, its fixed part, every sequence
family, metric values) and the error answers each route can give. The core stays the one place that
decides what is valid (``stagetree.core.config``, ``stagetree.core.sequences``); these schemas describe
the shapes it accepts, and ``tests/unit/master/test_openapi.py`` checks every family's ``to_json`` against
them, so a new family or field cannot be left out of the spec.

Where the server judges a text field (``core.text.check_text``: its length, no control character), the
spec says so with ``minLength``/``maxLength`` and a ``pattern`` (:func:`text`); where a limit is a setting
(a study name's length, the items of one submission), ``add_components`` writes this master's value.
Rules that JSON Schema cannot state are in the schema's ``description``, each worded as the server's
refusal words it (``CROSS_ITEM_RULES``): steps strictly increasing, one boundary fewer than pieces,
segments that cover [0, forever), and every value the master computes from a schedule within a float's
range (``MultiStep``'s ``init * gamma**i``, a warm-up's slope). Where a rule is stated by a stricter
schema than the core's check (a warm-up's ``then``: its first value numeric), every case the spec
allows is still one the server accepts.

Non-finite metric values (a diverged loss) are the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``
in every REST answer, as the store keeps them (JSON has no such numbers); gRPC carries the same values as
IEEE doubles, so both sides say the same thing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, WithJsonSchema

from stagetree.core.policies.study import POLICY_NAMES, POLICY_PARAMS
from stagetree.core.sequences import OVERFLOW
from stagetree.core.text import INT64_MAX
from stagetree.master.service import MAX_ID_LEN
from stagetree.master.settings import LimitSettings

__all__ = ["CROSS_ITEM_RULES", "MAX_ID_LEN", "add_components", "responses", "text"]

NON_FINITE = ("NaN", "Infinity", "-Infinity")

# core.text: no control character (C0 or DEL); a study name also needs one character that is not space
CONTROL_FREE = "^[^\\x00-\\x1f\\x7f]*$"
_SPACE = "\\x00-\\x20\\x7f\\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"  # str.isspace
NOT_BLANK = f"^[^\\x00-\\x1f\\x7f]*[^{_SPACE}][^\\x00-\\x1f\\x7f]*$"


def text(max_len: int, *, empty: bool = False, blank: bool = True) -> dict[str, Any]:
    """The schema of a text field ``core.text.check_text`` accepts (``blank=False``: not only spaces)."""
    return {"minLength": 0 if empty else 1, "maxLength": max_len, "pattern": CONTROL_FREE if blank else NOT_BLANK}


_NUMBER = {"type": "number"}
_STEPS = {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}
_SEQ = {"$ref": "#/components/schemas/Sequence"}
# a schedule inside another (a piece, a warm-up's then): a value or a family object; the canonical segment
# list is a top-level form only (core.config.Config.of reads it, core.sequences.from_json does not)
_PIECE = {"$ref": "#/components/schemas/Piece"}
_NUMERIC_PIECE = {"$ref": "#/components/schemas/NumericPiece"}

# what the server's refusal says (its 422 message holds the phrase) for each rule JSON Schema cannot state
CROSS_ITEM_RULES: dict[str, tuple[str, ...]] = {
    "segments cover [0, forever)": ("must cover [0, forever) without gaps", "gap or overlap at step"),
    "steps strictly increasing": ("must be strictly increasing",),
    "one boundary fewer than pieces": ("need one boundary fewer than pieces",),
    "values within a float's range": (OVERFLOW,),
}


_NAME = {"minLength": 1, "maxLength": 128}  # a hyper-parameter's name (core.config._check_name)


def _family(kind: str, required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    props = {"kind": {"type": "string", "enum": [kind]}, **required, **(optional or {})}
    return {"type": "object", "required": ["kind", *required], "properties": props, "additionalProperties": False}


_INCREASING = (
    "strictly increasing: a rule between items that JSON Schema cannot state (a 422 names the first step out of order)"
)
_IN_RANGE = (
    f"every value the master computes from it (init * gamma**i at the i-th milestone) must stay within a float's "
    f"range: a rule between fields that JSON Schema cannot state (a 422 says it {OVERFLOW})"
)

# one schema per sequence family, keyed by its "kind" (stagetree.core.sequences._FAMILIES)
FAMILIES: dict[str, dict[str, Any]] = {
    "constant": _family("constant", {"value": {"type": ["number", "string", "boolean"]}}),
    "linear": _family("linear", {"init": _NUMBER, "slope": _NUMBER}),
    "exponential": _family("exponential", {"init": _NUMBER, "gamma": {"type": "number", "exclusiveMinimum": 0}}),
    "step": _family("step", {"init": _NUMBER, "step_size": _STEPS, "gamma": {"type": "number", "exclusiveMinimum": 0}}),
    "multistep": {
        **_family(
            "multistep",
            {
                "init": _NUMBER,
                "milestones": {"type": "array", "items": _STEPS, "description": _INCREASING},
                "gamma": {"type": "number", "exclusiveMinimum": 0},
            },
        ),
        "description": _IN_RANGE,
    },
    "cosine": _family(
        "cosine",
        {"init": _NUMBER, "min_value": _NUMBER, "period": _STEPS},
        {"gamma": {"type": "number", "exclusiveMinimum": 0, "default": 1.0}},
    ),
    "cyclic": _family("cyclic", {"init": _NUMBER, "max_value": _NUMBER, "period_up": _STEPS, "period_down": _STEPS}),
    "warmup": {
        **_family(
            "warmup",
            {
                "init": _NUMBER,
                "period": {**_STEPS, "minimum": 0, "description": "0: no warm-up, the schedule is then's"},
                "then": {**_NUMERIC_PIECE, "description": "what follows the ramp: its first value is a number"},
            },
        ),
        "description": f"a linear ramp from init to then's first value; its slope must stay within a float's range "
        f"(a 422 says it {OVERFLOW})",
    },
    "piecewise": _family(
        "piecewise",
        {
            "pieces": {"type": "array", "items": _PIECE, "minItems": 1},
            "boundaries": {
                "type": "array",
                "items": _STEPS,
                "description": "one boundary fewer than pieces, strictly increasing: rules between items that JSON "
                "Schema cannot state (a 422 names the count or the first step out of order)",
            },
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

_NUM = {"type": "number"}
_STEPS = {"type": "integer", "minimum": 1}
_NUMERIC = {"type": "string", "enum": ["float", "int"]}
_ANY_DTYPE = {"type": "string", "enum": ["bool", "float", "int", "str"]}


def _params(*items: dict[str, Any], dtype: dict[str, Any] = _ANY_DTYPE) -> dict[str, Any]:
    """A segment's params: its value type, then the kind's parameters (core.sequences.segments_from_json)."""
    n = len(items) + 1
    return {"type": "array", "prefixItems": [dtype, *items], "minItems": n, "maxItems": n}


def _segment(kinds: list[str], params: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "array",
        "prefixItems": [
            {"type": "integer", "minimum": 0},
            {"type": ["integer", "null"], "minimum": 1},
            {"type": "string", "enum": kinds},
            params,
        ],
        "minItems": 4,
        "maxItems": 4,
    }


SEGMENT = {
    "description": "[start, end (null: forever), kind, [dtype, ...params]]: the canonical form plan views give. "
    "A list of segments must cover [0, forever) in order, each starting where the one before ends (a 422 "
    "names the gap or overlap): a constraint between items that JSON Schema cannot state",
    "oneOf": [
        _segment(["const"], _params(_NUM, dtype=_NUMERIC)),
        _segment(["const"], _params({"type": ["string", "boolean", "number"]}, dtype={"enum": ["bool", "str"]})),
        _segment(["linear", "exp"], _params(_NUM, _NUM)),
        _segment(["step"], _params(_NUM, _STEPS, _NUM)),
        _segment(["cosine"], _params(_NUM, _NUM, _STEPS, _NUM)),
        _segment(["cyclic"], _params(_NUM, _NUM, _STEPS, _STEPS)),
    ],
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

PIECE = {
    "description": "a schedule inside another (a piece of a piecewise): a plain value or a family object",
    "anyOf": [
        {"type": ["number", "string", "boolean"]},
        {"oneOf": [{"$ref": f"#/components/schemas/Sequence_{k}"} for k in FAMILIES]},
    ],
}

# the families whose first value may be a string or a bool, restated with a numeric one (a warm-up ramps
# into a number: core.sequences.Warmup)
_NUMERIC_SEGMENT = {
    "allOf": [
        {"$ref": "#/components/schemas/Segment"},
        {"prefixItems": [{"const": 0}, True, True, {"prefixItems": [{"enum": ["float", "int"]}]}]},
    ]
}
NUMERIC_FAMILIES: dict[str, dict[str, Any]] = {
    "constant": _family("constant", {"value": _NUMBER}),
    "piecewise": {
        "allOf": [
            {"$ref": "#/components/schemas/Sequence_piecewise"},
            {"properties": {"pieces": {"prefixItems": [_NUMERIC_PIECE]}}},
        ]
    },
    "segments": {
        "allOf": [
            {"$ref": "#/components/schemas/Sequence_segments"},
            {"properties": {"segments": {"prefixItems": [_NUMERIC_SEGMENT]}}},
        ]
    },
}

NUMERIC_PIECE = {
    "description": "a schedule whose first value is a number: a number or a family object (a constant of a "
    "number; a piecewise whose first piece is one; segments whose first starts at 0 with type float or int)",
    "anyOf": [
        _NUMBER,
        {
            "oneOf": [
                {"$ref": f"#/components/schemas/NumericSequence_{k}"}
                if k in NUMERIC_FAMILIES
                else {"$ref": f"#/components/schemas/Sequence_{k}"}
                for k in FAMILIES
            ]
        },
    ],
}

_MORE = "(\\.[A-Za-z_][A-Za-z0-9_]*)*"  # more dotted names

FIXED_PART = {
    "description": "what must be equal for two trials to share anything: it names the search plan",
    "type": "object",
    "required": ["trainer"],
    "properties": {
        "trainer": {
            "type": "string",
            "minLength": 1,
            "maxLength": 128,
            # core.entrypoints in ASCII, the module not starting with "_" (so never __main__)
            "pattern": f"^[A-Za-z][A-Za-z0-9_]*{_MORE}:[A-Za-z_][A-Za-z0-9_]*{_MORE}$",
            "description": "the trainer's entry point, package.module:Class",
        },
        "dataset": {"type": "string"},
        "model": {"type": "string"},
        "seed": {"type": "integer"},
        "values": {
            "type": "object",
            "propertyNames": _NAME,
            "additionalProperties": {"type": ["number", "string", "boolean", "null"]},
            "description": "fixed hyper-parameters",
        },
        "code_version": {"type": "string", "maxLength": 128},
    },
    "additionalProperties": False,
}

# a study's policies (core.policies.live.parse_policies); a bound the core states between two fields
# (compute <= 100 * oversub, y_max > y_min) is written as a stricter one on each field
_PARAM_BOUNDS: dict[str, dict[str, dict[str, Any]]] = {
    "time_share_params": {
        "quantum_s": {"exclusiveMinimum": 0},
        "growth": {"minimum": 1},
        "eval_every": {"minimum": 1},
        "g_thres": {"minimum": 1},
    },
    "placement_params": {
        "compute": {"exclusiveMinimum": 0, "maximum": 100, "description": "at most 100 * oversub"},
        "memory_bytes": {"minimum": 0},
        "cpus": {"minimum": 0},
        "oversub": {"minimum": 1},
    },
    "search_params": {
        "t_max_s": {"exclusiveMinimum": 0},
        "eval_every": {"minimum": 1},
        "report_every": {"minimum": 1},
        "k": {"minimum": 1},
        "max_epochs": {"minimum": 0, "description": "0: none; earlyterm needs one >= 1"},
        "y_min": {"maximum": 0, "description": "below y_max"},
        "y_max": {"exclusiveMinimum": 0, "description": "above y_min"},
    },
}
_JSON_TYPES = {float: {"type": "number"}, int: {"type": "integer"}, str: {"type": "string"}}


def _param_schema(group: str, name: str, kind: type) -> dict[str, Any]:
    base = {"type": "array", "items": {"type": "number"}} if kind is list else dict(_JSON_TYPES[kind])
    return {**base, **_PARAM_BOUNDS.get(group, {}).get(name, {})}


def _policies() -> dict[str, Any]:
    props: dict[str, Any] = {k: {"enum": [*names, None]} for k, names in POLICY_NAMES.items()}
    for group, params in POLICY_PARAMS.items():
        props[group] = {
            "type": "object",
            "properties": {n: _param_schema(group, n, t) for n, t in params.items()},
            "additionalProperties": False,
        }
    props["slots"] = {"type": "integer", "minimum": 1, "description": "slots per batch (data parallel)"}
    return {
        "type": "object",
        "description": "the study's scheduling policies (docs/policies.md)",
        "properties": props,
        "additionalProperties": False,
        # a step's parameters need the step; earlyterm predicts at max_epochs, so it needs one
        "dependentSchemas": {
            f"{step}_params": {"required": [step], "properties": {step: {"type": "string"}}}
            for step in ("time_share", "placement", "search")
        },
        "allOf": [
            {
                "if": {"properties": {"search": {"const": "earlyterm"}}, "required": ["search"]},
                "then": {
                    "required": ["search_params"],
                    "properties": {
                        "search_params": {"required": ["max_epochs"], "properties": {"max_epochs": {"minimum": 1}}}
                    },
                },
            },
            {  # a width policy shapes the qos step's grants: it needs a qos class
                "if": {"properties": {"width": {"type": "string"}}, "required": ["width"]},
                "then": {"required": ["qos"], "properties": {"qos": {"type": "string"}}},
            },
        ],
    }


STUDY_FIXED = {
    **FIXED_PART,
    "description": "the study's default fixed part, and optionally its scheduling policies",
    "properties": {
        **FIXED_PART["properties"],  # type: ignore[dict-item]
        "policies": _policies(),
    },
}

TRIAL_CONFIG = {
    "description": "a trial: its fixed part (the study's when omitted) and one sequence per tuned hyper-parameter",
    "type": "object",
    "required": ["tuned"],
    "properties": {
        "fixed": {"anyOf": [{"$ref": "#/components/schemas/FixedPart"}, {"type": "null"}]},
        "tuned": {
            "type": "object",
            "minProperties": 1,
            "propertyNames": _NAME,
            "additionalProperties": _SEQ,
            "description": "hyper-parameter name -> sequence",
        },
    },
    "additionalProperties": False,
}

METRIC_VALUE = {
    "description": 'a metric value; a non-finite one (a diverged loss) is the string "NaN", "Infinity" or '
    '"-Infinity" (gRPC carries the same values as doubles)',
    "anyOf": [{"type": "number"}, {"type": "string", "enum": list(NON_FINITE)}],
}

COMPONENTS: dict[str, dict[str, Any]] = {
    "Sequence": SEQUENCE,
    "Piece": PIECE,
    "NumericPiece": NUMERIC_PIECE,
    "Segment": SEGMENT,
    "FixedPart": FIXED_PART,
    "StudyFixed": STUDY_FIXED,
    "TrialConfig": TRIAL_CONFIG,
    "MetricValue": METRIC_VALUE,
    **{f"Sequence_{k}": v for k, v in FAMILIES.items()},
    **{f"NumericSequence_{k}": v for k, v in NUMERIC_FAMILIES.items()},
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


def add_components(spec: dict[str, Any], limits: LimitSettings) -> dict[str, Any]:
    """The spec FastAPI generated, with the core's schemas added under ``components.schemas``, this
    master's limits written in, and every integer's bounds exact."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(COMPONENTS)
    if "StudyIn" in schemas:
        schemas["StudyIn"]["properties"]["name"]["maxLength"] = limits.max_name_len
    if "SubmitIn" in schemas:
        schemas["SubmitIn"]["properties"]["items"]["maxItems"] = limits.max_batch_items
    _exact_integer_bounds(spec)
    return spec


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _exact_integer_bounds(node: Any) -> None:
    """FastAPI's OpenAPI model types every bound as a float: past 2**53 that rounds (INT64_MAX became
    2**63, and a fuzzer drew 2**63 as valid). An integer's bounds are integers; the only one past 2**53
    any route declares is INT64_MAX."""
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
            for key in _BOUNDS:
                v = node.get(key)
                if isinstance(v, float):
                    node[key] = INT64_MAX if v >= float(INT64_MAX) else int(v)
        for v in node.values():
            _exact_integer_bounds(v)
    elif isinstance(node, list):
        for v in node:
            _exact_integer_bounds(v)
