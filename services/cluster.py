"""The cluster mode as processes on one machine: ``stagetree cluster up`` and ``ProcessCluster``.

This module owns starting the compose topology (``deploy/compose/``) without Docker: a Tansu
Kafka-protocol broker, a fresh Postgres database migrated by the one-shot ``stagetree master db upgrade``,
the master (gRPC + REST), N aggregators and N CPU node managers, each started the way a user starts it
(``python -m stagetree.cli <group> ...`` with its ``STAGETREE_*`` variables), its stdout and stderr in
``<root>/logs/<name>.log``, by ``stagetree.child`` (never a fork of this process, which may hold gRPC
channels; SIGTERM-ed when it dies). It waits on readiness the way an operator would: the master's REST health,
the node manager's "registered with the master" log line, the aggregator's "owns N partitions" line.

Several clusters can run at once against the same Postgres and Redis: each gets its own database
(``stagetree_cluster_<id>``, dropped by ``stop``), its own Redis database number (claimed with a key,
released by ``stop``), its own ports, broker and node-manager ids. ``ClusterConfig.tls`` runs it over mutual
TLS (a throwaway CA, ``stagetree.tls``); ``token_files`` hands tokens over as ``*_FILE`` secret files.

``ProcessCluster`` is what the e2e tests and ``tests.bench.cluster`` drive: ``start``, ``stop``,
``kill(name, signal)`` (a node manager's workers go with it by default, as on a crashed machine),
``restart(name)``, ``add_node_manager()``, ``wait_ready(name)``, ``log(name)``, and for the broker
``stop_broker()`` / ``start_broker()`` (on the same address; durable only with ``broker_storage``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from stagetree import child, logs
from stagetree.tls import ClientTls, IssuedFiles, issue_certificates

log = logging.getLogger(__name__)

PG_ADMIN_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379"
CLAIM_KEY = "stagetree:cluster:owner"
OWNER = "alice"  # the one user the process cluster knows (its token is printed by `cluster up`)
MASTER, AGGREGATOR, NODE_MANAGER = "master", "aggregator", "nodemanager"


@dataclass
class ClusterConfig:
    """What to start and how fast failures are noticed (the defaults suit tests: faults show in seconds)."""

    root: Path
    node_managers: int = 2
    aggregators: int = 2
    cpu_slots: int = 1  # slots per node manager
    pg_admin_url: str = PG_ADMIN_URL  # a database on the server, used to create and drop the cluster's own
    redis_url: str = REDIS_URL  # without a database number: the cluster claims a free one
    heartbeat_ttl_s: float = 6.0
    round_interval_s: float = 1.0
    lease_ttl_s: float = 3.0
    max_attempts: int = 3
    peripheral_every_steps: int = 0
    peripheral_every_s: float = 2.0
    kafka_session_timeout_ms: int = 6000
    topic_partitions: int = 4
    reconnect_max_s: float = 1.0
    stop_grace_s: float = 5.0
    keep_database: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    # the broker's --storage-engine: in memory by default (its log goes with it); a durable one
    # ("s3://bucket/", with the AWS_* variables in broker_env) keeps the log across restart_broker()
    broker_storage: str = "memory://tansu/"
    broker_env: dict[str, str] = field(default_factory=dict)
    # the address the master and the broker listen on and advertise: loopback, or a bridge's address when
    # node managers run on other hosts (tests: network namespaces); Postgres and Redis stay on loopback
    host: str = "127.0.0.1"
    # the node managers' (and the master's eviction's) checkpoint store: "" is a directory under root that
    # they share; or s3://bucket/prefix on s3_endpoint_url (credentials from the AWS_* environment)
    checkpoint_root: str = ""
    s3_endpoint_url: str = ""
    # mutual TLS: a throwaway CA under <root>/tls signs the master's certificate and one client certificate
    # the node managers and ``client_tls`` present (stagetree.tls); REST is https
    tls: bool = False
    token_files: bool = False  # tokens reach the services as *_FILE secret files, not variables


@dataclass
class Service:
    name: str
    kind: str
    argv: list[str]
    env: dict[str, str]
    ready_marker: str  # a log line that says it is ready ("" for the master: its health endpoint)
    process: subprocess.Popen[bytes] | None = None
    log_offset: int = 0  # where this incarnation's output starts in its log
    starts: int = 0


class ProcessCluster:
    """The cluster topology as child processes; use as a context manager or call ``start``/``stop``."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.id = uuid.uuid4().hex[:8]
        self.root = Path(config.root).resolve()
        self.logs = self.root / "logs"
        self.checkpoints = self.root / "checkpoints"
        self.admin_token = secrets.token_hex(8)
        self.token = secrets.token_hex(8)
        self.database = f"stagetree_cluster_{self.id}"
        self.database_url = config.pg_admin_url.rsplit("/", 1)[0] + "/" + self.database
        self.redis_db: int | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.bootstrap = ""
        self.services: dict[str, Service] = {}
        self._broker: Any = None
        self._db_created = False
        self._nm_count = 0
        self._agg_count = 0
        self._certs: IssuedFiles | None = None

    # -- addresses --------------------------------------------------------------------------------

    @property
    def target(self) -> str:
        """The master's gRPC address for ``stagetree.connect``."""
        return f"{self.config.host}:{self.grpc_port}"

    @property
    def rest_url(self) -> str:
        return f"{'https' if self.config.tls else 'http'}://{self.config.host}:{self.http_port}/api/v1"

    @property
    def client_tls(self) -> ClientTls | None:
        """What ``stagetree.connect(..., tls=)`` needs with ``tls`` on (mutual TLS: the client certificate too)."""
        if self._certs is None:
            return None
        c = self._certs
        return ClientTls(ca_file=str(c.ca_cert), cert_file=str(c.client_cert), key_file=str(c.client_key))

    @property
    def redis_url(self) -> str:
        return f"{self.config.redis_url.rstrip('/')}/{self.redis_db}"

    def node_manager_names(self) -> list[str]:
        return [n for n, s in self.services.items() if s.kind == NODE_MANAGER]

    def aggregator_names(self) -> list[str]:
        return [n for n, s in self.services.items() if s.kind == AGGREGATOR]

    def node_manager_id(self, name: str) -> str:
        return self.services[name].env["STAGETREE_NM_NODE_MANAGER_ID"]

    # -- lifecycle --------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 90.0) -> None:
        """Start everything and wait until each service is ready; on failure stop what started."""
        from stagetree.bus.tansu import free_loopback_port, start_tansu

        self.logs.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        if self.config.tls:
            self._certs = issue_certificates(self.root / "tls")
        try:
            self._claim_redis_db()
            self._create_database()
            self._broker = start_tansu(
                storage=self.config.broker_storage, env=self.config.broker_env, host=self.config.host
            )
            self.bootstrap = self._broker.bootstrap
            self._create_topics()
            self.grpc_port, self.http_port = free_loopback_port(), free_loopback_port()
            self._define_master()
            for _ in range(self.config.aggregators):
                self._define_aggregator()
            for _ in range(self.config.node_managers):
                self._define_node_manager()
            self._migrate()
            self._launch(MASTER)
            self.wait_ready(MASTER, timeout_s)
            for name in self.aggregator_names() + self.node_manager_names():
                self._launch(name)
            for name in self.aggregator_names() + self.node_manager_names():
                self.wait_ready(name, timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("cluster ready", extra={"cluster": self.id, "target": self.target})

    def stop(self) -> None:
        """Stop node managers (their workers get ``stop_grace_s`` to save), aggregators, the master and the
        broker; drop the database and release the Redis database. Safe to call twice."""
        for group in (self.node_manager_names(), self.aggregator_names(), [MASTER]):
            for name in group:
                self._signal(name, signal.SIGTERM)
            for name in group:
                self._reap(name, self.config.stop_grace_s + 10)
        if self._broker is not None:
            self._broker.stop()
            self._broker = None
        if self._db_created and not self.config.keep_database:
            self._drop_database()
        self._release_redis_db()

    def _signal(self, name: str, sig: int) -> None:
        svc = self.services.get(name)
        if svc is not None and svc.process is not None and svc.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(svc.process.pid, sig)

    def _reap(self, name: str, timeout_s: float) -> None:
        svc = self.services.get(name)
        if svc is None or svc.process is None:
            return
        try:
            svc.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("service ignored SIGTERM; killing it", extra={"service": name})
            svc.process.kill()
            svc.process.wait(10)

    # -- faults -----------------------------------------------------------------------------------

    def pid(self, name: str) -> int | None:
        svc = self.services[name]
        return svc.process.pid if svc.process is not None and svc.process.poll() is None else None

    def alive(self, name: str) -> bool:
        return self.pid(name) is not None

    def kill(self, name: str, sig: int = signal.SIGKILL, *, with_workers: bool = True) -> float:
        """Send ``sig`` to the service's process; returns the time (``time.time()``) it was sent. A node
        manager killed with SIGKILL takes its worker processes with it unless ``with_workers`` is False
        (a crashed machine loses both; an orphan worker only burns CPU: nobody reads what it reports)."""
        svc = self.services[name]
        if svc.process is None or svc.process.poll() is not None:
            raise RuntimeError(f"{name} is not running")
        descendants = _descendants(svc.process.pid) if svc.kind == NODE_MANAGER and with_workers else []
        at = time.time()
        os.kill(svc.process.pid, sig)
        if sig == signal.SIGKILL:
            for pid in descendants:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            svc.process.wait(10)
        log.info("service signalled", extra={"service": name, "signal": signal.Signals(sig).name})
        return at

    def stop_service(self, name: str) -> None:
        """Stop one service gracefully (SIGTERM; a node manager preempts its workers so they save)."""
        self._signal(name, signal.SIGTERM)
        self._reap(name, self.config.stop_grace_s + 10)

    def restart(self, name: str, *, wait: bool = True, timeout_s: float = 60.0) -> None:
        """Start ``name`` again (stopping it first with SIGTERM when it still runs)."""
        if self.alive(name):
            self.stop_service(name)
        self._launch(name)
        if wait:
            self.wait_ready(name, timeout_s)

    def stop_broker(self) -> float:
        """Kill the broker (SIGKILL: as a crash); returns the time (``time.time()``) it was killed."""
        at = time.time()
        self._broker.process.kill()
        self._broker.process.wait(10)
        log.info("broker killed", extra={"bootstrap": self.bootstrap})
        return at

    def start_broker(self) -> None:
        """Start the broker again on the same address (what every service was configured with)."""
        from stagetree.bus.tansu import start_tansu

        port = int(self.bootstrap.rsplit(":", 1)[1])
        c = self.config
        self._broker = start_tansu(port=port, storage=c.broker_storage, env=c.broker_env, host=c.host)

    def add_node_manager(self, *, wait: bool = True, timeout_s: float = 60.0, wrap: tuple[str, ...] = ()) -> str:
        """Start one more node manager; returns its service name. ``wrap`` prefixes its command line
        (``("ip", "netns", "exec", ns)`` starts it on another network host)."""
        name = self._define_node_manager(wrap)
        self._launch(name)
        if wait:
            self.wait_ready(name, timeout_s)
        return name

    # -- readiness and logs ---------------------------------------------------------------------------

    def wait_ready(self, name: str, timeout_s: float = 60.0) -> None:
        svc = self.services[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if svc.process is None or svc.process.poll() is not None:
                raise RuntimeError(f"{name} exited before it was ready; its log ends with:\n{self.log_tail(name)}")
            if self._is_ready(svc):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{name} not ready in {timeout_s} s; its log ends with:\n{self.log_tail(name)}")

    def _is_ready(self, svc: Service) -> bool:
        if svc.kind == MASTER:
            tls = self.client_tls
            try:
                ctx = tls.ssl_context() if tls is not None else None
                with urllib.request.urlopen(f"{self.rest_url}/health", timeout=1, context=ctx) as r:
                    return bool(r.status == 200)
            except OSError:
                return False
        return svc.ready_marker in self.log(svc.name, since_start=True)

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def log(self, name: str, *, since_start: bool = False) -> str:
        """The service's log (all its incarnations, or only the current one's)."""
        try:
            with self.log_path(name).open("rb") as f:
                if since_start:
                    f.seek(self.services[name].log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, name: str, chars: int = 3000) -> str:
        return self.log(name)[-chars:]

    # -- service definitions ------------------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STAGETREE_")}
        env.update(
            PYTHONUNBUFFERED="1",
            CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", ""),
            OMP_NUM_THREADS="1",
        )
        env.update(self.config.extra_env)
        return env

    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "stagetree.cli", *args]

    def _define_master(self) -> None:
        c = self.config
        env = self._base_env()
        env.update(
            STAGETREE_MASTER_DATABASE_URL=self.database_url,
            STAGETREE_MASTER_REDIS_URL=self.redis_url,
            STAGETREE_MASTER_GRPC_HOST=c.host,
            STAGETREE_MASTER_GRPC_PORT=str(self.grpc_port),
            STAGETREE_MASTER_HTTP_HOST=c.host,
            STAGETREE_MASTER_HTTP_PORT=str(self.http_port),
            STAGETREE_MASTER_INSTANCE_ID=f"{self.id}-master",
            STAGETREE_MASTER_SCHEDULING__HEARTBEAT_TTL_S=str(c.heartbeat_ttl_s),
            STAGETREE_MASTER_SCHEDULING__ROUND_INTERVAL_S=str(c.round_interval_s),
            STAGETREE_MASTER_SCHEDULING__LEASE_TTL_S=str(c.lease_ttl_s),
            STAGETREE_MASTER_SCHEDULING__MAX_ATTEMPTS=str(c.max_attempts),
            STAGETREE_MASTER_SCHEDULING__PERIPHERAL_EVERY_STEPS=str(c.peripheral_every_steps),
            STAGETREE_MASTER_SCHEDULING__PERIPHERAL_EVERY_S=str(c.peripheral_every_s),
            STAGETREE_MASTER_S3_ENDPOINT_URL=c.s3_endpoint_url,
        )
        env.update(self._secret("STAGETREE_MASTER_AUTH__ADMIN_TOKEN", self.admin_token))
        env.update(self._secret("STAGETREE_MASTER_AUTH__TOKENS", json.dumps({OWNER: self.token})))
        if self._certs is not None:
            env.update(
                STAGETREE_MASTER_TLS__CERT_FILE=str(self._certs.server_cert),
                STAGETREE_MASTER_TLS__KEY_FILE=str(self._certs.server_key),
                STAGETREE_MASTER_TLS__CA_FILE=str(self._certs.ca_cert),
                STAGETREE_MASTER_TLS__CLIENT_AUTH="true",
            )
        self.services[MASTER] = Service(MASTER, MASTER, self._cmd("master", "serve"), env, "")

    def _define_aggregator(self) -> str:
        c = self.config
        self._agg_count += 1
        name = f"aggregator-{self._agg_count}"
        env = self._base_env()
        env.update(
            STAGETREE_AGG_DATABASE_URL=self.database_url,
            STAGETREE_AGG_BOOTSTRAP_SERVERS=self.bootstrap,
            STAGETREE_AGG_REDIS_URL=self.redis_url,
            STAGETREE_AGG_INSTANCE_ID=f"{self.id}-{name}",
            STAGETREE_AGG_GROUP_ID=f"stagetree-aggregators-{self.id}",
            STAGETREE_AGG_MAX_FAILURES=str(c.max_attempts),
            STAGETREE_AGG_KAFKA__SESSION_TIMEOUT_MS=str(c.kafka_session_timeout_ms),
            STAGETREE_AGG_KAFKA__HEARTBEAT_INTERVAL_MS=str(max(1, c.kafka_session_timeout_ms // 3)),
            STAGETREE_AGG_KAFKA__TOPIC_PARTITIONS=str(c.topic_partitions),
        )
        self.services[name] = Service(name, AGGREGATOR, self._cmd("aggregator", "run"), env, " owns ")
        return name

    def _define_node_manager(self, wrap: tuple[str, ...] = ()) -> str:
        c = self.config
        self._nm_count += 1
        name = f"nm-{self._nm_count}"
        work = self.root / name
        work.mkdir(parents=True, exist_ok=True)
        env = self._base_env()
        env.update(
            STAGETREE_NM_MASTER_TARGET=self.target,
            STAGETREE_NM_NODE_MANAGER_ID=f"{self.id}-{name}",  # unique: wake-up channels are server-wide
            STAGETREE_NM_ADDRESS=name,
            STAGETREE_NM_CHECKPOINT_ROOT=c.checkpoint_root or str(self.checkpoints),  # shared, like the compose volume
            STAGETREE_NM_S3_ENDPOINT_URL=c.s3_endpoint_url,
            STAGETREE_NM_WORK_DIR=str(work),
            STAGETREE_NM_CPU_SLOTS=str(c.cpu_slots),
            STAGETREE_NM_RECONNECT_MAX_S=str(c.reconnect_max_s),
            STAGETREE_NM_STOP_GRACE_S=str(c.stop_grace_s),
            STAGETREE_NM_BUS__KAFKA_BOOTSTRAP_SERVERS=self.bootstrap,
            STAGETREE_NM_BUS__BATCH_MAX_AGE_S="0.1",
        )
        env.update(self._secret("STAGETREE_NM_ADMIN_TOKEN", self.admin_token))
        if self._certs is not None:
            env.update(
                STAGETREE_NM_TLS__CA_FILE=str(self._certs.ca_cert),
                STAGETREE_NM_TLS__CERT_FILE=str(self._certs.client_cert),
                STAGETREE_NM_TLS__KEY_FILE=str(self._certs.client_key),
            )
        self.services[name] = Service(
            name, NODE_MANAGER, [*wrap, *self._cmd("nodemanager", "run")], env, "registered with the master"
        )
        return name

    def _secret(self, variable: str, value: str) -> dict[str, str]:
        """``variable=value``, or with ``token_files`` ``variable_FILE=<a file only we can read>``."""
        if not self.config.token_files:
            return {variable: value}
        path = self.root / "secrets" / variable.lower()
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.write_text(value + "\n")
        path.chmod(0o600)
        return {f"{variable}_FILE": str(path)}

    def _launch(self, name: str) -> None:
        svc = self.services[name]
        path = self.log_path(name)
        with path.open("ab") as f:
            svc.log_offset = f.tell()
            svc.starts += 1
            f.write(f"==== {time.strftime('%H:%M:%S')} start #{svc.starts}: {' '.join(svc.argv[2:])}\n".encode())
            f.flush()
            svc.process = child.popen(
                svc.argv,
                env=svc.env,
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches us only: we stop the services in order
            )
        log.info("service started", extra={"service": name, "pid": svc.process.pid})

    # -- the stores ---------------------------------------------------------------------------------------

    def _claim_redis_db(self) -> None:
        import redis

        for db in range(1, 16):
            r = redis.Redis.from_url(f"{self.config.redis_url.rstrip('/')}/{db}")
            try:
                if r.set(CLAIM_KEY, self.id, nx=True, ex=6 * 3600):
                    self.redis_db = db
                    return
            finally:
                r.close()
        raise RuntimeError(f"no free Redis database at {self.config.redis_url} (databases 1-15 are all claimed)")

    def _release_redis_db(self) -> None:
        if self.redis_db is None:
            return
        import redis

        r = redis.Redis.from_url(self.redis_url)
        try:
            keys = list(r.scan_iter("stagetree:*"))
            if keys and r.get(CLAIM_KEY) == self.id.encode():
                r.delete(*keys)  # ours: the database was claimed for this cluster
        finally:
            r.close()
        self.redis_db = None

    def _create_database(self) -> None:
        self._admin(f'CREATE DATABASE "{self.database}"')
        self._db_created = True

    def _drop_database(self) -> None:
        self._admin(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
        self._db_created = False

    def _admin(self, statement: str) -> None:
        """One statement on the server's admin database, outside a transaction (CREATE/DROP DATABASE)."""
        from sqlalchemy import create_engine, text

        admin = create_engine(self.config.pg_admin_url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as c:
                c.execute(text(statement))
        finally:
            admin.dispose()

    def _migrate(self) -> None:
        """The compose file's one-shot migration job."""
        with self.log_path("migrate").open("ab") as f:
            rc = subprocess.run(
                self._cmd("master", "db", "upgrade", "--url", self.database_url),
                env=self._base_env(),
                stdout=f,
                stderr=subprocess.STDOUT,
                check=False,
            ).returncode
        if rc != 0:
            raise RuntimeError(f"migration failed (exit {rc}):\n{self.log_tail('migrate')}")

    def _create_topics(self) -> None:
        from stagetree.bus.kafka import KafkaBusConfig, ensure_topics

        ensure_topics(KafkaBusConfig(self.bootstrap), partitions=self.config.topic_partitions)

    def engine(self) -> Any:
        """A SQLAlchemy engine on the cluster's database (for checks; dispose it when done)."""
        from sqlalchemy import create_engine

        return create_engine(self.database_url)

    def query(self, sql: str, **params: Any) -> list[Any]:
        """The rows of one read-only query on the cluster's database (for checks and benchmarks)."""
        from sqlalchemy import text

        engine = self.engine()
        try:
            with engine.connect() as c:
                return list(c.execute(text(sql), params))
        finally:
            engine.dispose()

    def summary(self) -> str:
        lines = [
            f"stagetree process cluster {self.id} ready",
            f"  master gRPC   {self.target}   (stagetree.connect({self.target!r}, token=...))",
            f"  master REST   {self.rest_url}",
            f"  user token    {self.token}   (owner {OWNER})",
            f"  CLI           export STAGETREE_URL=http://127.0.0.1:{self.http_port} STAGETREE_TOKEN={self.token}",
            f"  admin token   {self.admin_token}",
            f"  database      {self.database_url}",
            f"  redis         {self.redis_url}",
            f"  kafka         {self.bootstrap} (tansu)",
            f"  checkpoints   {self.checkpoints}",
            *(
                [f"  mutual TLS    CA {c.ca_cert}, client {c.client_cert} (key {c.client_key})"]
                if (c := self._certs)
                else []
            ),
            f"  logs          {self.logs}/",
        ]
        for name in self.services:
            pid = self.pid(name)
            lines.append(f"    {name:<14} pid {pid if pid else '-':<8} {self.log_path(name)}")
        return "\n".join(lines)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _descendants(pid: int) -> list[int]:
    kids = _children()
    out: list[int] = []
    todo = [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


# -- the command line --------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagetree cluster", description="the cluster topology as local processes")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start it and run until Ctrl-C (needs local Postgres and Redis)")
    up.add_argument("--root", default=".stagetree-cluster", help="logs, checkpoints and work directories")
    up.add_argument("--node-managers", type=int, default=2)
    up.add_argument("--aggregators", type=int, default=2)
    up.add_argument("--cpu-slots", type=int, default=1, help="slots per node manager")
    up.add_argument("--pg-url", default=PG_ADMIN_URL, help="an existing database on the Postgres server")
    up.add_argument("--redis-url", default=REDIS_URL, help="the Redis server (a free database number is claimed)")
    up.add_argument("--keep-database", action="store_true", help="do not drop the cluster's database on exit")
    up.add_argument("--tls", action="store_true", help="mutual TLS with a throwaway CA (under --root/tls)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logs.configure(logging.WARNING)
    config = ClusterConfig(
        root=Path(ns.root),
        node_managers=ns.node_managers,
        aggregators=ns.aggregators,
        cpu_slots=ns.cpu_slots,
        pg_admin_url=ns.pg_url,
        redis_url=ns.redis_url,
        keep_database=ns.keep_database,
        tls=ns.tls,
        heartbeat_ttl_s=15.0,
        round_interval_s=5.0,
        lease_ttl_s=10.0,
        peripheral_every_s=60.0,
        kafka_session_timeout_ms=10_000,
        reconnect_max_s=10.0,
        stop_grace_s=30.0,
    )
    cluster = ProcessCluster(config)
    print(f"starting the process cluster under {cluster.root} ...", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        cluster.start()
        print(cluster.summary(), flush=True)
        print("Ctrl-C stops it.", flush=True)
        reported: set[str] = set()
        while not stop.wait(1.0):
            for name, svc in list(cluster.services.items()):
                if name not in reported and svc.process is not None and svc.process.poll() is not None:
                    print(f"{name} exited with status {svc.process.returncode}; see {cluster.log_path(name)}")
                    reported.add(name)
    except KeyboardInterrupt:
        pass
    except Exception as e:
        print(f"error: {e}", file=sys.stderr)
        cluster.stop()
        return 1
    print("stopping the process cluster ...", flush=True)
    cluster.stop()
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
