"""docs/deployment.md's "Running the services yourself", run as written: its ``<!-- by-hand -->`` bash block,
with this machine's addresses in place of ``db.example`` and the others, starts a Tansu broker (log on
S3), creates the topics, the database and the checkpoint bucket, and starts the master, an aggregator
and a node manager. A study then trains to the end through Kafka, the aggregator and S3 checkpoints;
the master, killed with -9 and started again under its fixed instance id, leads again at once (its
lease is 120 s long, far more than the test waits)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stagetree.bus.tansu import find_tansu_binary, free_loopback_port
from stagetree.cluster import CLAIM_KEY
from tests.e2e.conftest import require_platform
from tests.s3server import CREDENTIALS, s3_server

ROOT = Path(__file__).resolve().parents[2]
TRAINER = "stagetree.nodemanager.examples.digits:DigitsMLP"


def by_hand_block() -> str:
    text = (ROOT / "docs" / "deployment.md").read_text()
    m = re.search(r"<!-- by-hand -->\n```bash\n(.*?)```", text, re.S)
    assert m is not None, "docs/deployment.md has no <!-- by-hand --> bash block"
    return m.group(1)


@contextlib.contextmanager
def _redis_db() -> Iterator[int]:
    """A Redis database number no process cluster of this machine holds (their claim key, ``stagetree.cluster``)."""
    import redis

    owner = uuid.uuid4().hex
    for db in range(1, 16):
        r = redis.Redis.from_url(f"redis://127.0.0.1:6379/{db}")
        if r.set(CLAIM_KEY, owner, nx=True, ex=3600):
            try:
                yield db
            finally:
                keys = list(r.scan_iter("stagetree:*"))
                if keys:
                    r.delete(*keys)
                r.close()
            return
        r.close()
    pytest.skip("no free Redis database number (1-15 are all claimed)")


def _wait(what: str, ok: object, deadline_s: float, log: Path) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if ok():  # type: ignore[operator]
                return
        time.sleep(0.5)
    raise AssertionError(f"{what} within {deadline_s} s; the services' output ends with:\n{log.read_text()[-4000:]}")


def test_the_services_start_by_hand_as_the_deployment_guide_says(tmp_path: Path) -> None:
    require_platform()
    for tool in ("psql", "aws"):
        if shutil.which(tool) is None:
            pytest.skip(f"no `{tool}` command: the guide's block uses it")
    tansu = find_tansu_binary()
    assert tansu is not None
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tansu").symlink_to(tansu)
    database = f"stagetree_byhand_{uuid.uuid4().hex[:8]}"
    broker, grpc_port, http_port = free_loopback_port(), free_loopback_port(), free_loopback_port()
    nm_id = f"byhand-{uuid.uuid4().hex[:8]}"  # the wake-up channels are Redis-server-wide
    with s3_server() as s3, _redis_db() as redis_db:
        s3_host = s3.url.removeprefix("http://")
        block = by_hand_block()
        for example, here in {
            "db.example": "127.0.0.1",
            "DATABASE stagetree": f"DATABASE {database}",
            "5432/stagetree": f"5432/{database}",
            "0.0.0.0:9092": f"127.0.0.1:{broker}",
            "broker.example:9092": f"127.0.0.1:{broker}",
            "s3.example:9000": s3_host,
            "s3://tansu/": f"s3://tansu-{nm_id}/",
            "stagetree-checkpoints": f"ckpt-{nm_id}",
            "redis.example:6379/0": f"127.0.0.1:6379/{redis_db}",
            "master.example:50051": f"127.0.0.1:{grpc_port}",
            "--id gpu-1": f"--id {nm_id}",
            "STAGETREE_MASTER_INSTANCE_ID=master-1": f"STAGETREE_MASTER_INSTANCE_ID={nm_id}-master",
        }.items():
            assert example in block, f"the guide's block no longer says {example!r}"
            block = block.replace(example, here)
        script = tmp_path / "by-hand.sh"
        script.write_text(block)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("STAGETREE_")},
            **CREDENTIALS,
            "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            "AWS_ENDPOINT": s3.url,  # Tansu's S3 storage
            "AWS_ALLOW_HTTP": "true",
            "STAGETREE_MASTER_GRPC_PORT": str(grpc_port),
            "STAGETREE_MASTER_HTTP_PORT": str(http_port),
            "STAGETREE_MASTER_SCHEDULING__LEASE_TTL_S": "120",
            "STAGETREE_NM_CPU_SLOTS": "1",
        }
        subprocess.run(  # the broker's S3 bucket, made beforehand as the guide says
            ["aws", "--endpoint-url", s3.url, "s3", "mb", f"s3://tansu-{nm_id}"], env=env, check=True, timeout=60
        )
        log = tmp_path / "services.log"
        with log.open("wb") as out:
            # a session of its own: the services the block starts in the background stay in its process group
            shell = subprocess.Popen(
                ["bash", "-e", str(script)], cwd=tmp_path, env=env, stdout=out, stderr=out, start_new_session=True
            )
        group = shell.pid
        try:
            assert shell.wait(timeout=300) == 0, log.read_text()[-4000:]
            rest = httpx.Client(base_url=f"http://127.0.0.1:{http_port}/api/v1", timeout=30)
            alice = {"Authorization": "Bearer change-me"}
            admin = {"Authorization": "Bearer change-me-admin"}
            _wait("the master answers", lambda: rest.get("/health").status_code == 200, 120, log)
            _wait(
                "the node manager registers",
                lambda: [n["node_manager_id"] for n in rest.get("/hosts", headers=admin).json()] == [nm_id],
                120,
                log,
            )
            study = rest.post("/studies", json={"name": "by-hand", "fixed": {"trainer": TRAINER}}, headers=alice)
            sid = study.json()["id"]
            items = [
                {"client_request_id": f"r{i}", "config": {"tuned": {"lr": lr, "bs": 32}}, "step": 4}
                for i, lr in enumerate((0.1, {"kind": "multistep", "init": 0.1, "milestones": [2], "gamma": 0.5}))
            ]
            sent = rest.post(f"/studies/{sid}/requests", json={"items": items}, headers=alice).json()
            ids = [r["request_id"] for r in sent]

            def done() -> bool:
                got = rest.get(f"/studies/{sid}/requests", params={"ids": ids, "wait_s": 10}, headers=alice).json()
                assert all(g["state"] != "FAILED" for g in got), got
                return all(g["state"] == "DONE" and "loss" in g["metrics"] for g in got)

            _wait("the study's requests finish", done, 300, log)

            # the master dies; started again under its fixed id, it leads at once (its lease has 120 s left)
            os.kill(_master_pid(group), signal.SIGKILL)
            killed = time.monotonic()
            restart = tmp_path / "master-again.sh"
            restart.write_text(
                "\n".join(line for line in block.splitlines() if line.startswith("export STAGETREE_MASTER_"))
                + "\nexec stagetree master serve\n"
            )
            with (tmp_path / "master-again.log").open("wb") as out:
                again = subprocess.Popen(["bash", str(restart)], cwd=tmp_path, env=env, stdout=out, stderr=out)
            try:
                more = [{"client_request_id": "r2", "config": {"tuned": {"lr": 0.05, "bs": 32}}, "step": 4}]
                _wait("the master answers again", lambda: rest.get("/health").status_code == 200, 120, log)
                (r2,) = rest.post(f"/studies/{sid}/requests", json={"items": more}, headers=alice).json()
                ids = [r2["request_id"]]
                # another instance id would schedule nothing before the old lease lapses, 120 s after the kill
                left = 100 - (time.monotonic() - killed)
                _wait("a request sent to the restarted master finishes", done, left, tmp_path / "master-again.log")
            finally:
                again.terminate()
                again.wait(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)
            _wait_gone(group)
            drop = f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'
            subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-c", drop], check=False, capture_output=True)


def _master_pid(group: int) -> int:
    out = subprocess.run(["ps", "-eww", "-o", "pid=,pgid=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()]
    pids = [int(r[0]) for r in rows if len(r) == 3 and int(r[1]) == group and "master serve" in r[2]]
    assert len(pids) == 1, out
    return pids[0]


def _wait_gone(group: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
