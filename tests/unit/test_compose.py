"""deploy/compose is checked against the code, since no Docker engine runs here: every service, port,
volume, health check and dependency; every command a real entry point of the package; every
STAGETREE_* variable a real setting, whose values load into the settings classes; every required
variable given in .env.example; the Dockerfile's stages and .dockerignore (tests/deploy_checks.py)."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from pydantic_settings import BaseSettings

from stagetree.cli import GROUPS
from tests import deploy_checks as checks

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose"
STAGETREE_SERVICES = {"migrate", "master", "aggregator-1", "aggregator-2", "nodemanager", "nodemanager-cpu"}
NODE_MANAGERS = ("nodemanager", "nodemanager-cpu")
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    return doc


def _settings_classes() -> dict[str, type[BaseSettings]]:
    from stagetree.aggregator.settings import AggregatorSettings
    from stagetree.master.settings import MasterSettings
    from stagetree.nodemanager.settings import NodeManagerSettings

    return {
        "STAGETREE_MASTER_": MasterSettings,
        "STAGETREE_AGG_": AggregatorSettings,
        "STAGETREE_NM_": NodeManagerSettings,
    }


def _has_field(cls: type[BaseModel], path: list[str]) -> bool:
    name, rest = path[0].lower(), path[1:]
    field = cls.model_fields.get(name)
    if field is None:
        return False
    if not rest:
        return True
    sub = field.annotation
    return isinstance(sub, type) and issubclass(sub, BaseModel) and _has_field(sub, rest)


def test_topology(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "kafka", "redis", "minio", "minio-bucket"} | STAGETREE_SERVICES
    assert services["kafka"]["image"].startswith("apache/kafka:")  # the official image, KRaft mode
    assert "controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]
    assert set(compose["volumes"]) == {"pgdata", "kafkadata", "miniodata", "nmwork"}
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    for nm in NODE_MANAGERS:  # checkpoints in MinIO, through the S3 settings; the nodemanager image
        env = services[nm]["environment"]
        assert env["STAGETREE_NM_CHECKPOINT_ROOT"].startswith("s3://")
        assert env["STAGETREE_NM_S3_ENDPOINT_URL"] == "http://minio:9000"
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"} <= set(env)
        assert services[nm]["build"]["target"] == "nodemanager" and services[nm]["depends_on"]["minio-bucket"]
    for name in STAGETREE_SERVICES - set(NODE_MANAGERS):
        assert services[name]["build"]["target"] == "service", name  # the slim image, no torch
    gpu = services["nodemanager"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert "deploy" not in services["nodemanager-cpu"]
    assert services["nodemanager"]["profiles"] == ["gpu"] and services["nodemanager-cpu"]["profiles"] == ["cpu"]
    assert sorted(services["master"]["ports"]) == [
        "${STAGETREE_GRPC_PORT:-50051}:50051",
        "${STAGETREE_HTTP_PORT:-8080}:8080",
    ]


def test_health_checks_and_dependencies(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("postgres", "kafka", "redis", "minio", "master"):
        hc = services[name]["healthcheck"]
        assert hc["test"] and hc["retries"] >= 3, name
    for name, svc in services.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert spec["condition"] in CONDITIONS
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no health check"
    assert services["migrate"]["restart"] == "no" and services["minio-bucket"]["restart"] == "no"
    for name in STAGETREE_SERVICES - {"migrate"}:  # (the master's health check: test_deploy_checks_pass)
        assert services[name]["depends_on"].get("migrate", services[name]["depends_on"].get("master")), name
    assert services["master"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_every_command_is_a_real_entry_point(compose: dict[str, Any]) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["stagetree"] == "stagetree.cli:main"
    assert 'ENTRYPOINT ["stagetree"]' in (COMPOSE / "Dockerfile").read_text()
    for name in STAGETREE_SERVICES:
        argv = [str(a) for a in compose["services"][name]["command"]]
        module, keep_word, _ = GROUPS[argv[0]]
        parser = importlib.import_module(module)._parser()
        parser.parse_args(argv if keep_word else argv[1:])  # exits (fails the test) on an unknown command


def test_every_stagetree_variable_is_a_real_setting(compose: dict[str, Any]) -> None:
    seen = 0
    for name, svc in compose["services"].items():
        for var in svc.get("environment") or {}:
            if var.startswith("STAGETREE_"):
                seen += 1
                assert checks.variable_problem(var) is None, f"{name}: {checks.variable_problem(var)}"
    assert seen >= 20
    # nothing is allowed on credit: the S3 checkpoint settings are real fields now
    assert frozenset() == checks.PENDING_SETTINGS
    assert checks.variable_problem("STAGETREE_NM_S3_ENDPOINT_URL") is None
    assert checks.variable_problem("STAGETREE_NM_S3_ENDPOINT") is not None  # a typo is still one


def test_tokens_reach_containers_as_secret_files(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("master", *NODE_MANAGERS):
        env = services[name]["environment"]
        assert not [v for v in env if "TOKEN" in v and not v.endswith("_FILE")], name
        for var, path in env.items():
            if var.endswith("TOKEN_FILE") or var.endswith("TOKENS_FILE"):
                assert path.removeprefix("/run/secrets/") in services[name]["secrets"], (name, var)
    assert compose["secrets"]["stagetree_admin_token"] == {"environment": "STAGETREE_ADMIN_TOKEN"}


def test_deploy_checks_pass() -> None:
    """Every compose file (compose.yaml, compose.tls.yaml): commands, targets, variables that load into the
    settings classes, declared secrets, health checks on real routes; the Dockerfile and .dockerignore."""
    checked, problems = checks.compose_problems()
    assert problems == [] and checked >= 10
    dockerignore = (ROOT / ".dockerignore").read_text()
    assert checks.dockerfile_problems((COMPOSE / "Dockerfile").read_text(), dockerignore) == []
    for heavy in (".venv", ".git", "tests", "docs"):
        assert checks._ignored(heavy, dockerignore), heavy
    assert not checks._ignored("services", dockerignore) and not checks._ignored("pyproject.toml", dockerignore)


def test_dockerfile_checks_catch_a_base_without_the_tools() -> None:
    text = (COMPOSE / "Dockerfile").read_text()
    # the old mistake: the CUDA runtime base has no python
    broken = text.replace("python3 -m venv /opt/venv", "true").replace(
        "python3 python3-venv ca-certificates", "ca-certificates"
    )
    problems = "\n".join(checks.dockerfile_problems(broken))
    assert "RUN uses `pip`, which its base nvidia/cuda" in problems
    assert "ENTRYPOINT 'stagetree' is not installed" in problems
    torch_in_slim = text.replace("[master,aggregator]", "[master,nodemanager]")
    assert "extra [nodemanager] pulls torch" in "\n".join(checks.dockerfile_problems(torch_in_slim))
    quoted = text.replace('"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"', '"${TORCH_SPEC}"')
    assert "build argument TORCH_VERSION is never used" in "\n".join(checks.dockerfile_problems(quoted))
    ignored = checks.dockerfile_problems(text, "*\n!pyproject.toml\n!README.md\n")
    assert any("COPY services, which .dockerignore leaves out" in p for p in ignored)


def test_env_example_gives_every_required_variable() -> None:
    text = (COMPOSE / "compose.yaml").read_text()
    required = set(re.findall(r"\$\{(\w+):\?", text))
    given = {
        line.split("=", 1)[0]
        for line in (COMPOSE / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert required and required <= given, f"add to .env.example: {sorted(required - given)}"
    assert "COMPOSE_PROFILES" in given
