"""A whole study over mutual TLS on the process cluster, with every token handed over as a secret file:
the study finishes, a node manager without a client certificate never gets in, and no log of any
service or worker holds a token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagetree.client.sdk import connect
from stagetree.cluster import ClusterConfig, ProcessCluster
from tests.e2e.conftest import E2E_CONFIG, require_platform
from tests.e2e.helpers import LRS, new_study

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    require_platform()
    root: Path = tmp_path_factory.mktemp("tls-cluster")
    config = ClusterConfig(
        root=root,
        node_managers=1,
        aggregators=1,
        cpu_slots=2,
        tls=True,
        token_files=True,
        **E2E_CONFIG,  # type: ignore[arg-type]
    )
    with ProcessCluster(config) as c:
        yield c


def files_holding(root: Path, secrets: list[str], skip: set[Path]) -> list[str]:
    """Every file under ``root`` (logs, worker logs, specs) that holds one of ``secrets``."""
    found = []
    for path in root.rglob("*"):
        if not path.is_file() or any(p in path.parents for p in skip):
            continue
        data = path.read_bytes()
        found += [f"{path} holds token #{i}" for i, s in enumerate(secrets) if s.encode() in data]
    return found


async def test_a_study_over_mutual_tls_with_tokens_from_files_logs_no_token(tls_cluster: ProcessCluster) -> None:
    cluster = tls_cluster
    assert cluster.rest_url.startswith("https://") and cluster.client_tls is not None
    async with connect(cluster.target, token=cluster.token, tls=cluster.client_tls) as client:
        study = await new_study(client, "tls")
        results = await asyncio.wait_for(asyncio.gather(*(study.eval({"lr": lr}, 6) for lr in LRS[:4])), 120)
    assert len(results) == 4 and all("accuracy" in r for r in results)

    # the same node manager without its client certificate: the master refuses the handshake
    name = cluster._define_node_manager()
    env = cluster.services[name].env
    for var in ("STAGETREE_NM_TLS__CERT_FILE", "STAGETREE_NM_TLS__KEY_FILE"):
        del env[var]
    cluster._launch(name)
    deadline = time.monotonic() + 30
    while "STAGETREE_NM_TLS__CERT_FILE" not in cluster.log(name) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert "STAGETREE_NM_TLS__CERT_FILE" in cluster.log(name), cluster.log_tail(name)
    assert "registered with the master" not in cluster.log(name)
    cluster.stop_service(name)

    tokens = [cluster.token, cluster.admin_token]
    assert not any(t in str(svc.env) for svc in cluster.services.values() for t in tokens)  # files, not variables
    leaks = files_holding(cluster.root, tokens, skip={cluster.root / "secrets"})
    assert leaks == [], leaks
    assert "PLAINTEXT" not in cluster.log("master")
