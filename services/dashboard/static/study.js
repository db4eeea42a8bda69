// The Study page: learning curves (one line per plan node, so a shared prefix is one line that splits),
// a trials table (readable schedules, sortable, filterable), parallel coordinates, the best trial.
import { alive, api, esc, fmt, throttle } from "./app.js";
import { counts, best } from "./pages.js";

const MAX_ROWS = 500; // table rows drawn at once (the filter narrows the rest)
const PER_SERIES_LIMIT = 300; // up to this many nodes: a series each (hover a line); beyond: one series with gaps
const STATE_COLOR = { DONE: "#2fa36b", FAILED: "#d64545", CANCELLED: "#c69026", SCHED: "#2f6fde", NOT_SCHED: "#9aa5b1" };

export async function renderStudy(main, studyId, gen) {
  const id = encodeURIComponent(studyId);
  // the trials and the curves at once (without a metric, the server picks the curves' loss-like one)
  let [data, firstCurves] = await Promise.all([api(`/dashboard/studies/${id}`), api(`/dashboard/studies/${id}/curves`)]);
  // metric: the curves' (a step metric such as train_loss, or an evaluation metric); evalMetric: the
  // evaluation metric the parallel coordinates color by (the best trial's)
  const state = { metric: null, evalMetric: null, log: false, smooth: 0, sort: "request_id", asc: true, filter: "", hover: null };
  const curves = { asOf: null, nodes: new Map() }; // node id -> {parent, start, total, points: [[step, v]]}
  const parentOf = new Map();

  main.innerHTML = `<h1 id="study-name"></h1>
    <div class="row"><div class="card" id="summary"></div><div class="card" id="best"></div></div>
    <div class="card"><div class="controls">
      <label>metric <select id="metric"></select></label>
      <label><input type="checkbox" id="log"> log scale</label>
      <label>smoothing <input type="range" id="smooth" min="0" max="0.98" step="0.02" value="0"></label>
      <span class="muted" id="curve-info"></span>
      <a href="#/tree/${id}">stage tree →</a></div>
      <div id="curves" class="chart"></div></div>
    <div class="card"><h2>Trials</h2><div class="controls"><input id="filter" placeholder="filter: label, state, schedule, error">
      <span class="muted" id="trial-info"></span></div><table id="trials"></table></div>
    <div class="card"><h2>Hyper-parameters against the metric</h2><div id="parallel" class="chart"></div></div>`;

  const chart = echarts.init(document.getElementById("curves"), null, { renderer: "canvas" });
  const par = echarts.init(document.getElementById("parallel"), null, { renderer: "canvas" });
  const onResize = () => { chart.resize(); par.resize(); };
  window.addEventListener("resize", onResize);

  function curveMetrics() {
    // step metrics come from the curves; evaluation metrics from the trials
    const names = new Set(data.metrics);
    for (const n of curves.names || []) names.add(n);
    return [...names].sort();
  }

  function drawHeader() {
    const s = data.stats;
    document.getElementById("study-name").textContent = data.study.name;
    document.getElementById("summary").innerHTML = `<div class="kpi" id="counts"><span>requests</span>${counts(data.counts)}</div>
      <div class="kpi"><b>${data.trials.length}</b><span>trials</span></div>
      <div class="kpi"><b>${fmt(s.merge_rate, 2)}</b><span>merge rate</span></div>
      <div class="kpi"><b>${s.steps_executed}</b><span>steps executed (of ${s.trial_by_trial_steps} trial by trial)</span></div>
      <div class="kpi"><b>${fmt(s.saved_seconds, 1)} s</b><span>compute saved</span></div>`;
    const b = data.best;
    const t = b && data.trials.find((x) => x.request_id === b.request_id);
    document.getElementById("best").innerHTML = `<h2>Best trial</h2>${best(b)}${t ? `<div class="muted sched">${esc(t.schedule)}</div>` : ""}`;
  }

  // -- curves ---------------------------------------------------------------------------------------
  async function loadCurves(incremental) {
    const q = state.metric ? `metric=${encodeURIComponent(state.metric)}` + (incremental && curves.asOf ? `&since=${curves.asOf}` : "") : "";
    const got = await api(`/dashboard/studies/${id}/curves?${q}`);
    if (!alive(gen)) return;
    applyCurves(got, incremental && !!state.metric);
  }

  function applyCurves(got, incremental) {
    if (!got.metric) return; // no curve point yet
    if (!state.metric) { state.metric = got.metric; fillMetrics(); }
    if (got.metrics && got.metrics.length) { curves.names = got.metrics; fillMetrics(); }
    if (!incremental) curves.nodes.clear();
    for (const n of got.nodes) {
      parentOf.set(n.node, n.parent);
      const have = curves.nodes.get(n.node);
      if (!have || !incremental) { curves.nodes.set(n.node, { parent: n.parent, start: n.start, total: n.total, points: n.points }); continue; }
      const seen = new Set(have.points.map((p) => p[0]));
      for (const p of n.points) if (!seen.has(p[0])) { have.points.push(p); have.total += 1; }
      have.points.sort((a, b) => a[0] - b[0]);
    }
    curves.asOf = got.as_of;
    drawCurves();
  }

  function smooth(points) {
    if (!state.smooth) return points;
    let acc = null;
    return points.map(([x, y]) => { acc = acc === null ? y : state.smooth * acc + (1 - state.smooth) * y; return [x, acc]; });
  }

  function nodeLine(nodeId) {
    // a node's own points, joined to the last point of its parent before its start (the branch)
    const n = curves.nodes.get(nodeId);
    const own = n.points;
    const par = n.parent !== null ? curves.nodes.get(n.parent) : null;
    let joint = null;
    if (par) for (const p of par.points) if (p[0] <= n.start) joint = p;
    return joint ? [joint, ...own] : own;
  }

  function pathOf(nodeId) {
    const out = [];
    for (let n = nodeId; n !== null && n !== undefined; n = parentOf.get(n)) out.push(n);
    return out.reverse();
  }

  function drawCurves() {
    const ids = [...curves.nodes.keys()].sort((a, b) => a - b);
    let drawn = 0, total = 0;
    for (const n of ids) { drawn += curves.nodes.get(n).points.length; total += curves.nodes.get(n).total; }
    const el = document.getElementById("curves");
    el.dataset.drawnPoints = String(drawn);
    el.dataset.totalPoints = String(total);
    el.dataset.nodes = String(ids.length);
    document.getElementById("curve-info").textContent =
      `${ids.length} plan nodes, ${drawn} points drawn${total > drawn ? ` of ${total} (thinned on the server)` : ""}`;
    let series;
    if (ids.length <= PER_SERIES_LIMIT) {
      series = ids.map((n) => ({
        id: `n${n}`, name: `node ${n}`, type: "line", showSymbol: false, data: smooth(nodeLine(n)),
        lineStyle: { width: 1.4 }, emphasis: { focus: "series", lineStyle: { width: 3 } }, animation: false,
      }));
    } else {
      const data = [];
      for (const n of ids) { for (const p of smooth(nodeLine(n))) data.push(p); data.push([null, null]); }
      series = [{ id: "all", name: "all nodes", type: "line", showSymbol: false, data, connectNulls: false,
        lineStyle: { width: 0.8, opacity: 0.5 }, animation: false, large: true, progressive: 20000 }];
    }
    if (state.hover !== null) {
      // the trial's curve: each ancestor's points up to where the next node on the path branches
      const nodes = pathOf(state.hover).filter((n) => curves.nodes.has(n));
      const path = [];
      nodes.forEach((n, i) => {
        const until = i + 1 < nodes.length ? curves.nodes.get(nodes[i + 1]).start : Infinity;
        for (const p of curves.nodes.get(n).points) if (p[0] <= until) path.push(p);
      });
      series.push({ id: "hover", name: "highlighted trial", type: "line", showSymbol: false, data: smooth(path), z: 10,
        lineStyle: { width: 3, color: "#d64545" }, animation: false, silent: true });
    }
    chart.setOption({
      animation: false,
      grid: { left: 60, right: 20, top: 20, bottom: 40 },
      tooltip: { trigger: "item", formatter: (p) => `${esc(p.seriesName)}<br>step ${p.value[0]}: ${fmt(p.value[1])}` },
      xAxis: { type: "value", name: "step", nameLocation: "middle", nameGap: 26, min: "dataMin" },
      yAxis: { type: state.log ? "log" : "value", name: state.metric, scale: true },
      dataZoom: [{ type: "inside" }],
      series,
    }, { replaceMerge: ["series"] });
    el.dataset.ready = "1";
  }

  chart.on("mouseover", (e) => {
    if (e.seriesId && e.seriesId.startsWith("n")) { state.hover = Number(e.seriesId.slice(1)); drawCurves(); }
  });
  chart.on("globalout", () => { if (state.hover !== null) { state.hover = null; drawCurves(); } });

  // -- trials table -------------------------------------------------------------------------------
  function drawTrials() {
    const f = state.filter.toLowerCase();
    let rows = data.trials.filter((t) => !f || `${t.label} ${t.state} ${t.schedule} ${t.error} ${t.request_id}`.toLowerCase().includes(f));
    const key = state.sort;
    const missing = state.asc ? Infinity : -Infinity;
    const val = (t) => (key.startsWith("m:") ? t.metrics[key.slice(2)] ?? missing : t[key]);
    rows.sort((a, b) => { const x = val(a), y = val(b); return (x < y ? -1 : x > y ? 1 : 0) * (state.asc ? 1 : -1); });
    document.getElementById("trial-info").textContent = `${rows.length} of ${data.trials.length} trials${rows.length > MAX_ROWS ? `, first ${MAX_ROWS} shown` : ""}`;
    const cols = [["request_id", "request"], ["label", "trial"], ["state", "state"], ["step", "step"], ["schedule", "schedule"],
      ...data.metrics.map((m) => [`m:${m}`, esc(m)]), ["error", "error"]];
    const head = cols.map(([k, t]) => `<th data-key="${esc(k)}" class="${state.sort === k ? "sorted" + (state.asc ? " asc" : "") : ""}">${t}</th>`).join("");
    const body = rows.slice(0, MAX_ROWS).map((t) => `<tr data-request="${t.request_id}" data-node="${t.node}" data-state="${t.state}">
      <td>${t.request_id}</td><td>${esc(t.label)}</td><td><span class="badge s-${t.state}">${esc(t.state)}</span></td><td>${t.step}</td>
      <td class="sched">${esc(t.schedule)}</td>${data.metrics.map((m) => `<td>${fmt(t.metrics[m])}</td>`).join("")}
      <td class="error">${esc(t.error.split("\n")[0])}</td></tr>`).join("");
    const table = document.getElementById("trials");
    table.innerHTML = `<thead><tr>${head}</tr></thead><tbody>${body}</tbody>`;
  }
  const table = document.getElementById("trials");
  table.addEventListener("click", (e) => {
    const th = e.target.closest("th");
    if (!th) return;
    if (state.sort === th.dataset.key) state.asc = !state.asc; else { state.sort = th.dataset.key; state.asc = true; }
    drawTrials();
  });
  table.addEventListener("mouseover", (e) => {
    const tr = e.target.closest("tr[data-node]");
    if (!tr) return;
    for (const r of table.querySelectorAll("tr.hover")) r.classList.remove("hover");
    tr.classList.add("hover");
    state.hover = Number(tr.dataset.node);
    drawCurves();
  });
  table.addEventListener("mouseleave", () => { state.hover = null; drawCurves(); });
  document.getElementById("filter").addEventListener("input", (e) => { state.filter = e.target.value; drawTrials(); });

  // -- parallel coordinates -----------------------------------------------------------------------
  function drawParallel() {
    const hps = data.hp_names, m = (data.best && data.best.metric) || data.metrics[0];
    if (!m) return;
    const done = data.trials.filter((t) => t.state === "DONE" && m in t.metrics);
    const dims = [...hps, m].map((name, i) => ({ dim: i, name }));
    par.setOption({
      animation: false,
      parallelAxis: dims,
      parallel: { left: 60, right: 80, top: 30, bottom: 30 },
      visualMap: done.length ? { show: true, dimension: hps.length, min: Math.min(...done.map((t) => t.metrics[m])),
        max: Math.max(...done.map((t) => t.metrics[m])), right: 0, top: 40, calculable: true,
        inRange: { color: ["#d64545", "#f5c26b", "#2fa36b"] } } : undefined,
      series: [{ type: "parallel", lineStyle: { width: 1, opacity: 0.5 }, progressive: 1000,
        data: done.map((t) => [...hps.map((h) => t.hp[h]), t.metrics[m]]) }],
    }, { notMerge: true });
    document.getElementById("parallel").dataset.lines = String(done.length);
  }

  // -- controls and live updates ------------------------------------------------------------------
  function fillMetrics() {
    // the curves' step metrics (as the server listed them) and the evaluation metrics
    const list = curveMetrics();
    if (!state.metric || !list.includes(state.metric)) {
      state.metric = state.metric || list.find((n) => /loss/i.test(n) && !data.metrics.includes(n)) || list[0] || null;
    }
    const sel = document.getElementById("metric");
    sel.innerHTML = list.map((n) => `<option ${n === state.metric ? "selected" : ""}>${esc(n)}</option>`).join("");
  }
  document.getElementById("metric").addEventListener("change", async (e) => { state.metric = e.target.value; await loadCurves(false); });
  document.getElementById("log").addEventListener("change", (e) => { state.log = e.target.checked; drawCurves(); });
  document.getElementById("smooth").addEventListener("input", (e) => { state.smooth = Number(e.target.value); drawCurves(); });

  drawHeader();
  drawTrials();
  drawParallel();
  applyCurves(firstCurves, false);
  fillMetrics();
  if (!firstCurves.metric) drawCurves(); // nothing to draw yet: an empty chart, ready

  const refresh = throttle(async () => {
    const got = await api(`/dashboard/studies/${id}`);
    if (!alive(gen)) return;
    data = got;
    drawHeader(); drawTrials(); drawParallel();
    if (!state.metric) await loadCurves(false);
  }, 500);
  const moreCurves = throttle(() => loadCurves(true), 100);
  return {
    onCounts: refresh,
    onCurves: moreCurves,
    stop: () => { window.removeEventListener("resize", onResize); chart.dispose(); par.dispose(); },
  };
}

export { STATE_COLOR };
