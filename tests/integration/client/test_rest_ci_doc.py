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
from tests.integration.client.harness import Platform, free_port, noop_metrics

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


async def run_script(script: str, timeout_s: float) -> tuple[int, str, str]:
    """The script under plain ``bash`` (no flags: the script sets its own), its status, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("jq") is None, reason="needs curl and jq")
async def test_the_ci_script_runs_against_a_live_master(http_platform: Platform) -> None:
    assert http_platform.http_url is not None
    script = ci_script(http_platform.http_url, TOKENS["alice"])
    code, out, err = await run_script(script, 60)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
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
    code, out, err = await run_script(script, 120)
    assert code != 0, out
    assert "jq: error (at <stdin>" in err and "no request finished with an acc metric" in err
    assert "compile error" not in err
    assert "null" not in out.splitlines()[-1]  # no null winner printed


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("jq") is None, reason="needs curl and jq")
async def test_the_ci_script_stops_at_once_on_a_wrong_token(http_platform: Platform) -> None:
    assert http_platform.http_url is not None
    rest = RestClient(http_platform.http_url, TOKENS["alice"])
    before = await asyncio.to_thread(rest.get, "/studies")
    code, out, err = await run_script(ci_script(http_platform.http_url, "not-a-token"), 60)
    assert code != 0 and out == ""
    assert "401" in err  # curl -f names the status; nothing after the refused call ran
    assert await asyncio.to_thread(rest.get, "/studies") == before


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("jq") is None, reason="needs curl and jq")
async def test_the_ci_script_stops_at_once_when_the_master_is_down() -> None:
    code, out, err = await run_script(ci_script(f"http://127.0.0.1:{free_port()}", TOKENS["alice"]), 60)
    assert code != 0 and out == ""
    assert "Failed to connect" in err or "Connection refused" in err
