"""deploy/compose is checked against the code, since no Docker engine runs here: every service, port,
volume, health check and dependency; every command a real entry point of the package; every
STAGETREE_* variable a real setting; every required variable given in .env.example."""

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

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose"
STAGETREE_SERVICES = {"migrate", "master", "aggregator-1", "aggregator-2", "nodemanager", "nodemanager-cpu"}
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
    assert set(services) == {"postgres", "kafka", "redis"} | STAGETREE_SERVICES
    assert services["kafka"]["image"].startswith("apache/kafka:")  # the official image, KRaft mode
    assert "controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]
    assert set(compose["volumes"]) == {"pgdata", "kafkadata", "checkpoints"}
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    for nm in ("nodemanager", "nodemanager-cpu"):  # one shared checkpoint volume
        assert "checkpoints:/var/lib/stagetree/checkpoints" in services[nm]["volumes"]
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
    for name in ("postgres", "kafka", "redis", "master"):
        hc = services[name]["healthcheck"]
        assert hc["test"] and hc["retries"] >= 3, name
    for name, svc in services.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert spec["condition"] in CONDITIONS
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no health check"
    assert services["migrate"]["restart"] == "no"
    for name in STAGETREE_SERVICES - {"migrate"}:
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
    classes = _settings_classes()
    seen = 0
    for name, svc in compose["services"].items():
        for var in svc.get("environment") or {}:
            prefix = next((p for p in classes if var.startswith(p)), None)
            if prefix is None:
                continue
            seen += 1
            path = var[len(prefix) :].split("__")
            assert _has_field(classes[prefix], path), f"{name}: {var} is not a setting of {classes[prefix].__name__}"
    assert seen >= 20


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
