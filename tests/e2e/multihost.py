"""The multi-host cluster of the e2e tests and ``tests.bench.multihost``: node managers in network
namespaces (``tests.e2e.netns``), each with its own directories, sharing nothing with the master's side
but the network; the master, one aggregator, the Tansu broker and a moto S3 server listen on the bridge's
address (Postgres and Redis stay on loopback: only the master and the aggregator use them); checkpoints go
to ``s3://`` so any host resumes any of them.

``MultiHost`` starts it; ``stale_reports`` counts the reports the ledger refused as stale (fencing by
attempt); ``duplicated_metrics`` and ``lost_requests`` are the checks every scenario ends with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stagetree.client.sdk import Study
from stagetree.cluster import ClusterConfig, ProcessCluster
from tests.e2e.helpers import query, requests
from tests.e2e.netns import Host, NetnsLab
from tests.s3server import CREDENTIALS, S3Server, start_moto

HEARTBEAT_TTL_S = 8.0  # short, yet long enough that a loaded 2-core machine does not lapse spuriously
STALE = "stale batch report ignored"


@dataclass
class MultiHost:
    lab: NetnsLab
    s3: S3Server
    bucket: str
    cluster: ProcessCluster
    hosts: dict[str, Host]  # node manager service name -> its host

    def host_of(self, nm_id: str) -> Host:
        name = next(n for n in self.cluster.node_manager_names() if self.cluster.node_manager_id(n) == nm_id)
        return self.hosts[name]

    def nm_of(self, host: Host) -> str:
        name = next(n for n, h in self.hosts.items() if h is host)
        return self.cluster.node_manager_id(name)

    def stale_reports(self) -> int:
        return sum(self.cluster.log(n).count(STALE) for n in ["master", *self.cluster.aggregator_names()])


@contextlib.contextmanager
def multihost(root: Path, hosts: int = 2, **config: object) -> Iterator[MultiHost]:
    """The cluster with ``hosts`` node managers, one per namespace; everything is removed on exit."""
    with NetnsLab() as lab:
        s3 = start_moto(lab.gateway, log=root / "moto.log")
        try:
            bucket = s3.new_bucket("stagetree-multihost")
            settings = {
                "node_managers": 0,
                "aggregators": 1,
                "heartbeat_ttl_s": HEARTBEAT_TTL_S,
                "peripheral_every_s": 0.5,
                "max_attempts": 3,
                "reconnect_max_s": 0.5,
                **config,
            }
            cc = ClusterConfig(
                root=root,
                host=lab.gateway,
                checkpoint_root=f"s3://{bucket}/checkpoints",
                s3_endpoint_url=s3.url,
                extra_env=dict(CREDENTIALS),
                **settings,  # type: ignore[arg-type]
            )
            with ProcessCluster(cc) as cluster:
                placed: dict[str, Host] = {}
                for i in range(hosts):
                    host = lab.add_host(f"h{i + 1}")
                    placed[cluster.add_node_manager(wrap=host.wrap(), timeout_s=90)] = host
                yield MultiHost(lab, s3, bucket, cluster, placed)
        finally:
            s3.stop()


def duplicated_metrics(cluster: ProcessCluster, plan: int) -> int:
    sql = "SELECT m.node_id, m.step FROM metrics m JOIN nodes n ON n.id = m.node_id WHERE n.plan_id = :p"
    rows = [(int(n), int(s)) for n, s in query(cluster, sql, p=plan)]
    return len(rows) - len(set(rows))


def lost_requests(cluster: ProcessCluster, study: Study) -> int:
    """Requests not DONE, or DONE without a metric at their point."""
    rows = requests(cluster, study)
    sql = "SELECT node_id, step FROM metrics"
    have = {(int(n), int(s)) for n, s in query(cluster, sql)}
    return sum(1 for r in rows if r.state != "DONE" or (int(r.node_id), int(r.step)) not in have)
