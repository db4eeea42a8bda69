"""A real S3-compatible server for the tests: moto's standalone server (``moto_server``, from the dev extra).

``make services`` starts one on loopback at ``MOTO_PORT`` (5077) when nothing answers there; the tests
read its URL from ``STAGETREE_TEST_S3_URL`` (default ``http://127.0.0.1:5077``) and, when it does not
answer, start a private one on a free port (``host`` lets the namespace tests bind it to a bridge address).
Each test gets buckets of its own, so runs in parallel never share an object.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:5077"
# moto accepts any credentials; botocore needs some, and the node managers read these from the environment
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/moto-api/", timeout=1) as r:
            return bool(r.status < 500)
    except OSError:
        return False


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    url: str
    process: subprocess.Popen[bytes] | None = None

    def new_bucket(self, prefix: str = "stagetree-test") -> str:
        import boto3

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        client = boto3.client("s3", endpoint_url=self.url, **_boto_credentials())
        client.create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(10)


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def moto_command() -> list[str]:
    exe = Path(sys.executable).parent / "moto_server"
    return [str(exe)] if exe.exists() else [shutil.which("moto_server") or "moto_server"]


def start_moto(host: str = "127.0.0.1", log: Path | None = None, timeout_s: float = 30.0) -> S3Server:
    """A private moto server on a free port of ``host``; returns once it answers."""
    port = _free_port(host)
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(
            [*moto_command(), "-H", host, "-p", str(port)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]
    server = S3Server(f"http://{host}:{port}", proc)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with status {proc.returncode}")
        if answers(server.url):
            return server
        time.sleep(0.1)
    server.stop()
    raise TimeoutError(f"moto_server did not answer at {server.url} in {timeout_s} s")


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """The shared server at ``STAGETREE_TEST_S3_URL`` when it answers, else a private one for the block."""
    url = os.environ.get("STAGETREE_TEST_S3_URL", DEFAULT_URL).rstrip("/")
    for k, v in CREDENTIALS.items():
        os.environ.setdefault(k, v)
    if answers(url):
        yield S3Server(url)
        return
    server = start_moto()
    try:
        yield server
    finally:
        server.stop()
