"""Workers find the user's trainer the way the user's script does, and say clearly when they cannot."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from stagetree.nodemanager.runtime.trainer import load_trainer_class
from stagetree.nodemanager.runtime.userpath import _realpath, trainer_import_problem, user_search_path

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


def test_a_module_file_resolves_as_realpath_resolves_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``users_modules`` resolves each directory once: the same answer as ``os.path.realpath`` for files
    in linked directories, linked files, ``..`` after a link, and paths relative to the working directory."""
    (tmp_path / "real" / "pkg").mkdir(parents=True)
    (tmp_path / "real" / "pkg" / "mod.py").write_text("")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "target.py").write_text("")
    (tmp_path / "linkdir").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "pkg" / "linked.py").symlink_to(tmp_path / "other" / "target.py")
    monkeypatch.chdir(tmp_path / "real")
    paths = [
        str(tmp_path / "linkdir" / "pkg" / "mod.py"),
        str(tmp_path / "linkdir" / "pkg" / "linked.py"),
        str(tmp_path / "linkdir" / "pkg" / ".." / "pkg" / "mod.py"),
        str(tmp_path / "real" / "pkg" / "mod.py"),
        os.path.join("pkg", "mod.py"),
        "pkg/linked.py",
    ]
    dirs: dict[str, str] = {}
    for _ in range(2):  # the second pass answers from the directories already resolved
        assert [_realpath(p, dirs) for p in paths] == [os.path.realpath(p) for p in paths]
