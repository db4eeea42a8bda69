"""A trainer entry point's form is checked where it enters, with the fix in the message; its class is
checked against the module's source where that source is visible (read, never imported)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagetree.core.entrypoints import check_entry_point
from stagetree.core.errors import InvalidArgument
from stagetree.entrypoint_source import missing_class, module_file


@pytest.mark.parametrize("ok", ["quickstart:Net", "pkg.train:Net", "pkg.train:Outer.Inner", "_p:_T"])
def test_entry_points_of_the_right_form_pass(ok: str) -> None:
    assert check_entry_point(ok) == ok


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("quickstart.Net", "did you mean 'quickstart:Net'"),
        ("pkg.train.Net", "did you mean 'pkg.train:Net'"),
        ("Net", "'package.module:Class'"),
        ("pkg.train:", "'package.module:Class'"),
        ("pkg-x:Net", "'package.module:Class'"),
        ("", "entry point"),
        ("__main__:Local", "pass 'trainer:Local'"),
    ],
)
def test_a_wrong_form_says_how_to_write_it(bad: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        check_entry_point(bad, "fixed.trainer")
    assert says in e.value.message and e.value.message.startswith("fixed.trainer: ")


def test_a_missing_class_is_found_in_the_source_without_running_it(tmp_path: Path) -> None:
    (tmp_path / "mytrainer.py").write_text(
        "raise SystemExit('importing this module is a bug')\n"
        "import torch as T\nclass Net: pass\nclass Other(Net): pass\n"
        "if True:\n    class Guarded: pass\ntry:\n    Alias = Net\nexcept ImportError:\n    pass\n"
    )
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('nor this one')\n")
    (tmp_path / "pkg" / "train.py").write_text("from os import *\n")
    source = module_file("mytrainer", [str(tmp_path)])
    assert source == tmp_path / "mytrainer.py"
    for name in ("Net", "Other", "Guarded", "Alias", "T", "Net.Inner"):
        assert missing_class(source, name) is None, name
    problem = missing_class(source, "Missing")
    assert problem is not None and "defines no 'Missing'" in problem and "Net, Other" in problem
    star = module_file("pkg.train", [str(tmp_path)])
    assert star == tmp_path / "pkg" / "train.py" and missing_class(star, "Anything") is None  # a star: unknown
    assert module_file("no_such_module_xyz", [str(tmp_path)]) is None
