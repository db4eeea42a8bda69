"""Composition root of the node manager: builds every part once from ``NodeManagerSettings``.

Nothing connects at import time or here: the gRPC channel is opened by the first call, the Kafka
producer by the first publish, the MPS daemon and the prestarted workers by ``NodeManager.run``.
The embedded mode passes its own reporter (a ``BusReporter`` on its ``InProcessBus``) or link.
"""

from __future__ import annotations

import logging

from stagetree.bus.base import MetricBus
from stagetree.nodemanager.agent import NodeManager
from stagetree.nodemanager.gpu import GpuProbe, NvmlGpuProbe
from stagetree.nodemanager.link import GrpcMasterLink, MasterLink
from stagetree.nodemanager.mps import MpsDaemon
from stagetree.nodemanager.reporting import BatchReporter, BusReporter, GrpcReporter
from stagetree.nodemanager.reuse import MIB, ReusePolicy
from stagetree.nodemanager.runtime.checkpoints import open_checkpoint_store
from stagetree.nodemanager.settings import NodeManagerSettings
from stagetree.nodemanager.slots import USER_PATH_ENV, build_slots
from stagetree.nodemanager.workers import make_launcher

log = logging.getLogger(__name__)


def build_node_manager(
    settings: NodeManagerSettings,
    *,
    link: MasterLink | None = None,
    reporter: BatchReporter | None = None,
    bus: MetricBus | None = None,
    probe: GpuProbe | None = None,
) -> NodeManager:
    """A ``NodeManager`` for ``settings``. ``link`` defaults to gRPC to ``master_target``; the reporter
    to a ``BusReporter`` on ``bus`` when given, else on Kafka when ``bus.kafka_bootstrap_servers`` is
    set, else a ``GrpcReporter`` (direct ``ReportBatch``)."""
    nm_id = settings.resolved_id()
    work = settings.work_path()
    work.mkdir(parents=True, exist_ok=True)
    probe = probe if probe is not None else NvmlGpuProbe()
    gpus = probe.gpus()
    slots = build_slots(
        gpus,
        slots_per_gpu=settings.slots_per_gpu,
        cpu_slots=settings.cpu_slots,
        threads_per_worker=settings.threads_per_worker,
    )
    mps = None
    if settings.mps:
        if gpus:
            mps = MpsDaemon(work, [g.index for g in gpus])
        else:
            log.warning("STAGETREE_NM_MPS is on but there is no GPU: MPS not started")
    store = open_checkpoint_store(
        settings.checkpoint_root,
        s3_endpoint_url=settings.s3_endpoint_url,
        cache_dir=settings.cache_path(),
        cache_max_bytes=settings.checkpoint_cache_bytes,
    )
    launcher = make_launcher(
        settings.worker_start,
        slots,
        store.location,
        work,
        checkpoint_args=settings.checkpoint_args(),
        prestart=settings.prestart_workers,
        threads=settings.threads_per_worker,
        progress_interval_s=settings.progress_interval_s,
        preload=[m.strip() for m in settings.worker_preload.split(",")],
        mps_env=mps.client_env() if mps is not None else None,
        extra_env={USER_PATH_ENV: settings.worker_search_path()},
        warm_cuda=settings.worker_warm_cuda,
        reuse=ReusePolicy(settings.worker_reuse, settings.worker_max_rss_growth_mb * MIB),
    )
    if link is None:
        link = GrpcMasterLink(
            settings.master_target,
            settings.admin_token.get_secret_value(),
            rpc_timeout_s=settings.rpc_timeout_s,
            max_backoff_s=settings.reconnect_max_s,
            tls=settings.tls,
        )
    if reporter is None:
        b = settings.bus
        if bus is not None:
            reporter = BusReporter(bus, nm_id, max_messages=b.batch_max_messages, max_age_s=b.batch_max_age_s)
        elif b.kafka_bootstrap_servers:
            from stagetree.bus.kafka import KafkaBusConfig, KafkaMetricBus

            kafka = KafkaMetricBus(KafkaBusConfig(b.kafka_bootstrap_servers, client_id=f"stagetree-nm-{nm_id}"))
            reporter = BusReporter(
                kafka, nm_id, max_messages=b.batch_max_messages, max_age_s=b.batch_max_age_s, own_bus=True
            )
        else:
            reporter = GrpcReporter(link, node_manager_id=nm_id, max_backoff_s=settings.reconnect_max_s)
    log.info(
        "node manager built",
        extra={
            "node_manager_id": nm_id,
            "slots": [s.id for s in slots],
            "gpus": len(gpus),
            "mps": mps is not None,
            "reporter": type(reporter).__name__,
            "launcher": type(launcher).__name__,
            "checkpoint_root": store.location,
        },
    )
    return NodeManager(
        link,
        reporter,
        slots,
        launcher,
        node_manager_id=nm_id,
        address=settings.resolved_address(),
        store=store,
        probe=probe,
        mps=mps,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        telemetry_interval_s=settings.telemetry_interval_s,
        reconnect_initial_s=settings.reconnect_initial_s,
        reconnect_max_s=settings.reconnect_max_s,
        stop_grace_s=settings.stop_grace_s,
    )
