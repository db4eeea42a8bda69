"""``stagetree.tune`` names a trainer class by the entry point the workers can import, and says what to
do where they cannot (a class inside a function, a notebook's class, a script without a main guard)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from stagetree.client.tune import entry_point_of, tune
from stagetree.core.errors import InvalidArgument
from stagetree.nodemanager.examples.digits import DigitsMLP


def test_a_class_of_a_module_is_its_module_and_name() -> None:
    assert entry_point_of(DigitsMLP) == "stagetree.nodemanager.examples.digits:DigitsMLP"
    assert entry_point_of("pkg.train:Net") == "pkg.train:Net"
    with pytest.raises(InvalidArgument, match=re.escape("did you mean 'pkg.train:Net'")):
        entry_point_of("pkg.train.Net")


def test_a_class_inside_a_function_says_to_move_it() -> None:
    class Inner(DigitsMLP):
        pass

    with pytest.raises(InvalidArgument, match="top level of a module"):
        entry_point_of(Inner)


def _main_class(monkeypatch: pytest.MonkeyPatch, main_file: Path | None) -> type:
    main = types.ModuleType("__main__")
    if main_file is not None:
        main.__file__ = str(main_file)
    monkeypatch.setitem(sys.modules, "__main__", main)
    return type("Local", (DigitsMLP,), {"__module__": "__main__"})


def test_a_notebook_class_says_to_write_it_to_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgument, match=re.escape("%%writefile mytrainer.py")):
        entry_point_of(_main_class(monkeypatch, None))


def test_a_script_class_is_the_script_s_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = tmp_path / "sweep.py"
    script.write_text('class Local: ...\nif __name__ == "__main__":\n    run()\n')
    assert entry_point_of(_main_class(monkeypatch, script)) == "sweep:Local"
    script.write_text("class Local: ...\nrun()\n")
    with pytest.raises(InvalidArgument, match=re.escape('if __name__ == "__main__":')):
        entry_point_of(_main_class(monkeypatch, script))


def test_tune_checks_its_arguments_before_starting_anything() -> None:
    with pytest.raises(InvalidArgument, match="metric"):
        tune(DigitsMLP, object(), "asha")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="search space"):
        tune(DigitsMLP, None, "asha", metric="acc")
