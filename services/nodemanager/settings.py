"""The node manager's one settings class (pydantic-settings, env prefix ``STAGETREE_NM_``).

Built once in the entry point (``stagetree nodemanager run``) and passed down; nested groups use ``__``
in environment names, e.g. ``STAGETREE_NM_BUS__KAFKA_BOOTSTRAP_SERVERS``. The admin token is a
``SecretStr`` so it never shows in logs or reprs; it must equal the master's
``STAGETREE_MASTER_AUTH__ADMIN_TOKEN``, and may come from a file (``STAGETREE_NM_ADMIN_TOKEN_FILE``, see
``stagetree.filevars``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from stagetree.filevars import FileVariablesSettings
from stagetree.nodemanager.runtime.checkpoints import DEFAULT_CACHE_BYTES
from stagetree.tls import ClientTls


class BusSettings(BaseModel):
    """Where batch events go. No bootstrap servers: reported straight to the master (``ReportBatch``).
    With them: published to Kafka for the aggregators (the cluster path)."""

    kafka_bootstrap_servers: str = ""
    batch_max_messages: int = Field(default=200, ge=1)
    batch_max_age_s: float = Field(default=0.5, gt=0)


class NodeManagerSettings(FileVariablesSettings):
    model_config = SettingsConfigDict(env_prefix="STAGETREE_NM_", env_nested_delimiter="__", extra="ignore")

    master_target: str = "127.0.0.1:50051"  # host:port of the master's gRPC server
    admin_token: SecretStr = SecretStr("")
    node_manager_id: str = ""  # defaults to the host name
    address: str = ""  # what the master shows for this node manager; defaults to the host name
    # where checkpoints go: a local or shared directory, a file:// URI, or s3://bucket/prefix (credentials
    # from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION, as botocore reads them)
    checkpoint_root: str = "stagetree-checkpoints"
    s3_endpoint_url: str = ""  # an S3-compatible server (MinIO, Ceph, moto); empty: AWS
    # the local copies of remote checkpoints this node manager wrote or read (LRU); default <work_dir>/checkpoint-cache
    checkpoint_cache_dir: str = ""
    checkpoint_cache_bytes: int = Field(default=DEFAULT_CACHE_BYTES, ge=0)
    work_dir: str = "stagetree-nm"  # worker logs, spec files, MPS pipes
    slots_per_gpu: int = Field(default=1, ge=1)  # >1 shares a GPU: each slot gets 1/slots_per_gpu of it
    cpu_slots: int = Field(default=2, ge=1)  # slots when there is no GPU (or NVML is missing)
    threads_per_worker: int = Field(default=1, ge=1)  # torch threads of each worker
    mps: bool = False  # start an MPS control daemon for the GPUs (only with a GPU)
    heartbeat_interval_s: float | None = Field(default=None, gt=0)  # None: what the master asks for
    telemetry_interval_s: float = Field(default=10.0, gt=0)
    progress_interval_s: float = Field(default=1.0, ge=0)  # workers' progress events, at most this often
    # How workers start (see nodemanager.workers): "exec" a fresh interpreter per batch, "forkserver" fork
    # from a server that imported torch once (and never touches CUDA); "auto" is "forkserver".
    worker_start: Literal["auto", "exec", "forkserver"] = "auto"
    prestart_workers: bool = True  # keep one worker per slot started (imports done), waiting for a batch
    # a worker runs batch after batch of one trainer and code version (its module imported once, a batch
    # that starts where the last ended continues from memory); false: a worker per batch (nodemanager.reuse)
    worker_reuse: bool = True
    # a worker whose memory grew by more than this since its first batch is replaced (0: no bound)
    worker_max_rss_growth_mb: int = Field(default=1024, ge=0)
    # a GPU slot's waiting worker creates its CUDA context and loads cuBLAS and cuDNN ahead (about 1 GB of
    # the GPU's memory on an H100, held beside the batch running on the slot), so a batch starts training
    # without paying for them (docs/gpu.md)
    worker_warm_cuda: bool = True
    # modules the workers import before their first batch, in the fork server when there is one
    # (comma-separated); the trainer modules of the work sent are preloaded without being named here
    worker_preload: str = "torch._dynamo"
    # directories the workers import the user's trainer from, before PYTHONPATH (``os.pathsep``-separated;
    # the embedded mode passes the user's script directory and working directory)
    user_path: str = ""
    reconnect_initial_s: float = Field(default=0.5, gt=0)
    reconnect_max_s: float = Field(default=10.0, gt=0)
    rpc_timeout_s: float = Field(default=10.0, gt=0)
    stop_grace_s: float = Field(default=30.0, ge=0)  # on shutdown, how long preempted workers get to save
    metrics_port: int | None = Field(default=None, ge=0, le=65535)  # Prometheus /metrics; None: off, 0: a free port
    metrics_host: str = "0.0.0.0"
    bus: BusSettings = Field(default_factory=lambda: BusSettings())
    # how the link verifies the master (ca_file) and proves itself for mutual TLS (cert_file, key_file)
    tls: ClientTls = Field(default_factory=lambda: ClientTls())

    def worker_search_path(self) -> str:
        """Where workers import the user's trainer from, before ``PYTHONPATH``: ``user_path``, then the node
        manager's working directory (where ``stagetree nodemanager run`` was started, as a user expects)."""
        parts = [p for p in self.user_path.split(os.pathsep) if p]
        cwd = os.getcwd()
        return os.pathsep.join(parts if cwd in parts else [*parts, cwd])

    def resolved_id(self) -> str:
        """The node manager id: the setting, else the host name."""
        return self.node_manager_id or socket.gethostname()

    def resolved_address(self) -> str:
        return self.address or socket.gethostname()

    def work_path(self) -> Path:
        return Path(self.work_dir).resolve()

    def cache_path(self) -> Path:
        if self.checkpoint_cache_dir:
            return Path(self.checkpoint_cache_dir).resolve()
        return self.work_path() / "checkpoint-cache"

    def checkpoint_args(self) -> list[str]:
        """The worker's checkpoint store options besides its root (``runtime.worker``'s arguments)."""
        args = ["--cache-dir", str(self.cache_path()), "--cache-bytes", str(self.checkpoint_cache_bytes)]
        return [*args, "--s3-endpoint-url", self.s3_endpoint_url] if self.s3_endpoint_url else args
