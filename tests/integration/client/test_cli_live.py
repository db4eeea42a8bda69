"""The client CLI against a live master's REST API (Postgres, uvicorn, a no-op node manager)."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

import stagetree
from stagetree import cli as main_cli
from stagetree.client import cli
from stagetree.core.sequences import MultiStep
from tests.integration.client.conftest import ADMIN_TOKEN, TOKENS
from tests.integration.client.harness import Platform


async def test_cli_commands_against_a_live_master(http_platform: Platform, capsys: pytest.CaptureFixture[str]) -> None:
    p = http_platform
    assert p.http_url is not None
    async with stagetree.connect(p.grpc_target, token=TOKENS["alice"]) as client:
        study = await stagetree.Study.create(
            client, f"cli-{uuid.uuid4().hex[:8]}", trainer=f"pkg.train:Net{uuid.uuid4().hex[:6]}", tuned=["lr"]
        )
        await asyncio.gather(*(study.eval({"lr": MultiStep(0.1, [5], g)}, 10) for g in (0.1, 0.5, 2.0)))
        sdk_best = await study.best("acc")
    assert sdk_best is not None

    async def run(*args: str, token: str = TOKENS["alice"]) -> tuple[int, Any, str]:
        status = await asyncio.to_thread(cli.main, [*args, "--url", p.http_url or "", "--token", token, "--json"])
        out, err = capsys.readouterr()
        return status, json.loads(out), err

    status, studies, _ = await run("study", "list")
    assert status == 0 and study.id in {s["id"] for s in studies}
    status, shown, _ = await run("study", "show", study.id)
    assert shown["requests"] == {"total": 3, "by_state": {"DONE": 3}} and shown["metrics"] == ["acc", "loss"]
    assert (await run("study", "show", study.name))[1] == shown  # a study by its name too
    status, stats, _ = await run("study", "stats", study.name)
    assert status == 0 and stats == (await run("study", "stats", study.id))[1]
    status, error, err = await run("study", "show", "no-such-study")
    assert status == 1 and error["error"] == "NOT_FOUND" and "no-such-study" in err
    status, error, _ = await run("study", "show", study.name, token=TOKENS["bob"])  # bob's names, not alice's
    assert status == 1 and error["error"] == "NOT_FOUND"
    status, best, _ = await run("study", "best", study.id, "--metric", "acc")
    assert status == 0 and best["request"]["request_id"] == sdk_best.request_id
    assert best["request"]["metrics"] == sdk_best.metrics and best["config"] is not None
    status, plan, _ = await run("plan", "show", study.id)
    assert status == 0 and len(plan["nodes"]) == 3  # one path, two branches at step 5
    status, nodes, _ = await run("nodes", token=ADMIN_TOKEN)
    (mine,) = [n for n in nodes if n["node_manager_id"] == p.node_manager.node_manager_id]
    assert mine["state"] == "ALIVE" and len(mine["slots"]) == 4
    status, error, err = await run("nodes")
    assert status == 1 and error["error"] == "PERMISSION_DENIED" and "admin token" in err

    text_status = await asyncio.to_thread(
        main_cli.main, ["plan", "show", study.id, "--url", p.http_url, "--token", TOKENS["alice"]]
    )
    lines = capsys.readouterr().out.splitlines()
    assert text_status == 0 and lines[0].startswith("plan ") and lines[1].startswith("3 nodes")
    assert lines[2].startswith("#") and lines[3].startswith(("├─ #", "└─ #"))
