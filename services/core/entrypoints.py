"""Trainer entry points: ``"package.module:Class"``, the fixed part's ``trainer``.

This module owns the check of an entry point's form, made where it enters (the SDK before any call, the
master's use cases for REST and gRPC alike): a module path, a colon, a class path. A wrong form is an
``InvalidArgument`` that names the fix (``"quickstart.Net"`` -> ``"quickstart:Net"``). ``__main__`` is
refused too: the workers import the trainer in processes of their own, whose ``__main__`` is not the user's
script or notebook. Whether the module and class exist is for whoever can see the user's code (the SDK
where the module is on its path, the embedded master, the node manager at the first batch).
"""

from __future__ import annotations

import re
from typing import Any

from stagetree.core.errors import InvalidArgument

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
ENTRY_POINT = re.compile(rf"(?P<module>{_DOTTED}):(?P<attr>{_DOTTED})")
MAX_LEN = 128


def check_entry_point(text: Any, what: str = "trainer") -> str:
    """``text`` when it is an entry point ``"package.module:Class"``; else an ``InvalidArgument`` saying
    how to write it."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgument(f"{what}: must be the trainer's entry point 'package.module:Class', got {text!r}")
    if len(text) > MAX_LEN:
        raise InvalidArgument(f"{what}: an entry point of at most {MAX_LEN} characters, got {len(text)}")
    m = ENTRY_POINT.fullmatch(text)
    if m is None:
        hint = ""
        if ":" not in text and re.fullmatch(_DOTTED, text) and "." in text:
            module, _, cls = text.rpartition(".")
            hint = f"; did you mean {module + ':' + cls!r}?"
        raise InvalidArgument(
            f"{what}: {text!r} is not an entry point: write the module, a colon, then the class, as in "
            f"'package.module:Class'{hint}"
        )
    if m["module"] == "__main__" or m["module"].startswith("__main__."):
        raise InvalidArgument(
            f"{what}: {text!r} names a class of __main__ (your script or notebook), which the workers cannot "
            "import: they run in processes of their own. Put the class in a module file next to your script or "
            f"notebook (e.g. trainer.py) and pass 'trainer:{m['attr']}'"
        )
    return text
