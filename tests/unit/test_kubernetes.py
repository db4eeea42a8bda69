"""deploy/kubernetes rendered offline (``kubectl kustomize``) and checked against the code: every overlay
has the master Deployment and Service, aggregators, the migration Job, the GPU node-manager DaemonSet,
Secrets for tokens, the database and S3, ConfigMaps without secrets and a NetworkPolicy; probes ask real
routes; every variable is a real setting; only node managers ask for GPUs (tests/deploy_checks.py)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import deploy_checks as checks

pytestmark = pytest.mark.skipif(
    checks.kubectl() is None,
    reason="kubectl is not installed (it renders the kustomize overlays offline; `apt-get install kubectl` "
    "from the Kubernetes apt repository, or put its binary on PATH)",
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {o.name: checks.render(o) for o in checks.overlays()}


def test_at_least_dev_and_production(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert {"dev", "production"} <= set(rendered)


@pytest.mark.parametrize("overlay", [o.name for o in checks.overlays()] if checks.OVERLAYS.exists() else [])
def test_every_overlay_passes_the_checks(overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert checks.manifest_problems(rendered[overlay]) == []


def test_dev_runs_its_stores_and_production_uses_external_ones_over_tls(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    def names(overlay: str, kind: str) -> set[str]:
        return {d["metadata"]["name"] for d in rendered[overlay] if d["kind"] == kind}

    assert {"postgres", "kafka", "redis", "minio"} <= names("dev", "Deployment")
    assert names("production", "Deployment") == {"stagetree-master", "stagetree-aggregator"}
    prod = {(d["kind"], d["metadata"]["name"]): d for d in rendered["production"]}
    master = prod[("Deployment", "stagetree-master")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in master["env"]}
    assert env["STAGETREE_MASTER_TLS__CLIENT_AUTH"] == "true"
    assert master["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    nm = prod[("DaemonSet", "stagetree-nodemanager")]["spec"]["template"]["spec"]["containers"][0]
    assert {"STAGETREE_NM_TLS__CA_FILE", "STAGETREE_NM_TLS__CERT_FILE"} <= {e["name"] for e in nm["env"]}
    assert any(n.startswith("stagetree-master-tls") for n in names("production", "Secret"))


def test_the_checks_catch_what_they_claim_to(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["dev"])
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    master = by[("Deployment", "stagetree-master")]["spec"]["template"]["spec"]["containers"][0]
    master["resources"]["limits"]["nvidia.com/gpu"] = 1
    master["readinessProbe"]["httpGet"]["path"] = "/healthz"
    master["env"].append({"name": "STAGETREE_MASTER_AUTH_TOKENS", "value": "{}"})
    master["image"] = "stagetree-nodemanager:dev"
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("stagetree-master"))
    cm["data"]["STAGETREE_MASTER_AUTH__ADMIN_TOKEN"] = "oops"
    cm["data"]["STAGETREE_MASTER_GRPC_PORT"] = "fifty"
    nm = by[("DaemonSet", "stagetree-nodemanager")]["spec"]["template"]["spec"]
    nm["tolerations"] = []
    problems = "\n".join(checks.manifest_problems(docs))
    for expected in (
        "asks for nvidia.com/gpu; only node managers",
        "asks /healthz, which the REST app does not serve",
        "did you mean STAGETREE_MASTER_AUTH__TOKENS",
        "is not the stagetree image",
        "STAGETREE_MASTER_AUTH__ADMIN_TOKEN is a secret; put it in a Secret",
        "MasterSettings does not load",
        "does not tolerate the nvidia.com/gpu taint",
    ):
        assert expected in problems, (expected, problems)


def test_overlays_render_from_the_repository_only() -> None:
    # offline: a remote base (a URL in resources) would make rendering depend on the network
    for k in checks.KUBERNETES.rglob("kustomization.yaml"):
        resources = yaml.safe_load(k.read_text()).get("resources") or []
        assert not [r for r in resources if "://" in r], k


def test_the_migration_job_runs_as_a_process_with_its_environment(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The Job's command line and variables, as the container runs them; only the secret's mount point is
    here, holding a SQLite URL in place of the production database's."""
    job = next(d for d in rendered["production"] if d["kind"] == "Job" and d["metadata"]["name"] == "stagetree-migrate")
    container = job["spec"]["template"]["spec"]["containers"][0]
    mount = tmp_path / "database"
    mount.mkdir()
    (mount / "url").write_text(f"sqlite:///{tmp_path / 'stagetree.db'}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGETREE_")}
    for e in container["env"]:
        env[e["name"]] = e["value"].replace("/var/run/secrets/stagetree/database", str(mount))
    out = subprocess.run(
        [sys.executable, "-m", "stagetree.cli", *container["args"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "database at revision" in out.stdout and (tmp_path / "stagetree.db").exists()
