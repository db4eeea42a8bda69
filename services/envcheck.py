"""A mistyped ``STAGETREE_*`` variable is an error at start, not a setting silently ignored.

The services read their settings with pydantic-settings (``STAGETREE_MASTER_``, ``STAGETREE_AGG_``,
``STAGETREE_NM_``; nested groups after ``__``), which ignores a variable it has no field for: a
``STAGETREE_MASTER_AUTH_TOKENS`` (one underscore where two are meant) would start a master with no
tokens. ``unknown_variables`` names every variable under a service's prefix that maps to no field,
with the closest real name; each service's entry point refuses to start on one. ``<NAME>_FILE`` (the
setting read from a file, ``stagetree.filevars``) is known whenever ``<NAME>`` is.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from pydantic import BaseModel


def setting_names(model: type[BaseModel], prefix: str, delimiter: str = "__") -> set[str]:
    """Every environment name a settings class reads: its fields, and its groups' fields after ``__``."""
    names: set[str] = set()
    for name, field in model.model_fields.items():
        full = f"{prefix}{name}".upper()
        names.add(full)
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            names |= setting_names(sub, f"{full}{delimiter}", delimiter)
    return names


def unknown_variables(model: type[BaseModel], prefix: str, environ: Mapping[str, str]) -> list[str]:
    """One message per variable under ``prefix`` that no field reads (a dict field takes any key below it)."""
    known = setting_names(model, prefix)
    out = []
    for var in sorted(environ):
        upper = var.upper()
        if not upper.startswith(prefix) or upper in known:
            continue
        base = upper.removesuffix("_FILE")  # the file variant of a setting (stagetree.filevars)
        if base in known or any(base.startswith(k + "__") for k in known):
            continue
        if any(upper.startswith(k + "__") for k in known):
            continue  # a key inside a dict field (STAGETREE_MASTER_AUTH__TOKENS__alice)
        close = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else f"; the {prefix}* settings are: {', '.join(sorted(known))}"
        out.append(f"{var} is not a setting{hint}")
    return out
