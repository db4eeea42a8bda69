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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from stagetree import logs
from stagetree.core.errors import StagetreeError
from stagetree.envcheck import unknown_variables

if TYPE_CHECKING:
    from stagetree.nodemanager.settings import NodeManagerSettings


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
    sim = sub.add_parser(
        "simulate",
        help="run a fleet of simulated node managers (real protocol, workers that do no math)",
        description="Run COUNT simulated node managers in this process against the master (settings from "
        "STAGETREE_NM_* as for run: master, token, Kafka). Their workers take STEP_S seconds per step on a "
        "speed-1 GPU and report a synthetic loss; for load tests and tests.bench.scale.",
    )
    sim.add_argument("--master", dest="master_target", help="the master's gRPC address, host:port")
    sim.add_argument("--count", type=int, default=10, help="node managers (default 10)")
    sim.add_argument("--gpus", type=int, default=8, help="GPU slots per node manager (default 8)")
    sim.add_argument(
        "--gpu-types", default="A100:1.0", help="GPU types and speeds, round-robin over node managers (A100:1,V100:0.5)"
    )
    sim.add_argument("--step-s", type=float, default=0.1, help="seconds per step on a speed-1 GPU (default 0.1)")
    sim.add_argument("--prefix", default="sim", help="node manager ids are PREFIX-0, PREFIX-1, ...")
    sim.add_argument("--activity-out", help="at exit, write each slot's busy intervals here (JSON lines)")
    sim.add_argument("--log-level", default="WARNING")
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
    return {k: getattr(ns, k) for k in keys if getattr(ns, k, None) is not None}


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logs.configure(ns.log_level)
    if ns.command == "simulate":
        return _simulate(ns)

    from stagetree.nodemanager.app import build_node_manager

    settings = _settings(ns)
    if settings is None:
        return 2

    async def serve() -> None:
        nm = build_node_manager(settings)
        if settings.metrics_port is not None:
            from stagetree.nodemanager import metrics

            port = metrics.serve(settings.metrics_port, settings.metrics_host)
            print(f"node manager metrics at http://{settings.metrics_host}:{port}/metrics", flush=True)
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


def _settings(ns: argparse.Namespace) -> NodeManagerSettings | None:
    """The settings from the environment and flags; None (after saying why) when they are bad."""
    from stagetree.nodemanager.settings import NodeManagerSettings

    bad = unknown_variables(NodeManagerSettings, "STAGETREE_NM_", os.environ)
    if bad:
        print("error: " + "\n       ".join(bad), file=sys.stderr)
        return None
    try:
        settings = NodeManagerSettings(**_overrides(ns))
    except ValidationError as e:
        print(f"error: bad node manager settings (STAGETREE_NM_* or flags):\n{e}", file=sys.stderr)
        return None
    if not settings.admin_token.get_secret_value():
        print(
            "error: no admin token; set STAGETREE_NM_ADMIN_TOKEN to the master's admin token "
            "(its STAGETREE_MASTER_AUTH__ADMIN_TOKEN)",
            file=sys.stderr,
        )
        return None
    return settings


def _simulate(ns: argparse.Namespace) -> int:
    from stagetree.nodemanager import simulated as sim
    from stagetree.nodemanager.link import GrpcMasterLink, MasterLink
    from stagetree.nodemanager.reporting import BatchReporter, BusReporter, GrpcReporter

    settings = _settings(ns)
    if settings is None:
        return 2
    try:
        types = sim.GpuType.parse_list(ns.gpu_types)
        if ns.count < 1 or ns.gpus < 1 or not ns.step_s > 0:
            raise StagetreeError("--count and --gpus must be at least 1, --step-s above 0")
    except StagetreeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    fleet_spec = sim.FleetSpec(
        ns.count, ns.gpus, types, ns.prefix, sim.SimulationModel(step_s=ns.step_s), settings.heartbeat_interval_s
    )

    async def serve() -> None:
        b = settings.bus
        kafka = None
        if b.kafka_bootstrap_servers:
            from stagetree.bus.kafka import KafkaBusConfig, KafkaMetricBus

            kafka = KafkaMetricBus(KafkaBusConfig(b.kafka_bootstrap_servers, client_id=f"stagetree-{ns.prefix}"))

        def link() -> MasterLink:
            token = settings.admin_token.get_secret_value()
            return GrpcMasterLink(settings.master_target, token, rpc_timeout_s=settings.rpc_timeout_s)

        def reporter(lk: MasterLink, nm_id: str) -> BatchReporter:
            if kafka is None:
                return GrpcReporter(lk, node_manager_id=nm_id, max_backoff_s=settings.reconnect_max_s)
            return BusReporter(kafka, nm_id, max_messages=b.batch_max_messages, max_age_s=b.batch_max_age_s)

        activity = sim.SlotActivity()
        fleet = sim.build_fleet(fleet_spec, link, reporter, activity)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"simulating {ns.count} node managers x {ns.gpus} GPUs ({ns.gpu_types})", flush=True)
        try:
            out = Path(ns.activity_out) if ns.activity_out else None
            await sim.run_fleet(fleet, stop, out, activity)
        finally:
            if kafka is not None:
                await asyncio.to_thread(kafka.close)

    try:
        asyncio.run(serve())
    except StagetreeError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
