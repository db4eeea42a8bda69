"""Settings from the environment and the command line's failure modes (no broker needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from stagetree import cli as stagetree_cli
from stagetree.aggregator import cli
from stagetree.aggregator.settings import AggregatorSettings
from stagetree.bus.messages import ALL_TOPICS


def test_settings_come_from_prefixed_and_nested_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGETREE_AGG_DATABASE_URL", "postgresql+psycopg2://u@h/db")
    monkeypatch.setenv("STAGETREE_AGG_GROUP_ID", "aggs")
    monkeypatch.setenv("STAGETREE_AGG_BATCH__MAX_RECORDS", "123")
    monkeypatch.setenv("STAGETREE_AGG_KAFKA__SESSION_TIMEOUT_MS", "6000")
    s = AggregatorSettings()
    assert (s.database_url, s.group_id, s.batch.max_records, s.kafka.session_timeout_ms) == (
        "postgresql+psycopg2://u@h/db",
        "aggs",
        123,
        6000,
    )
    assert s.topics == list(ALL_TOPICS) and s.redis_url is None


def test_a_heartbeat_not_below_the_session_timeout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGETREE_AGG_KAFKA__HEARTBEAT_INTERVAL_MS", "20000")
    with pytest.raises(ValidationError, match="heartbeat_interval_ms"):
        AggregatorSettings()


def test_an_old_schema_is_refused_with_the_command_that_fixes_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STAGETREE_AGG_DATABASE_URL", f"sqlite:///{tmp_path / 'empty.db'}")
    assert cli.main(["run"]) == 1
    assert "stagetree master db upgrade --url" in capsys.readouterr().err


def test_the_main_command_dispatches_to_the_aggregator(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        stagetree_cli.main(["aggregator", "run", "--help"])
    assert exit_.value.code == 0
    assert "usage: stagetree aggregator run" in capsys.readouterr().out
