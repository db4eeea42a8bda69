"""``core.text.json_depth`` counts nesting without parsing: equal to the parsed document's depth for any
JSON (brackets and escaped quotes inside strings included), in both str and bytes, and in linear time on
documents far deeper than any parser's recursion limit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagetree.core.errors import InvalidArgument
from stagetree.core.text import MAX_JSON_DEPTH, check_json_depth, json_depth

_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(alphabet='[]{}"\\ab\n')
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet='[]{}"\\k'), inner, max_size=4),
    max_leaves=30,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@given(_JSON, st.booleans())
def test_the_count_is_the_parsed_documents_depth(value: Any, ascii_only: bool) -> None:
    doc = json.dumps(value, ensure_ascii=ascii_only)
    assert json_depth(doc) == _depth(value)
    assert json_depth(doc.encode()) == _depth(value)


def test_a_document_past_any_recursion_limit_is_counted_and_refused_naming_the_limit() -> None:
    deep = "[" * 200_000 + "]" * 200_000
    assert json_depth(deep) == 200_000
    with pytest.raises(InvalidArgument, match=f"200000 levels deep is over the limit of {MAX_JSON_DEPTH}"):
        check_json_depth(deep, "fixed")
    check_json_depth("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "fixed")  # at the limit: fine
    assert json_depth('["' + "[" * 10_000 + '"]') == 1  # inside a string: not nesting
    assert json_depth("[[[") == 3  # malformed JSON gets a count; its parser refuses it later


def test_the_rest_guide_states_the_limit() -> None:
    guide = (Path(__file__).parents[3] / "docs" / "rest-ci.md").read_text()
    assert f"more than {MAX_JSON_DEPTH} levels deep" in " ".join(guide.split())
