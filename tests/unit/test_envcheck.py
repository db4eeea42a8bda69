"""A mistyped STAGETREE_* variable stops a service at start, naming the variable and the one meant."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stagetree.aggregator.settings import AggregatorSettings
from stagetree.envcheck import unknown_variables
from stagetree.master.settings import MasterSettings
from stagetree.nodemanager.settings import NodeManagerSettings
from tests.deploy_checks import PENDING_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
SERVICES = [
    (MasterSettings, "STAGETREE_MASTER_"),
    (AggregatorSettings, "STAGETREE_AGG_"),
    (NodeManagerSettings, "STAGETREE_NM_"),
]


def test_a_single_underscore_for_a_double_is_named_with_the_fix() -> None:
    (msg,) = unknown_variables(MasterSettings, "STAGETREE_MASTER_", {"STAGETREE_MASTER_AUTH_TOKENS": "{}"})
    assert msg == "STAGETREE_MASTER_AUTH_TOKENS is not a setting; did you mean STAGETREE_MASTER_AUTH__TOKENS?"
    (msg,) = unknown_variables(NodeManagerSettings, "STAGETREE_NM_", {"STAGETREE_NM_CPU_SLOT": "2"})
    assert "did you mean STAGETREE_NM_CPU_SLOTS?" in msg


def test_real_settings_other_services_and_client_variables_pass() -> None:
    env = {
        "STAGETREE_MASTER_AUTH__TOKENS": "{}",
        "STAGETREE_MASTER_AUTH__TOKENS__alice": "x",  # a key of a dict field
        "STAGETREE_MASTER_SCHEDULING__MAX_ATTEMPTS": "3",
        "STAGETREE_NM_CPU_SLOTS": "2",  # another service's
        "STAGETREE_MASTER": "127.0.0.1:50051",  # the SDK's target, not a master setting
        "STAGETREE_TOKEN": "t",
        "PATH": "/bin",
    }
    assert unknown_variables(MasterSettings, "STAGETREE_MASTER_", env) == []


@pytest.mark.parametrize(("model", "prefix"), SERVICES, ids=[p for _, p in SERVICES])
def test_every_variable_the_deployments_and_docs_set_is_a_setting(model: type, prefix: str) -> None:
    named = set()
    for path in [*ROOT.glob("deploy/**/*"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]:
        if path.is_file():
            named |= set(re.findall(rf"\b{prefix}[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="ignore")))
    assert named, f"no {prefix}* variable found in deploy/ or docs/"
    named -= PENDING_SETTINGS  # the S3 checkpoint settings deploy/ already sets (tests/deploy_checks.py)
    assert unknown_variables(model, prefix, dict.fromkeys(named, "x")) == []


def test_the_master_refuses_to_start_on_a_typo() -> None:
    env = {**os.environ, "STAGETREE_MASTER_AUTH_TOKENS": '{"alice": "t"}', "STAGETREE_MASTER_DATABASE_URL": "sqlite://"}
    out = subprocess.run(
        [sys.executable, "-m", "stagetree.cli", "master", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert "STAGETREE_MASTER_AUTH_TOKENS is not a setting; did you mean STAGETREE_MASTER_AUTH__TOKENS?" in out.stderr
