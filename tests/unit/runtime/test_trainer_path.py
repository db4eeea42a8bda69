"""Workers find the user's trainer the way the user's script does, and say clearly when they cannot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stagetree.nodemanager.runtime.trainer import load_trainer_class
from stagetree.nodemanager.runtime.userpath import trainer_import_problem, user_search_path

TRAINER = "from stagetree.nodemanager.examples.digits import DigitsMLP\n\nclass Mine(DigitsMLP):\n    pass\n"


def test_the_user_path_comes_first_then_pythonpath() -> None:
    env = {"STAGETREE_USER_PATH": "/a:/b", "PYTHONPATH": "/b:/c"}
    assert user_search_path(env) == ["/a", "/b", "/c"]


def test_a_trainer_in_the_user_path_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_lonely_trainer.py").write_text(TRAINER)
    monkeypatch.setenv("STAGETREE_USER_PATH", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_lonely_trainer", raising=False)
    assert trainer_import_problem("my_lonely_trainer:Mine", [str(tmp_path)]) is None
    assert load_trainer_class("my_lonely_trainer:Mine").__name__ == "Mine"


def test_a_missing_module_names_itself_the_path_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    problem = trainer_import_problem("nowhere_xyz.train:Net", ["/tmp/nothing-here"])
    assert problem is not None and "no module named 'nowhere_xyz'" in problem and "/tmp/nothing-here" in problem
    with pytest.raises(ModuleNotFoundError) as err:
        load_trainer_class("nowhere_xyz.train:Net")
    text = str(err.value)
    assert "no module named 'nowhere_xyz' on the worker's search path" in text and "PYTHONPATH" in text


def test_a_class_the_module_does_not_define_is_refused_at_creation(tmp_path: Path) -> None:
    (tmp_path / "my_lonely_trainer2.py").write_text(TRAINER)
    assert trainer_import_problem("my_lonely_trainer2:Mine", [str(tmp_path)]) is None
    problem = trainer_import_problem("my_lonely_trainer2:Missing", [str(tmp_path)])
    assert problem is not None and "defines no 'Missing'" in problem and "Mine" in problem
