"""The ``stagetree`` command: one entry point that hands each command group to the module that owns it.

Each group module exposes ``main(argv: list[str] | None) -> int`` and is imported only when its
command runs, so ``stagetree study list`` does not import torch or SQLAlchemy.
"""

from __future__ import annotations

import importlib
import sys

# command -> the extra whose packages it needs beyond the base install (the client SDK)
EXTRAS = {
    "up": "embedded",
    "master": "master",
    "nodemanager": "nodemanager",
    "aggregator": "aggregator",
    "cluster": "all",
}

# command -> (module, whether the command word itself is passed on, one-line help)
GROUPS: dict[str, tuple[str, bool, str]] = {
    "up": ("stagetree.embedded", False, "run master, aggregator and one node manager in this process (no servers)"),
    "master": ("stagetree.master.cli", False, "master: db upgrade | db check | serve"),
    "nodemanager": ("stagetree.nodemanager.cli", False, "node manager: run"),
    "aggregator": ("stagetree.aggregator.cli", False, "aggregator: run"),
    "study": ("stagetree.client.cli", True, "studies: list | show | best | stats | delete"),
    "plan": ("stagetree.client.cli", True, "plans: show (the stage tree as text) | forget"),
    "hosts": ("stagetree.client.cli", True, "the hosts: node managers and their slots"),
    "nodes": ("stagetree.client.cli", True, "deprecated: `hosts` (removed in the next release)"),
    "cluster": ("stagetree.cluster", False, "cluster up: master, aggregators, node managers as local processes"),
}


def version() -> str:
    """The installed distribution's version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("stagetree")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed)"


def usage() -> str:
    lines = ["usage: stagetree <command> [args...]", "", "commands:"]
    lines += [f"  {name:<12} {hlp}" for name, (_, _, hlp) in GROUPS.items()]
    lines += ["", "Run `stagetree <command> --help` for a command's options; `stagetree --version` for the version."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version", "version"):
        print(f"stagetree {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in GROUPS:
        print(f"stagetree: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, keep_word, _ = GROUPS[name]
    try:
        mod = importlib.import_module(module)
        result: int = mod.main([name, *rest] if keep_word else rest)
    except ModuleNotFoundError as e:
        if (e.name or "stagetree").split(".")[0] == "stagetree":
            raise  # our own module missing: a broken install, not a missing extra
        extra, package = EXTRAS.get(name, "all"), (e.name or "").split(".")[0]
        print(
            f"stagetree {name}: this install lacks the package {package!r}, which the {extra!r} extra brings:\n"
            f"    pip install 'stagetree[{extra}]'",
            file=sys.stderr,
        )
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
