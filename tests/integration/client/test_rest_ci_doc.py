"""docs/rest-ci.md's CI script, run verbatim with bash against a live master (Postgres, REST under uvicorn,
a no-op node manager). Only the variables the page tells the reader to set are substituted."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest

from stagetree.client.cli import RestClient
from stagetree.core.config import Config
from tests.integration.client.conftest import TOKENS
from tests.integration.client.harness import Platform, noop_metrics

PAGE = Path(__file__).resolve().parents[3] / "docs" / "rest-ci.md"
SECTION = "## The CI script"


def ci_script(url: str, token: str) -> str:
    """The bash blocks of the section, with ``STAGETREE_URL`` and ``STAGETREE_TOKEN`` set to ours."""
    text = PAGE.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    blocks = re.findall(r"```bash\n(.*?)```", text[start : end if end >= 0 else None], flags=re.S)
    assert len(blocks) >= 2, "the section should hold the variables block and the script"
    script = "\n".join(blocks)
    script, n_url = re.subn(r"(?m)^export STAGETREE_URL=\S+", f"export STAGETREE_URL={url}", script)
    script, n_token = re.subn(r"(?m)^export STAGETREE_TOKEN=\S+", f"export STAGETREE_TOKEN={token}", script)
    assert n_url == 1 and n_token == 1, "the page must tell the reader to set STAGETREE_URL and STAGETREE_TOKEN"
    return script


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("jq") is None, reason="needs curl and jq")
async def test_the_ci_script_runs_against_a_live_master(http_platform: Platform) -> None:
    assert http_platform.http_url is not None
    script = ci_script(http_platform.http_url, TOKENS["alice"])
    proc = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(line) for line in out.decode().splitlines()]
    submitted, best = lines[:-1], lines[-1]
    assert [s["client_request_id"] for s in submitted] == ["step-decay", "half-decay", "constant"]
    lr = {"kind": "multistep", "init": 0.1, "milestones": [20], "gamma": 0.5}
    assert best == {
        "client_request_id": "half-decay",
        "step": 30,
        "acc": noop_metrics(Config.of({"lr": lr}), 30)["acc"],
    }
    rest = RestClient(http_platform.http_url, TOKENS["alice"])
    study = next(s for s in await asyncio.to_thread(rest.get, "/studies") if s["name"].startswith("ci-lr-sweep-"))
    states = {r["state"] for r in await asyncio.to_thread(rest.get, f"/studies/{study['id']}/requests")}
    assert states == {"DONE"}
    # the three schedules agree on [0, 20): trained once, then 10 steps each
    key = (await asyncio.to_thread(rest.get, f"/studies/{study['id']}/plan"))["key"]
    assert sum(b.steps for b in http_platform.node_manager.batches if b.plan_key == key) == 20 + 3 * 10


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("jq") is None, reason="needs curl and jq")
async def test_the_ci_script_fails_the_job_when_no_request_succeeded(http_platform: Platform) -> None:
    assert http_platform.http_url is not None
    http_platform.node_manager.fail_if = lambda _config: "RuntimeError: the trainer raised"
    script = ci_script(http_platform.http_url, TOKENS["bob"])  # bob's own plan: nothing trained before
    proc = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode != 0, out.decode()
    assert "jq: error (at <stdin>" in err.decode() and "no request finished with an acc metric" in err.decode()
    assert "compile error" not in err.decode()
    assert "null" not in out.decode().splitlines()[-1]  # no null winner printed
