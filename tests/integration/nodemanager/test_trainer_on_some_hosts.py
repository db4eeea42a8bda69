"""A trainer module installed on some node managers' hosts only: a node manager whose workers cannot
import it reports a host problem, the master hands the work to one that can (no retry counted, the
plan's later work avoids that node manager), and when no live node manager can import it the requests
fail once, saying why for each. Real master (Postgres and SQLite, scheduling loop), two node managers in
this process, real digits training in worker processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from stagetree.master.app import MasterApp
from tests.integration.nodemanager.helpers import (
    RunningNodeManager,
    config_json,
    finished,
    fixed_part,
    start_node_manager,
    submit,
    unique,
)

pytestmark = pytest.mark.timeout(600)


def project_with_trainer(tmp: Path) -> tuple[Path, str]:
    """A directory holding a trainer module of its own (on no worker's path unless given), and its name."""
    project = tmp / "project"
    project.mkdir()
    module = f"host_trainer_{unique('m').replace('-', '_')}"
    (project / f"{module}.py").write_text("from stagetree.nodemanager.examples.digits import DigitsMLP as Net\n")
    return project, module


async def two_node_managers(target: str, tmp: Path, with_module: Path | None) -> list[RunningNodeManager]:
    """Node managers ``a-*`` (first in the slots' order: the rounds try it first), without the module, and
    ``b-*``, with ``with_module`` on its workers' path when given."""
    tag = unique("h")
    a = await start_node_manager(target, tmp / "a", node_manager_id=f"a-{tag}")
    b = await start_node_manager(
        target, tmp / "b", node_manager_id=f"b-{tag}", user_path=str(with_module) if with_module else ""
    )
    return [a, b]


def host_problems(nm: RunningNodeManager) -> list[str]:
    return [end.error for _, end in nm.reporter.ends if end.status == "failed" and end.host_problem]


async def test_work_a_node_manager_cannot_import_goes_to_one_that_can_and_costs_no_retry(
    scheduling: MasterApp, grpc_target: str, tmp_path: Path
) -> None:
    project, module = project_with_trainer(tmp_path)
    a, b = await two_node_managers(grpc_target, tmp_path, with_module=project)
    try:
        fixed = fixed_part(f"{module}:Net", seed=3)
        study, ids = await submit(scheduling, [(config_json(fixed, lr=0.1), 4)])
        (rec,) = await finished(scheduling, study, ids, timeout=240)
        assert rec.state == "DONE" and set(rec.metrics or {}) == {"accuracy", "loss"}, rec.error
        assert not rec.error  # no failure was counted: the host's problem is not the work's
        (problem,) = host_problems(a)  # tried first, on the host that lacks the module
        assert f"no module named {module!r}" in problem
        assert not host_problems(b) and [e.status for _, e in b.reporter.ends] == ["finished"]

        # the plan's next work goes to the node manager that can run it, without trying the other again
        _, more = await submit(scheduling, [(config_json(fixed, lr=0.2), 4), (config_json(fixed, lr=0.3), 4)], study)
        recs = await finished(scheduling, study, more, timeout=240)
        assert [r.state for r in recs] == ["DONE", "DONE"], [r.error for r in recs]
        assert len(a.reporter.ends) == 1 and len(b.reporter.ends) == 3
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_a_trainer_no_node_manager_can_import_fails_once_saying_why_for_each(
    scheduling: MasterApp, grpc_target: str, tmp_path: Path
) -> None:
    _, module = project_with_trainer(tmp_path)
    a, b = await two_node_managers(grpc_target, tmp_path, with_module=None)
    try:
        study, ids = await submit(scheduling, [(config_json(fixed_part(f"{module}:Net"), lr=0.1), 4)])
        (rec,) = await finished(scheduling, study, ids, timeout=240)
    finally:
        await asyncio.gather(a.close(), b.close())
    assert rec.state == "FAILED"
    error = rec.error or ""
    assert "no node manager can run this plan's trainer" in error, error
    for nm in (a, b):  # each tried once, and named with its reason
        assert len(host_problems(nm)) == 1
        assert f"{nm.nm.id}: trainer entry point '{module}:Net': no module named {module!r}" in error, error
    assert "Traceback" not in error
