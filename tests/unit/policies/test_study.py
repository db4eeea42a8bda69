"""A study's choice of the four papers' policies (``core.policies.study``): validation, defaults, and
the names each step accepts."""

from __future__ import annotations

import pytest

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.study import parse_policies


def test_parse_policies_round_trips_and_fills_defaults() -> None:
    p = parse_policies(
        {
            "time_share": "hermes",
            "time_share_params": {"quantum_s": 2, "eval_every": 10},
            "placement": "wfd",
            "placement_params": {"compute": 40},
            "qos": "urgent",
            "order": "critical_path",
        }
    )
    assert p.time_share is not None and p.time_share.quantum_s == 2.0 and p.time_share.eval_every == 10
    assert p.placement is not None and p.placement.compute == 40.0 and p.placement.oversub == 1.0
    assert p.qos == "urgent" and p.order == "critical_path"
    assert parse_policies(p.to_json()) == p


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        ({"time_share": "lottery"}, "valid: ['fifo', 'hermes', 'rr', 'slaq']"),
        ({"placement": "best_fit"}, "'wfd'"),
        ({"qos": "asap"}, "'urgent', 'prior', 'normal'"),
        ({"order": "random"}, "critical_path"),
        ({"pacing": "x"}, "unknown keys ['pacing']"),
        ({"time_share_params": {"quantum_s": 1}}, "without policies.time_share"),
        ({"time_share": "hermes", "time_share_params": {"quantum": 1}}, "unknown parameters ['quantum']"),
        ({"time_share": "hermes", "time_share_params": {"quantum_s": "1"}}, "must be a float"),
        ({"time_share": "hermes", "time_share_params": {"quantum_s": 0}}, "quantum_s > 0"),
        ({"placement": "wf", "placement_params": {"compute": 150}}, "compute <= 100 * oversub"),
        ([], "must be an object"),
    ],
)
def test_parse_policies_rejects_with_the_valid_names(obj: object, says: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        parse_policies(obj)
    assert says in e.value.message


def test_search_policies_validate_through_pop_config() -> None:
    p = parse_policies({"search": "pop", "search_params": {"target": 0.9, "kill_threshold": 0.5, "eval_every": 4}})
    assert p.search is not None and p.search.config().kill_threshold == 0.5
    assert parse_policies(p.to_json()) == p
    with pytest.raises(InvalidArgument, match="valid: \\['bandit', 'default', 'earlyterm', 'pop'\\]"):
        parse_policies({"search": "hyperband"})
    with pytest.raises(InvalidArgument, match=r"earlyterm needs PopConfig\.max_epochs"):
        parse_policies({"search": "earlyterm"})
    with pytest.raises(InvalidArgument, match="y_max > y_min"):
        parse_policies({"search": "pop", "search_params": {"y_min": 1.0, "y_max": 0.5}})


def test_a_qos_study_names_how_its_batches_widths_are_chosen() -> None:
    p = parse_policies({"qos": "prior", "width": "maxocc", "slots": 4})
    assert p.width == "maxocc" and p.to_json() == {"slots": 4, "qos": "prior", "width": "maxocc"}
    assert parse_policies(p.to_json()) == p
    assert parse_policies({"qos": "normal"}).width == "genie"
    with pytest.raises(InvalidArgument, match=r"given without policies\.qos"):
        parse_policies({"width": "maxocc"})
    with pytest.raises(InvalidArgument, match="valid: \\['cerpre', 'genie', 'maxocc', 'minocc', 'perfpre'\\]"):
        parse_policies({"qos": "prior", "width": "widest"})
