"""The dashboard in a real browser (Chromium, Playwright) against a live embedded stagetree whose
workers train the digits MLP: sign-in, live counts, curves equal to what is stored, evaluation metrics
plotted at their rungs, the trials table's filter filtering the charts, the trial page (a failure's
traceback and worker log), the stage tree (search, collapse, focus), events scoped to a study, the
studies list (search, sort, delete), the cluster page, and owner isolation; no page logs an error."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

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


def _errors(page: Any) -> list[str]:
    """What the page reports as broken: script errors, and answers of 400 or more (a favicon aside)."""
    seen: list[str] = []
    page.on("pageerror", lambda e: seen.append(f"page error: {e}"))
    page.on("response", lambda r: seen.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    return seen


def _option(page: Any, selector: str) -> Any:
    """The ECharts option drawn in the element (what a reader of the chart sees: series, legend, axes)."""
    return page.evaluate(
        """sel => { const o = echarts.getInstanceByDom(document.querySelector(sel)).getOption();
        const series = o.series.map((s) => ({ id: s.id, name: s.name, n: (s.data || []).length }));
        return { legend: (o.legend || []).length, series, yName: o.yAxis && o.yAxis[0] ? o.yAxis[0].name : null }; }""",
        selector,
    )


def test_evaluations_are_plotted_at_their_steps_and_the_filter_filters_the_charts(live: LiveCluster, page: Any) -> None:
    study_id, _, _ = live.run(run_study(live, "evals"))
    errors = _errors(page)
    sign_in(page, live, where=f"#/study/{study_id}")
    page.wait_for_selector("#eval-curves[data-ready='1']")
    page.wait_for_function("Number(document.querySelector('#eval-curves').dataset.points) === 3")
    assert page.input_value("#eval-metric") == "accuracy"
    ev = _option(page, "#eval-curves")
    assert ev["legend"] == 1 and sorted(x["name"] for x in ev["series"]) == [f"g{g}" for g in sorted(GAMMAS)]
    assert ev["yName"] == "accuracy (eval)"
    step = _option(page, "#curves")
    assert step["yName"] == "train_loss (train)" and step["legend"] == 1
    assert page.locator("#trials th:has-text('loss (eval)')").count() == 1  # never an unlabelled "loss"
    nodes = int(page.get_attribute("#curves", "data-nodes") or 0)
    page.fill("#filter", "g0.01")
    page.wait_for_function("Number(document.querySelector('#eval-curves').dataset.points) === 1")
    assert int(page.get_attribute("#curves", "data-nodes") or 0) < nodes  # the other trials' own lines went
    assert page.locator("#trials tbody tr").count() == 1
    page.fill("#filter", "")
    page.select_option("#x-axis", "time")
    page.wait_for_function("document.querySelector('#curves').dataset.ready === '1'")
    assert not errors, errors


def test_the_contour_interpolates_the_metric_over_the_two_numeric_choices(live: LiveCluster, page: Any) -> None:
    async def grid() -> str:
        c = live.cluster
        async with stagetree.connect(c.target, token=c.token) as client:
            study = await stagetree.Study.create(
                # a seed of its own: the module's other studies share plans (their fixed parts are equal)
                client,
                "contour",
                trainer=ENTRY_POINT,
                seed=7,
                values=VALUES,
                tuned=["lr", "momentum", "bs"],
            )
            evs = [
                study.submit({"lr": lr, "momentum": mo, "bs": 32}, 4, label=f"lr{lr}-m{mo}")
                for lr in (0.02, 0.2)
                for mo in (0.5, 0.9)
            ]
            await asyncio.wait_for(asyncio.gather(*evs), 180)
            return study.id

    study_id = live.run(grid())
    errors = _errors(page)
    sign_in(page, live, where=f"#/study/{study_id}")
    page.wait_for_selector("#contour[data-ready='1']")
    assert sorted([page.get_attribute("#contour", "data-x"), page.get_attribute("#contour", "data-y")]) == [
        "lr",
        "momentum",
    ]
    assert page.get_attribute("#contour", "data-points") == "4"
    heat, trials = _option(page, "#contour")["series"]
    assert heat["n"] == 28 * 28 and trials["n"] == 4  # the surface, and the trials on it
    assert "over lr and momentum" in page.inner_text("#contour-info") or "over momentum and lr" in page.inner_text(
        "#contour-info"
    )
    assert not errors, errors


def test_a_failed_trial_opens_to_its_traceback_and_worker_log(live: LiveCluster, page: Any) -> None:
    values = {**VALUES, "fault": "raise", "fault_step": BRANCH + 2, "log_every": 2}
    study_id, _, _ = live.run(run_study(live, "trial-page", trainer=FAULTY, values=values))
    errors = _errors(page)
    sign_in(page, live, where=f"#/study/{study_id}")
    page.click("#trials tbody tr[data-state=FAILED]")  # a row opens its trial
    page.wait_for_selector("#traceback")
    tb = page.inner_text("#traceback")
    assert "Traceback (most recent call last)" in tb and "_raise_value_error" in tb and "in train" in tb
    assert page.inner_text("#failure-headline") == "ValueError: injected fault in user code"
    assert page.inner_text("#log-path").endswith(".log")
    page.click("#failure button[data-log]")
    page.wait_for_selector("#worker-log")
    assert "injected fault in user code" in page.inner_text("#worker-log")
    # what the trainer logged (self.log_text) before the fault, beside the log
    assert "train_loss" in page.inner_text("#trainer-lines")
    page.wait_for_selector("#trial-curve[data-ready='1']")
    assert int(page.get_attribute("#trial-curve", "data-points") or 0) > 0
    assert page.locator("#rungs tbody tr[data-state=FAILED]").count() == 1
    assert page.locator("#sharing tbody tr").count() >= 1
    page.wait_for_selector("#schedule-chart[data-ready='1']")
    # the cluster page lists it as a failure, not as a policy's decision
    page.evaluate("location.hash = '#/cluster'")
    page.wait_for_selector("#failures tr[data-trial]")
    assert "injected fault" in page.inner_text("#failures")
    assert "injected fault" not in page.inner_text("#decisions")
    page.wait_for_selector("#utilisation[data-ready='1']")
    assert not errors, errors


def test_the_tree_finds_collapses_and_focuses(live: LiveCluster, page: Any) -> None:
    study_id, _, _ = live.run(run_study(live, "tree-tools"))
    errors = _errors(page)
    sign_in(page, live, where=f"#/tree/{study_id}")
    page.wait_for_selector("#tree[data-ready='1']")
    assert page.get_attribute("#tree", "data-rows") == "3"
    page.fill("#tree-search", "g0.01")
    page.press("#tree-search", "Enter")
    page.wait_for_selector("#tree[data-matches='1']")
    page.wait_for_selector("#node-trials tr[data-trial='g0.01']")
    assert "done" in page.inner_text("#node-title")
    page.fill("#tree-search", "done")
    page.press("#tree-search", "Enter")
    page.wait_for_selector("#tree[data-matches='3']")  # every node trained: none is painted by a trial
    page.fill("#tree-search", "g0.01")
    page.press("#tree-search", "Enter")
    page.wait_for_selector("#node-trials tr[data-trial='g0.01']")
    page.click("#node-info button[data-focus]")  # a leaf alone
    page.wait_for_selector("#tree[data-rows='1']")
    page.click("#unfocus")
    page.wait_for_selector("#tree[data-rows='3']")
    assert not errors, errors


def test_an_idle_studys_page_hears_nothing_while_another_study_runs(live: LiveCluster, page: Any) -> None:
    idle_id, _, _ = live.run(run_study(live, "idle"))
    sign_in(page, live, where=f"#/study/{idle_id}")
    page.wait_for_selector("#curves[data-ready='1']")
    page.wait_for_function("document.querySelector('#live.on')")
    busy_id, _, _ = live.run(run_study(live, "busy"))
    page.wait_for_timeout(1500)  # the last events of the busy study have had time to arrive
    assert page.evaluate(f"((window.__stagetree || {{}}).rebuilds || {{}})['{idle_id}'] || 0") == 0
    # the same page, switched to the busy study, hears it
    page.evaluate(f"location.hash = '#/study/{busy_id}'")
    page.wait_for_selector("#curves[data-ready='1']")
    page.wait_for_function("document.querySelector('#live.on')")
    live.run(_one_more(live, busy_id))
    page.wait_for_function(f"((window.__stagetree || {{}}).rebuilds || {{}})['{busy_id}'] > 0", timeout=60_000)


async def _one_more(live: LiveCluster, study_id: str) -> None:
    c = live.cluster
    async with stagetree.connect(c.target, token=c.token) as client:
        study = await stagetree.Study.load(client, study_id)
        await asyncio.wait_for(study.eval({"lr": MultiStep(0.1, [BRANCH], 0.3), "bs": 32}, END), 120)


def test_the_studies_list_searches_sorts_and_deletes(live: LiveCluster, page: Any) -> None:
    keep, _, _ = live.run(run_study(live, "list-keep"))
    gone, _, _ = live.run(run_study(live, "list-gone"))
    errors = _errors(page)
    sign_in(page, live)
    page.wait_for_selector(f"#studies-table tr[data-study='{gone}']")
    page.fill("#study-search", "list-")
    page.wait_for_function("document.querySelectorAll('#studies-table tbody tr[data-study]').length === 2")
    page.click("#studies-table th[data-key=name]")
    names = page.eval_on_selector_all(
        "#studies-table tbody tr[data-study] td:first-child a", "els => els.map((e) => e.textContent)"
    )
    assert names == sorted(names)
    row = page.locator(f"#studies-table tr[data-study='{keep}']")
    assert "done" in row.inner_text() and ":" in row.locator("td").nth(2).inner_text()  # state, created time
    page.once("dialog", lambda d: d.accept())
    page.click(f"#studies-table button[data-delete='{gone}']")
    page.wait_for_selector(f"#studies-table tr[data-study='{gone}']", state="detached")
    assert page.locator(f"#studies-table tr[data-study='{keep}']").count() == 1
    assert not errors, errors


def test_the_cluster_page_says_which_study_and_trial_a_slot_works_for(live: LiveCluster, page: Any) -> None:
    # The faulty trainer without a fault: a second of sleep a step keeps every batch on its slot for
    # longer than the page's 5-s redraw (the digits trainer ignores ``sleep_s``).
    values = {**VALUES, "sleep_s": 1.0}
    errors = _errors(page)
    sign_in(page, live, where="#/cluster")
    running = asyncio.run_coroutine_threadsafe(run_study(live, "slow", trainer=FAULTY, values=values), live.bg.loop)
    try:
        slot = page.wait_for_selector("[data-slot] a:has-text('slow')", timeout=120_000)
    except Exception as e:  # what the page and the master saw, for a failure on a loaded machine
        seen = httpx.get(f"{live.url}/api/v1/dashboard/cluster", headers={"authorization": f"Bearer {live.token}"})
        raise AssertionError(
            f"{e}\nlive mode: {page.inner_text('#live-mode')}; study done: {running.done()}\n"
            f"page: {page.inner_text('#hosts')[:2000]}\nmaster: {seen.text[:4000]}"
        ) from None
    assert slot is not None
    page.wait_for_selector("[data-slot] button[data-log]")
    assert "slots busy" in page.inner_text("#busy-kpi")
    running.result(300)
    assert not errors, errors
