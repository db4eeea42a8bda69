"""``stagetree master db upgrade`` / ``db check`` on a real database, and the refusal message of an old schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagetree.master.cli import main


def test_db_check_refuses_then_upgrade_fixes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["db", "check", "--url", url]) == 1
    assert f"stagetree master db upgrade --url {url}" in capsys.readouterr().err
    assert main(["db", "upgrade", "--url", url]) == 0
    assert main(["db", "check", "--url", url]) == 0
    assert main(["db", "upgrade", "--url", url]) == 0  # idempotent


def test_db_upgrade_on_postgres(pg_url: str) -> None:
    assert main(["db", "upgrade", "--url", pg_url]) == 0
    assert main(["db", "check", "--url", pg_url]) == 0
