"""The node manager's one settings class (pydantic-settings, env prefix ``STAGETREE_NM_``).

Built once in the entry point (``stagetree nodemanager run``) and passed down; nested groups use ``__``
in environment names, e.g. ``STAGETREE_NM_BUS__KAFKA_BOOTSTRAP_SERVERS``. The admin token is a
``SecretStr`` so it never shows in logs or reprs; it must equal the master's
``STAGETREE_MASTER_AUTH__ADMIN_TOKEN``.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class BusSettings(BaseModel):
    """Where batch events go. No bootstrap servers: reported straight to the master (``ReportBatch``).
    With them: published to Kafka for the aggregators (the cluster path)."""

    kafka_bootstrap_servers: str = ""
    batch_max_messages: int = Field(default=200, ge=1)
    batch_max_age_s: float = Field(default=0.5, gt=0)


class NodeManagerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STAGETREE_NM_", env_nested_delimiter="__", extra="ignore")

    master_target: str = "127.0.0.1:50051"  # host:port of the master's gRPC server
    admin_token: SecretStr = SecretStr("")
    node_manager_id: str = ""  # defaults to the host name
    address: str = ""  # what the master shows for this node manager; defaults to the host name
    checkpoint_root: str = "stagetree-checkpoints"  # a local or shared directory (or file:// URI)
    work_dir: str = "stagetree-nm"  # worker logs, spec files, MPS pipes
    slots_per_gpu: int = Field(default=1, ge=1)  # >1 shares a GPU: each slot gets 1/slots_per_gpu of it
    cpu_slots: int = Field(default=2, ge=1)  # slots when there is no GPU (or NVML is missing)
    threads_per_worker: int = Field(default=1, ge=1)  # torch threads of each worker
    mps: bool = False  # start an MPS control daemon for the GPUs (only with a GPU)
    heartbeat_interval_s: float | None = Field(default=None, gt=0)  # None: what the master asks for
    telemetry_interval_s: float = Field(default=10.0, gt=0)
    progress_interval_s: float = Field(default=1.0, ge=0)  # workers' progress events, at most this often
    # How workers start (see nodemanager.workers): "exec" a fresh interpreter per batch, "forkserver" fork
    # from a server that imported torch once; "auto" forks only when no slot has a GPU.
    worker_start: Literal["auto", "exec", "forkserver"] = "auto"
    prestart_workers: bool = True  # keep one worker per slot started (imports done), waiting for a batch
    worker_preload: str = "torch._dynamo"  # modules imported ahead of the spec (comma-separated; trainers too)
    # directories the workers import the user's trainer from, before PYTHONPATH (``os.pathsep``-separated;
    # the embedded mode passes the user's script directory and working directory)
    user_path: str = ""
    reconnect_initial_s: float = Field(default=0.5, gt=0)
    reconnect_max_s: float = Field(default=10.0, gt=0)
    rpc_timeout_s: float = Field(default=10.0, gt=0)
    stop_grace_s: float = Field(default=30.0, ge=0)  # on shutdown, how long preempted workers get to save
    bus: BusSettings = Field(default_factory=lambda: BusSettings())

    def resolved_id(self) -> str:
        """The node manager id: the setting, else the host name."""
        return self.node_manager_id or socket.gethostname()

    def resolved_address(self) -> str:
        return self.address or socket.gethostname()

    def work_path(self) -> Path:
        return Path(self.work_dir).resolve()
