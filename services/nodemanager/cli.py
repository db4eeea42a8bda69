"""Command line of the node manager: ``stagetree nodemanager run`` (argparse).

Settings come from ``STAGETREE_NM_*`` variables (``settings.NodeManagerSettings``); the flags below
override the common ones. The admin token is read from ``STAGETREE_NM_ADMIN_TOKEN`` only, never from a
flag (a flag shows in ``ps``). ``main(argv)`` prints and returns an exit status instead of raising:
0 after a clean stop (SIGINT/SIGTERM), 1 when the master refuses the node manager (a wrong token) or
the machine cannot run it as configured, 2 for bad settings.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from pydantic import ValidationError

from stagetree import logs
from stagetree.core.errors import StagetreeError
from stagetree.envcheck import unknown_variables


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagetree nodemanager", description="stagetree node manager")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run the node manager (settings from STAGETREE_NM_* variables; the flags override them)",
        description="Run the node manager until SIGINT/SIGTERM. The admin token comes from STAGETREE_NM_ADMIN_TOKEN.",
    )
    run.add_argument("--master", dest="master_target", help="the master's gRPC address, host:port")
    run.add_argument("--id", dest="node_manager_id", help="node manager id (default: the host name)")
    run.add_argument("--checkpoint-root", help="checkpoint directory, local or shared")
    run.add_argument("--work-dir", help="worker logs and MPS state")
    run.add_argument("--cpu-slots", type=int, help="slots when there is no GPU")
    run.add_argument("--slots-per-gpu", type=int, help="slots per GPU (each gets 1/N of it)")
    run.add_argument("--threads", dest="threads_per_worker", type=int, help="torch threads per worker")
    run.add_argument("--mps", action=argparse.BooleanOptionalAction, default=None, help="start an MPS daemon")
    run.add_argument("--no-prestart", dest="prestart_workers", action="store_false", default=None)
    run.add_argument("--log-level", default="INFO")
    return p


def _overrides(ns: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "master_target",
        "node_manager_id",
        "checkpoint_root",
        "work_dir",
        "cpu_slots",
        "slots_per_gpu",
        "threads_per_worker",
        "mps",
        "prestart_workers",
    )
    return {k: getattr(ns, k) for k in keys if getattr(ns, k) is not None}


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logs.configure(ns.log_level)

    from stagetree.nodemanager.app import build_node_manager
    from stagetree.nodemanager.settings import NodeManagerSettings

    bad = unknown_variables(NodeManagerSettings, "STAGETREE_NM_", os.environ)
    if bad:
        print("error: " + "\n       ".join(bad), file=sys.stderr)
        return 2
    try:
        settings = NodeManagerSettings(**_overrides(ns))
    except ValidationError as e:
        print(f"error: bad node manager settings (STAGETREE_NM_* or flags):\n{e}", file=sys.stderr)
        return 2
    if not settings.admin_token.get_secret_value():
        print(
            "error: no admin token; set STAGETREE_NM_ADMIN_TOKEN to the master's admin token "
            "(its STAGETREE_MASTER_AUTH__ADMIN_TOKEN)",
            file=sys.stderr,
        )
        return 2

    async def serve() -> None:
        nm = build_node_manager(settings)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await nm.run(stop)

    try:
        asyncio.run(serve())
    except StagetreeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
