"""The trainer's code version: a digest of its module's source and the files the user lists."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stagetree.client.codeversion import code_digest, trainer_source
from stagetree.core.errors import InvalidArgument


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "mytrain.py").write_text("class Net:\n    width = 64\n")
    helpers = tmp_path / "helpers"
    helpers.mkdir()
    (helpers / "data.py").write_text("SPLIT = 0.8\n")
    (helpers / "__pycache__").mkdir()
    (helpers / "__pycache__" / "data.cpython-311.pyc").write_bytes(b"\x00junk")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mytrain", raising=False)
    return tmp_path


def test_the_digest_follows_the_trainers_source(project: Path) -> None:
    assert trainer_source("mytrain:Net") == project / "mytrain.py"
    first = code_digest("mytrain:Net")
    assert first is not None and first.startswith("src-") and first == code_digest("mytrain:Net")
    (project / "mytrain.py").write_text("class Net:\n    width = 128\n")
    assert code_digest("mytrain:Net") != first


def test_listed_files_and_directories_count_but_caches_do_not(project: Path) -> None:
    base = code_digest("mytrain:Net", [project / "helpers"])
    (project / "helpers" / "__pycache__" / "data.cpython-311.pyc").write_bytes(b"\x01other")
    assert code_digest("mytrain:Net", [project / "helpers"]) == base
    (project / "helpers" / "data.py").write_text("SPLIT = 0.9\n")
    assert code_digest("mytrain:Net", [project / "helpers"]) != base
    assert code_digest("mytrain:Net", [project / "helpers" / "data.py"]) != code_digest("mytrain:Net")
    with pytest.raises(InvalidArgument, match="neither a file nor a directory"):
        code_digest("mytrain:Net", [project / "missing"])


def test_a_trainer_this_process_cannot_see_has_no_digest() -> None:
    assert code_digest("no_such_package_xyz.train:Net") is None
    assert trainer_source("") is None
