"""Deployability benchmark: ``python -m tests.bench.deploy``.

1. Renders every Kubernetes overlay (``kubectl kustomize``) and checks it, and checks the compose files,
   the Dockerfile and .dockerignore, with the tests' own checks (tests/deploy_checks.py).
2. Starts two process clusters side by side (``stagetree.cluster.ProcessCluster``: master, one
   aggregator, two CPU node managers with two slots each, Tansu, the local Postgres and Redis), one in
   plaintext and one over mutual TLS (a throwaway CA), both with every token handed over as a secret file.
   Then runs a 16-trial study (the digits MLP, trained for real, each trial to step ``STEPS``) on each,
   interleaved (plain, TLS, plain, TLS, ...; each study its own fixed part, so nothing is shared) and
   compares wall times: ``tls_overhead`` = the median over rounds of TLS wall / plaintext wall of the
   same round.
3. Greps every file both clusters wrote (service logs, worker logs, specs; not the secret files
   themselves, <root>/<cluster>/secrets/) for the tokens: ``tokens_in_logs`` is how many files hold one.

Last line: ``overlays=<n> manifests_checked=<n> problems=<n> tls_study_ok=<true|false> tls_overhead=<r>
tokens_in_logs=<n>`` (targets: overlays >= 2, problems=0, tls_study_ok=true, tls_overhead <= 1.05,
tokens_in_logs=0).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from stagetree.client.sdk import connect
from stagetree.cluster import ClusterConfig, ProcessCluster
from tests import deploy_checks as checks
from tests.bench.record import record
from tests.e2e.helpers import new_study

log = logging.getLogger("bench.deploy")

TRIALS, STEPS = 16, 24
LRS = [round(0.01 * 1.15**i, 6) for i in range(TRIALS)]


def static_figures() -> tuple[int, int, list[str]]:
    """(overlays, manifests checked, problems) over Kubernetes, compose and the Dockerfile."""
    overlays, manifests, problems = checks.kubernetes_problems()
    services, compose = checks.compose_problems()
    dockerfile = checks.dockerfile_problems(
        (checks.COMPOSE / "Dockerfile").read_text(), (checks.ROOT / ".dockerignore").read_text()
    )
    return overlays, manifests + services + 1, problems + compose + dockerfile


async def one_study(cluster: ProcessCluster, name: str) -> tuple[float, bool]:
    """Wall time of a 16-trial study on ``cluster`` and whether every trial reported its metrics."""
    async with connect(cluster.target, token=cluster.token, tls=cluster.client_tls or False) as client:
        t0 = time.perf_counter()
        study = await new_study(client, name)
        results = await asyncio.wait_for(asyncio.gather(*(study.eval({"lr": lr}, STEPS) for lr in LRS)), 600)
        wall = time.perf_counter() - t0
    return wall, len(results) == TRIALS and all("accuracy" in r for r in results)


def files_holding(root: Path, secrets: list[str], skip: set[Path]) -> list[Path]:
    out = []
    for path in root.rglob("*"):
        if path.is_file() and not skip & set(path.parents):
            data = path.read_bytes()
            if any(s.encode() in data for s in secrets):
                out.append(path)
    return out


async def studies(root: Path, rounds: int) -> tuple[bool, float, int]:
    def config(name: str, tls: bool) -> ClusterConfig:
        return ClusterConfig(root=root / name, node_managers=2, aggregators=1, cpu_slots=2, tls=tls, token_files=True)

    plain, secure = ProcessCluster(config("plain", False)), ProcessCluster(config("mtls", True))
    walls: dict[str, list[float]] = {"plain": [], "mtls": []}
    ok = True
    try:
        for c in (plain, secure):
            await asyncio.to_thread(c.start)
        await one_study(plain, "warmup-plain")  # first-use costs (imports, plan creation) out of the figures
        await one_study(secure, "warmup-mtls")
        for i in range(rounds):
            for name, cluster in (
                (("plain", plain), ("mtls", secure))
                if i % 2 == 0
                else (
                    ("mtls", secure),
                    ("plain", plain),
                )
            ):
                wall, good = await one_study(cluster, f"bench-{name}-{i}")
                walls[name].append(wall)
                ok = ok and good
                print(f"round {i} {name:<5} wall_s={wall:.2f} ok={good}", flush=True)
    finally:
        for c in (plain, secure):
            await asyncio.to_thread(c.stop)
    tokens = [plain.token, plain.admin_token, secure.token, secure.admin_token]
    leaks = files_holding(root, tokens, skip={plain.root / "secrets", secure.root / "secrets"})
    for path in leaks:
        print(f"a token is in {path}", flush=True)
    # each TLS study against the plaintext one run next to it (the machine's load drifts between rounds)
    overhead = statistics.median(t / p for t, p in zip(walls["mtls"], walls["plain"], strict=True))
    return ok and secure.client_tls is not None, overhead, len(leaks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=None, help="clusters' logs and checkpoints (default: a temp dir)")
    p.add_argument("--rounds", type=int, default=6, help="studies per cluster, interleaved")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    overlays, manifests, problems = static_figures()
    for problem in problems:
        print(f"problem: {problem}", flush=True)
    root = ns.root or Path(tempfile.mkdtemp(prefix="stagetree-bench-deploy-"))
    ok, overhead, leaks = asyncio.run(studies(root, ns.rounds))
    print(
        record(
            "deploy",
            f"overlays={overlays} manifests_checked={manifests} problems={len(problems)} "
            f"tls_study_ok={'true' if ok else 'false'} tls_overhead={overhead:.3f} tokens_in_logs={leaks}",
        )
    )
    good = overlays >= 2 and not problems and ok and overhead <= 1.05 and leaks == 0
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
