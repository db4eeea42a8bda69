"""The aggregator's one settings class (pydantic-settings, env prefix ``STAGETREE_AGG_``).

Built once in the entry point and passed down; nested groups use ``__`` in environment names, e.g.
``STAGETREE_AGG_KAFKA__SESSION_TIMEOUT_MS=10000``. Nothing here connects to anything.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import SettingsConfigDict

from stagetree.bus.messages import ALL_TOPICS
from stagetree.filevars import FileVariablesSettings

DAY_S = 86_400.0


class KafkaSettings(BaseModel):
    """Consumer-group timing (see ``stagetree.bus.kafka.KafkaBusConfig`` for what each one bounds)."""

    client_id: str = "stagetree-aggregator"
    session_timeout_ms: int = Field(default=10_000, ge=1)
    heartbeat_interval_ms: int = Field(default=3_000, ge=1)
    max_poll_interval_ms: int = Field(default=60_000, ge=1)
    request_timeout_ms: int = Field(default=30_000, ge=1)
    fetch_max_wait_ms: int = Field(default=100, ge=0)
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    create_topics: bool = False  # create missing topics at start (compose and tests; production pre-creates)
    topic_partitions: int = Field(default=8, ge=1)


class BatchSettings(BaseModel):
    """One database transaction per batch: up to ``max_records`` records or ``max_latency_ms`` after the
    first, whichever comes first."""

    max_records: int = Field(default=2000, ge=1)
    max_latency_ms: int = Field(default=50, ge=0)
    poll_timeout_ms: int = Field(default=500, ge=1)


class AggregatorSettings(FileVariablesSettings):
    model_config = SettingsConfigDict(env_prefix="STAGETREE_AGG_", env_nested_delimiter="__", extra="ignore")

    database_url: str = "sqlite:///stagetree.db"
    db_pool_size: int = Field(default=4, ge=1)
    bootstrap_servers: str = "127.0.0.1:9092"
    group_id: str = "stagetree-aggregators"
    topics: list[str] = Field(default_factory=lambda: list(ALL_TOPICS))
    redis_url: str | None = None  # None: the master is not woken (it still runs rounds on its timer)
    instance_id: str = ""  # a name for logs; defaults to host:pid
    max_failures: int = Field(default=3, ge=1)  # the master's scheduling.max_attempts
    applied_retention_s: float = Field(default=7 * DAY_S, ge=0)  # 0 keeps applied ids forever
    metrics_port: int | None = Field(default=None, ge=0, le=65535)  # Prometheus /metrics; None: off, 0: a free port
    metrics_host: str = "0.0.0.0"
    batch: BatchSettings = Field(default_factory=lambda: BatchSettings())
    kafka: KafkaSettings = Field(default_factory=lambda: KafkaSettings())

    @model_validator(mode="after")
    def _check(self) -> AggregatorSettings:
        if not self.topics:
            raise ValueError("topics: at least one topic is needed")
        if self.kafka.heartbeat_interval_ms >= self.kafka.session_timeout_ms:
            raise ValueError("kafka.heartbeat_interval_ms must be below kafka.session_timeout_ms (a third is usual)")
        return self
