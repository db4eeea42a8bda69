"""The dashboard in a real browser (Chromium, Playwright) against a live embedded stagetree whose
workers train the digits MLP: sign-in, live counts, curves equal to what is stored, the stage tree,
a failed trial's error, and owner isolation."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import stagetree
from stagetree.core.sequences import MultiStep
from stagetree.master.auth import Authenticator
from stagetree.master.settings import AuthSettings
from stagetree.nodemanager.examples.digits import ENTRY_POINT
from stagetree.nodemanager.examples.faults import ENTRY_POINT as FAULTY
from tests.browser.conftest import sign_in
from tests.browser.harness import LiveCluster

VALUES = {"hidden": 16, "minibatches": 1}
BRANCH, END = 6, 12
GAMMAS = (0.5, 0.1, 0.01)


async def run_study(
    live: LiveCluster, name: str, *, trainer: str = ENTRY_POINT, values: dict[str, Any] | None = None
) -> tuple[str, list[int | None], list[Any]]:
    """A study of three trials sharing a prefix of ``BRANCH`` steps, trained to ``END``."""
    c = live.cluster
    async with stagetree.connect(c.target, token=c.token) as client:
        study = await stagetree.Study.create(
            client, name, trainer=trainer, seed=0, values=values or VALUES, tuned=["lr", "bs"]
        )
        evs = [study.submit({"lr": MultiStep(0.1, [BRANCH], g), "bs": 32}, END, label=f"g{g}") for g in GAMMAS]
        got = await asyncio.wait_for(asyncio.gather(*evs, return_exceptions=True), 180)
        return study.id, [e.request_id for e in evs], list(got)


def _stored_points(live: LiveCluster, study_id: str) -> int:
    store = live.cluster.app.store
    nodes = [n for pid in store.plans.study_plan_ids(study_id) for n in (r.id for r in store.plans.load_nodes(pid))]
    return sum(store.curves.counts(nodes).values())


def _wait_points(live: LiveCluster, study_id: str, want: int, timeout: float = 30) -> int:
    """The curve points stored for the study once they reach ``want`` (the last batch's points may be
    on the bus a moment after its metrics)."""
    deadline = time.monotonic() + timeout
    while (n := _stored_points(live, study_id)) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def test_sign_in_refuses_a_wrong_token_then_signs_in(live: LiveCluster, page: Any) -> None:
    page.goto(f"{live.url}/")
    page.wait_for_selector("#signin-form")
    page.fill("#token", "not-the-token")
    page.click("#signin-form button")
    page.wait_for_selector("#signin-error:has-text('not accepted')")
    page.fill("#token", live.token)
    page.click("#signin-form button")
    page.wait_for_selector("#studies-table")
    assert page.evaluate("sessionStorage.getItem('stagetree.token')") == live.token


def test_a_live_study_appears_and_its_counts_update_without_a_reload(live: LiveCluster, page: Any) -> None:
    sign_in(page, live)
    page.evaluate("window.__same_page = 1")
    future = asyncio.run_coroutine_threadsafe(run_study(live, "live-counts"), live.bg.loop)
    row = page.wait_for_selector("#studies-table tr:has-text('live-counts')")
    assert row is not None
    page.wait_for_selector(
        "#studies-table tr:has-text('live-counts') [data-state=DONE]:has-text('done 3')", timeout=120_000
    )
    study_id, _, results = future.result(60)
    assert all(isinstance(r, dict) for r in results)
    assert page.evaluate("window.__same_page") == 1  # updated in place, never reloaded
    assert page.locator(f"#studies-table tr[data-study='{study_id}']").count() == 1


def test_curves_draw_every_stored_point_and_the_tree_every_node(live: LiveCluster, page: Any) -> None:
    study_id, rids, _ = live.run(run_study(live, "curves-and-tree"))
    unique_steps = BRANCH + len(GAMMAS) * (END - BRANCH)
    stored = _wait_points(live, study_id, unique_steps)
    assert stored == unique_steps  # a point per step, each shared step once
    sign_in(page, live, where=f"#/study/{study_id}")
    page.wait_for_selector("#curves[data-ready='1']")
    page.wait_for_function(f"document.querySelector('#curves').dataset.drawnPoints == '{stored}'")
    assert page.input_value("#metric") == "train_loss"
    assert page.locator("#trials tbody tr").count() == len(rids)
    # log scale and smoothing redraw the same points
    page.check("#log")
    page.fill("#smooth", "0.5")
    assert page.get_attribute("#curves", "data-drawn-points") == str(stored)

    plan_nodes = len(live.run(_plan(live, study_id))["nodes"])
    page.evaluate(f"location.hash = '#/tree/{study_id}'")
    page.wait_for_selector("#tree[data-ready='1']")
    assert page.get_attribute("#tree", "data-node-count") == str(plan_nodes) and plan_nodes == len(
        GAMMAS
    )  # the root carries the first trial on


async def _plan(live: LiveCluster, study_id: str) -> dict[str, Any]:
    c = live.cluster
    async with stagetree.connect(c.target, token=c.token) as client:
        study = await stagetree.Study.load(client, study_id)
        return await study.plan()


def test_a_failed_trial_shows_its_error(live: LiveCluster, page: Any) -> None:
    values = {**VALUES, "fault": "raise", "fault_step": BRANCH + 2}
    study_id, _, results = live.run(run_study(live, "faulty", trainer=FAULTY, values=values))
    assert all(isinstance(r, Exception) for r in results)
    sign_in(page, live, where=f"#/study/{study_id}")
    cell = page.wait_for_selector("#trials tr[data-state=FAILED] td.error:has-text('injected fault in user code')")
    assert cell is not None and "ValueError" in cell.inner_text()


def test_another_owners_study_is_not_reachable_by_url(live: LiveCluster, page: Any) -> None:
    study_id, _, _ = live.run(run_study(live, "private"))
    app = live.cluster.app
    before = app.auth
    app.auth = Authenticator(
        AuthSettings(tokens={"local": live.token, "bob": "bob-token"}, admin_token=live.cluster.admin_token)
    )
    try:
        sign_in(page, live, token="bob-token")
        assert page.locator("#studies-table tr[data-study]").count() == 0
        for where in (f"#/study/{study_id}", f"#/tree/{study_id}"):
            page.evaluate("w => { location.hash = w }", where)
            page.wait_for_selector("#not-found")
            assert "private" not in page.inner_text("main")
    finally:
        app.auth = before
