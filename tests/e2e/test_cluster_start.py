"""A cluster started from a process busy with gRPC (live channels, an event loop, busy threads: a test
run, a user's script that used the SDK) comes up whole, and so does each service started again in it."""

from __future__ import annotations

from pathlib import Path

from stagetree.cluster import ClusterConfig, ProcessCluster
from tests.e2e.conftest import require_platform
from tests.grpc_noise import busy_grpc


def test_a_cluster_starts_and_restarts_from_a_process_busy_with_grpc(tmp_path: Path) -> None:
    require_platform()
    with busy_grpc() as noise:
        calls = noise.calls
        with ProcessCluster(ClusterConfig(root=tmp_path, node_managers=1, aggregators=1)) as cluster:
            names = list(cluster.services)
            assert len(names) == 3 and all(cluster.alive(n) for n in names)
            for name in names:
                cluster.restart(name, wait=False)
            for name in names:
                cluster.wait_ready(name, timeout_s=120)
            for name in names:
                assert cluster.services[name].starts == 2
                assert "epoll_wait error" not in cluster.log(name), cluster.log_tail(name)
        assert noise.calls > calls
