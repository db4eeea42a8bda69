"""The master's one settings class (pydantic-settings, env prefix ``STAGETREE_MASTER_``).

Built once in the entry point and passed down; nested groups use ``__`` in environment names, e.g.
``STAGETREE_MASTER_AUTH__ADMIN_TOKEN``. Tokens are ``SecretStr`` so they never show in logs or reprs;
any setting may come from a file instead (``STAGETREE_MASTER_AUTH__ADMIN_TOKEN_FILE=/run/secrets/admin``,
see ``stagetree.filevars``). ``tls`` is the certificate gRPC and REST serve (``stagetree.tls``).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from stagetree.filevars import FileVariablesSettings
from stagetree.tls import ServerTls


class AuthSettings(BaseModel):
    # owner name -> bearer token; a study is visible only to its owner's token
    tokens: dict[str, SecretStr] = Field(default_factory=dict)
    # node managers (and operators) authenticate with this one
    admin_token: SecretStr = SecretStr("")
    # team name -> owner names: owners of one team share search plans (metrics and checkpoints); an owner
    # in no team shares with nobody. Studies stay visible to their owner only.
    teams: dict[str, list[str]] = Field(default_factory=dict)


class LimitSettings(BaseModel):
    max_batch_items: int = Field(default=1000, ge=1)
    max_config_bytes: int = Field(default=64 * 1024, ge=256)
    max_name_len: int = Field(default=256, ge=1)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)  # a REST body over it: 413 before it is read
    # client calls in flight at once (REST and gRPC together); past it a call is shed with 429 /
    # RESOURCE_EXHAUSTED and a retry-after (master.api.admission)
    max_in_flight: int = Field(default=64, ge=1)
    retry_after_s: float = Field(default=0.2, gt=0, le=60)


class SchedulingSettings(BaseModel):
    policy: str = "critical_path"
    default_step_seconds: float = Field(default=1.0, gt=0)  # a step's cost before any batch of its plan ran
    cost_refresh_s: float = Field(default=1.0, ge=0)  # how often the cost estimator reads finished batches
    heartbeat_ttl_s: float = Field(default=15.0, gt=0)
    round_interval_s: float = Field(default=5.0, gt=0)  # a round at least this often even without events
    # a busy slot whose batch should end within this many seconds is sent its next batch now, which its node
    # manager starts the moment the slot frees: the end's report, the round and the stream no longer stand
    # between two batches (0: off). Offered to work on one slot whose place step allows it (first fit); the
    # end is estimated from the learnt step costs (see master.round_read).
    lookahead_s: float = Field(default=3.0, ge=0)
    lease_ttl_s: float = Field(default=10.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)  # failed attempts of a request's work before it fails
    # bytes all checkpoints may hold; over it the master evicts by cost-benefit (core.cache). None: no limit
    checkpoint_budget_bytes: int | None = Field(default=None, ge=0)
    # peripheral checkpoints inside a batch, so work lost with a node manager restarts near where it
    # stopped: every this many steps and/or seconds (0: off). Central ones (branch points) are always saved.
    peripheral_every_steps: int = Field(default=0, ge=0)
    peripheral_every_s: float = Field(default=60.0, ge=0)
    # bytes of in-memory snapshots a batch may keep, one per step, of a model that can be snapshotted, written
    # as one pack when it ends: a trial that arrives later and branches inside the batch's range resumes at
    # its branch point (every k-th step when they do not fit; 0: off)
    snapshot_budget_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    # ... but not in a plan of at least this many trials that all start apart, a hyper-parameter taking a
    # value of its own in each (core.searchplan.keeps_snapshots: continuous values); 0: in every plan
    snapshot_probation_roots: int = Field(default=8, ge=0)
    # the studies' policy state (Hermes quanta, POP curves) is saved when changed, at most this often; a
    # round that preempts or kills saves it first, always (master.policies)
    policy_state_save_s: float = Field(default=1.0, ge=0)
    # learning curves: a batch keeps its trainer's step metrics every this many steps (0: none), and at
    # most this many points a second (0: no limit), so a fast small model does not flood the bus
    curve_every_steps: int = Field(default=1, ge=0)
    curve_max_per_s: float = Field(default=20.0, ge=0)


class MasterSettings(FileVariablesSettings):
    # an empty variable means "not set" (compose passes optional ones through as empty strings)
    model_config = SettingsConfigDict(
        env_prefix="STAGETREE_MASTER_", env_nested_delimiter="__", extra="ignore", env_ignore_empty=True
    )

    database_url: str = "sqlite:///stagetree.db"
    redis_url: str | None = None  # None: in-process coordination (embedded mode)
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    instance_id: str = ""  # leader-lease holder name; defaults to host:pid
    # threads that carry the API's database work (each RPC's store calls run on one); None: Python's
    # default (cores + 4). More let more calls wait on Postgres at once, but on 2 cores 32 did worse than
    # 6 (tests.bench.scale --api-threads: occupancy 0.839 against 0.889, 1,600 slots, 30k requests): the
    # threads take the GIL from the rounds. The database pool is sized to match when it is set.
    api_threads: int | None = Field(default=None, ge=1, le=256)
    # the S3-compatible server of s3:// checkpoints, which the checkpoint eviction deletes (empty: AWS);
    # credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION
    s3_endpoint_url: str = ""
    auth: AuthSettings = Field(default_factory=lambda: AuthSettings())
    limits: LimitSettings = Field(default_factory=lambda: LimitSettings())
    scheduling: SchedulingSettings = Field(default_factory=lambda: SchedulingSettings())
    # the certificate gRPC and REST serve (and the clients' CA for mutual TLS); none: plaintext, which the
    # master warns about when it listens beyond loopback
    tls: ServerTls = Field(default_factory=lambda: ServerTls())
