// The Study page: the learning curves of a step metric (one line per plan node, so a shared prefix is
// one line that splits) beside an evaluation metric at each trial's rungs, each with a legend, scales
// that outliers cannot flatten, a step or wall-time axis and exports; the trials table (a row per trial,
// its rungs inside; its filter filters the charts too); and the tuned choices: parallel coordinates
// (failed trials included), importance, slices, a contour of the two most important numeric choices and
// the optimisation history.
import {
  PALETTE, WORDS, WORD_COLOR, alive, api, badge, countBadges, csv, download, esc, fmt, metricLabel, robustRange,
  throttle, trialHref, trialLink, word,
  tick,
} from "./common.js";
import { bestText } from "./studies.js";

const PAGE = 50; // table rows per page
// up to this many lines: a series each, with a legend; beyond, one series with gaps (a tooltip names each
// line, a hover draws its trial, the table's filter narrows them back to a legend)
const PER_SERIES_LIMIT = 60;
const SLICES = 4; // slice plots of the most important choices
const CONTOUR_GRID = 28; // cells a side of the contour's interpolated surface
// a scatter of more points than this is drawn in bulk, as one path (no element per point): at 2,000
// trials, a symbol element per point made the slices, contour and history take most of the page's
// drawing time (tests/bench/dashboard's study_page_ms)
const BULK = { large: true, largeThreshold: 500 };
// parallel coordinates of more lines than this draw them a frame at a time, after the rest of the page
// (at 2,000 trials, all at once held the page's first paint by a quarter of a second)
const PROGRESSIVE = { progressive: 400, progressiveThreshold: 800 };

export async function renderStudy(main, studyId, gen) {
  const id = encodeURIComponent(studyId);
  // the trials and a first curve asked for at once (without a metric, the server picks a loss-like step
  // metric); the evaluation curves are the trials' rungs, so they come with the trials (no request of
  // their own). The curves take longest: the rest of the page is drawn while they come.
  const firstP = api(`/dashboard/studies/${id}/curves`);
  firstP.catch(() => {}); // awaited below, once the trials are drawn (a failure shows there)
  let data = await api(`/dashboard/studies/${id}`);
  const state = {
    metric: null, evalMetric: null, pcMetric: null, x: "step", log: false, robust: true, smooth: 0,
    sort: "started_at", asc: true, filter: "", stateFilter: "", page: 0, hover: null,
  };
  const curves = { asOf: null, names: [], evalNames: [], nodes: new Map(), timed: false }; // node -> {parent, start, total, points, times}
  const evals = { trials: [] }; // [{key, node, state, points: [[step, v, t]]}]
  const parentOf = new Map();
  const rebuilds = () => { window.__stagetree = window.__stagetree || { rebuilds: {} }; window.__stagetree.rebuilds[studyId] = (window.__stagetree.rebuilds[studyId] || 0) + 1; };

  main.innerHTML = `<h1><span id="study-name"></span> <span id="study-state"></span>
      <a class="h-link" href="#/tree/${id}">stage tree →</a></h1>
    <div class="row"><div class="card" id="summary"></div><div class="card" id="best"></div></div>
    <div class="card"><div class="controls">
      <label>x axis <select id="x-axis"><option value="step">step</option><option value="time">wall time</option></select></label>
      <label title="the y axis spans the 2nd to 98th percentile: a diverged run cannot flatten the rest"><input type="checkbox" id="robust" checked> clip outliers</label>
      <label><input type="checkbox" id="log"> log scale</label>
      <label>smoothing <input type="range" id="smooth" min="0" max="0.98" step="0.02" value="0"></label>
      <span class="spacer"></span>
      <button type="button" id="export-curves">curves CSV</button></div>
      <div class="row charts">
        <div class="chart-box"><div class="controls"><label>step metric <select id="metric"></select></label>
          <span class="muted" id="curve-info"></span></div><div id="curves" class="chart"></div></div>
        <div class="chart-box"><div class="controls"><label>evaluation metric <select id="eval-metric"></select></label>
          <span class="muted" id="eval-info"></span></div><div id="eval-curves" class="chart"></div></div>
      </div></div>
    <div class="card"><h2>Trials</h2><div class="controls">
      <input id="filter" placeholder="filter: trial, schedule, error, choice">
      <select id="state-filter"><option value="">every state</option>${WORDS.map((w) => `<option>${w}</option>`).join("")}</select>
      <span class="muted" id="trial-info"></span><span class="spacer"></span>
      <button type="button" id="prev-page">‹</button><span id="page-info" class="muted"></span><button type="button" id="next-page">›</button>
      <button type="button" id="export-csv">CSV</button><button type="button" id="export-json">JSON</button></div>
      <div class="table-scroll"><table id="trials" class="clickable-rows"></table></div></div>
    <div class="card"><h2>Tuned choices</h2><div class="controls"><label>against <select id="pc-metric"></select></label>
      <span class="muted" id="pc-info"></span></div>
      <div id="parallel" class="chart"></div>
      <div class="row charts"><div class="chart-box"><h3>Importance</h3><div id="importance" class="chart small"></div></div>
        <div class="chart-box"><h3>Optimisation history</h3><div id="history" class="chart small"></div></div></div>
      <div class="row charts"><div class="chart-box"><h3>Slices</h3><div id="slices" class="chart small"></div></div>
        <div class="chart-box"><h3>Contour <span class="muted" id="contour-info"></span></h3><div id="contour" class="chart small"></div></div></div></div>`;

  const charts = Object.fromEntries(["curves", "eval-curves", "parallel", "importance", "history", "slices", "contour"].map(
    (k) => [k, echarts.init(document.getElementById(k), null, { renderer: "canvas" })]));
  const onResize = () => Object.values(charts).forEach((c) => c.resize());
  window.addEventListener("resize", onResize);

  // -- which trials are shown (the table's filter filters the charts too) -------------------------
  function visibleTrials() {
    const f = state.filter.toLowerCase();
    return data.trials.filter((t) => (!state.stateFilter || word(t.state) === state.stateFilter)
      && (!f || `${t.key} ${word(t.state)} ${t.schedule} ${t.error} ${Object.entries(t.features).map(([k, v]) => `${k}=${v}`).join(" ")}`.toLowerCase().includes(f)));
  }
  const filtered = () => state.filter || state.stateFilter;

  // node -> the trials whose path passes through it (their last node's ancestors)
  function nodeTrials(trials) {
    const out = new Map();
    for (const t of trials) for (let n = t.node; n !== null && n !== undefined; n = parentOf.get(n)) {
      if (!out.has(n)) out.set(n, []);
      out.get(n).push(t.key);
    }
    return out;
  }

  function drawHeader() {
    const s = data.stats;
    document.getElementById("study-name").textContent = data.study.name;
    document.getElementById("study-state").innerHTML = badge(data.state);
    document.getElementById("summary").innerHTML = `<div class="kpi" id="trial-counts"><span>${data.trials.length} trials</span>${countBadges(data.trial_counts, "trials")}</div>
      <div class="kpi" id="counts"><span>requests (rungs)</span>${countBadges(data.counts, "requests")}</div>
      <div class="kpi"><b>${fmt(s.merge_rate, 2)}</b><span>merge rate</span></div>
      <div class="kpi"><b>${s.steps_executed}</b><span>steps executed (of ${s.trial_by_trial_steps} trial by trial)</span></div>
      <div class="kpi"><b>${fmt(s.saved_seconds, 1)} s</b><span>compute saved</span></div>`;
    const b = data.best;
    const t = b && data.trials.find((x) => x.key === b.trial);
    document.getElementById("best").innerHTML = `<h2>Best trial</h2>${bestText(studyId, b)}${t ? `<div class="muted sched">${esc(t.schedule)}</div>` : ""}`;
  }

  // -- step curves ----------------------------------------------------------------------------------
  async function loadCurves(incremental) {
    if (!state.metric) return;
    const timed = state.x === "time";
    let q = `kind=step&metric=${encodeURIComponent(state.metric)}${timed ? "&times=true" : ""}`;
    if (incremental && curves.asOf) q += `&since=${curves.asOf}`;
    const got = await api(`/dashboard/studies/${id}/curves?${q}`);
    if (!alive(gen)) return false;
    return applyCurves(got, incremental);
  }

  function applyCurves(got, incremental) {
    if (got.eval_metrics) curves.evalNames = got.eval_metrics;
    if (got.metrics && got.metrics.length) curves.names = got.metrics;
    if (got.kind !== "step") { fillMetrics(); return false; }
    if (!state.metric) state.metric = got.metric;
    if (!incremental) curves.nodes.clear();
    let added = 0;
    for (const n of got.nodes) {
      parentOf.set(n.node, n.parent);
      const times = n.times || null;
      const have = curves.nodes.get(n.node);
      if (!have || !incremental) { curves.nodes.set(n.node, { parent: n.parent, start: n.start, total: n.total, points: n.points, times }); added += n.points.length; continue; }
      const seen = new Set(have.points.map((p) => p[0]));
      n.points.forEach((p, i) => {
        if (seen.has(p[0])) return;
        have.points.push(p); have.total += 1; added += 1;
        if (have.times && times) have.times.push(times[i]);
      });
      if (have.times) { const order = have.points.map((p, i) => [p, have.times[i]]).sort((a, b) => a[0][0] - b[0][0]); have.points = order.map((x) => x[0]); have.times = order.map((x) => x[1]); }
      else have.points.sort((a, b) => a[0] - b[0]);
    }
    curves.asOf = got.as_of;
    curves.timed = state.x === "time";
    fillMetrics();
    if (incremental && !added) return false;
    drawCurves();
    return true;
  }

  function smooth(points) {
    if (!state.smooth) return points;
    let acc = null;
    return points.map(([x, y]) => { acc = acc === null ? y : state.smooth * acc + (1 - state.smooth) * y; return [x, acc]; });
  }

  function xy(node) {
    // a node's own points as [x, y], joined to its parent's last point before its start (the branch)
    const n = curves.nodes.get(node);
    const own = n.points.map((p, i) => [curves.timed && n.times ? n.times[i] * 1000 : p[0], p[1]]);
    const par = n.parent !== null ? curves.nodes.get(n.parent) : null;
    if (par && !curves.timed) {
      let joint = null;
      for (const p of par.points) if (p[0] <= n.start) joint = p;
      if (joint) return [joint, ...own];
    }
    return own;
  }

  function nodeName(n, through) {
    const keys = through.get(n) || [];
    if (keys.length === 1) return keys[0];
    return keys.length ? `shared ${keys[0]} +${keys.length - 1}` : `node ${n}`;
  }

  function yAxis(name, values) {
    const axis = { type: state.log ? "log" : "value", name, nameTextStyle: { align: "left" }, scale: true, axisLabel: { formatter: tick } };
    const r = state.robust ? robustRange(values, state.log) : null;
    if (r) { axis.min = r.min; axis.max = r.max; axis.axisLabel.showMinLabel = false; axis.axisLabel.showMaxLabel = false; }
    return [axis, r && r.clipped];
  }

  function xAxis() {
    return state.x === "time"
      ? { type: "time", name: "wall time", nameLocation: "middle", nameGap: 26 }
      : { type: "value", name: "step", nameLocation: "middle", nameGap: 26, min: "dataMin" };
  }

  function drawCurves() {
    const el = document.getElementById("curves");
    const shown = visibleTrials();
    const through = nodeTrials(filtered() ? shown : data.trials);
    const ids = [...curves.nodes.keys()].filter((n) => !filtered() || through.has(n)).sort((a, b) => a - b);
    let drawn = 0, total = 0;
    for (const n of curves.nodes.keys()) { drawn += curves.nodes.get(n).points.length; total += curves.nodes.get(n).total; }
    el.dataset.drawnPoints = String(drawn);
    el.dataset.totalPoints = String(total);
    el.dataset.nodes = String(ids.length);
    document.getElementById("curve-info").textContent = state.metric
      ? `${ids.length} lines, ${drawn} points${total > drawn ? ` of ${total} (thinned on the server)` : ""}` : "no step metric: train() returned none";
    const values = [];
    let series;
    curveIndex = null;
    if (ids.length <= PER_SERIES_LIMIT) {
      series = ids.map((n) => {
        const d = smooth(xy(n));
        for (const p of d) values.push(p[1]);
        return { id: `n${n}`, name: nodeName(n, through), type: "line", showSymbol: false, data: d, lineStyle: { width: 1.4 },
          emphasis: { focus: "series", lineStyle: { width: 3 } }, animation: false, clip: true };
      });
    } else {
      const d = [];
      curveIndex = [];
      for (const n of ids) {
        for (const p of smooth(xy(n))) { d.push(p); values.push(p[1]); curveIndex.push(n); }
        d.push([null, null]); curveIndex.push(null);
      }
      series = [{ id: "all", name: `${ids.length} lines`, type: "line", showSymbol: false, data: d, connectNulls: false,
        lineStyle: { width: 0.8, opacity: 0.5 }, animation: false, large: true, progressive: 20000, clip: true }];
    }
    if (state.hover !== null) {
      const t = data.trials.find((x) => x.key === state.hover);
      if (t) series.push({ id: "hover", name: `${t.key} (highlighted)`, type: "line", showSymbol: false, data: smooth(pathPoints(t.node)), z: 10,
        lineStyle: { width: 3, color: "#d64545" }, animation: false, silent: true, clip: true });
    }
    const [y, clipped] = yAxis(state.metric ? metricLabel(state.metric, "step") : "", values);
    const many = ids.length > PER_SERIES_LIMIT;
    charts.curves.setOption({
      animation: false,
      color: PALETTE,
      legend: { show: true, type: "scroll", top: 0, left: 0, right: 10, textStyle: { fontSize: 11 } },
      grid: { left: 60, right: 20, top: 44, bottom: 40 },
      tooltip: { trigger: "item", formatter: (p) => {
        const name = p.seriesId === "all" && curveIndex ? nodeName(curveIndex[p.dataIndex], through) : p.seriesName;
        return `${esc(name)}<br>${state.x === "time" ? new Date(p.value[0]).toLocaleTimeString() : `step ${p.value[0]}`}: ${fmt(p.value[1])}`;
      } },
      xAxis: xAxis(), yAxis: y,
      graphic: [
        ...(clipped ? [{ type: "text", right: 24, top: 46, style: { text: "outliers off-scale", fill: "#7b8794", fontSize: 11 } }] : []),
        ...(many ? [{ type: "text", left: 70, top: 46, style: { text: "hover a line, or filter the table, to name the trials", fill: "#7b8794", fontSize: 11 } }] : []),
      ],
      dataZoom: [{ type: "inside" }],
      series,
    }, { replaceMerge: ["series", "graphic"] });
    el.dataset.ready = "1";
  }
  let curveIndex = null; // in one-series mode: the node of each point

  function pathPoints(leaf) {
    // the trial's curve: each ancestor's points up to where the next node on its path branches
    const nodes = [];
    for (let n = leaf; n !== null && n !== undefined; n = parentOf.get(n)) nodes.push(n);
    nodes.reverse();
    const on = nodes.filter((n) => curves.nodes.has(n));
    const out = [];
    on.forEach((n, i) => {
      const c = curves.nodes.get(n);
      const until = i + 1 < on.length ? curves.nodes.get(on[i + 1]).start : Infinity;
      c.points.forEach((p, k) => { if (p[0] <= until) out.push([curves.timed && c.times ? c.times[k] * 1000 : p[0], p[1]]); });
    });
    return out;
  }

  charts.curves.on("mouseover", (e) => {
    const node = e.seriesId === "all" && curveIndex ? curveIndex[e.dataIndex] : e.seriesId && e.seriesId.startsWith("n") ? Number(e.seriesId.slice(1)) : null;
    if (node !== null && node !== undefined) {
      const t = data.trials.find((x) => x.node === node);
      if (t && state.hover !== t.key) { state.hover = t.key; drawCurves(); drawEval(); }
    }
  });
  charts.curves.on("globalout", () => { if (state.hover !== null) { state.hover = null; drawCurves(); drawEval(); } });

  // -- evaluation metrics at their steps -----------------------------------------------------------
  // each trial's finished rungs with the metric as [step, value, when answered]: what the API's
  // curves?kind=eval answers, read from the trials the page holds
  function loadEval() {
    const m = state.evalMetric;
    evals.trials = [];
    if (m) for (const t of data.trials) {
      const points = [];
      for (const r of t.rungs) if (r.state === "DONE" && typeof r.metrics[m] === "number") points.push([r.step, r.metrics[m], r.done_at]);
      if (points.length) evals.trials.push({ key: t.key, node: t.node, state: t.state, points });
    }
    drawEval();
  }

  function drawEval() {
    const el = document.getElementById("eval-curves");
    const keep = new Set(visibleTrials().map((t) => t.key));
    const trials = evals.trials.filter((t) => keep.has(t.key));
    const x = (p) => (state.x === "time" ? (p[2] || 0) * 1000 : p[0]);
    const values = [];
    let series;
    let points = 0;
    evalIndex = null;
    if (trials.length <= PER_SERIES_LIMIT) {
      series = trials.map((t) => {
        const d = t.points.map((p) => [x(p), p[1]]);
        for (const p of d) values.push(p[1]);
        points += d.length;
        return { id: `t:${t.key}`, name: t.key, type: "line", data: d, showSymbol: true, symbolSize: 6, lineStyle: { width: 1.2 },
          emphasis: { focus: "series", lineStyle: { width: 3 } }, animation: false, clip: true };
      });
    } else {
      // one line series (a gap between trials) and the rungs as one scatter drawn in bulk: a symbol
      // element per rung made this chart the slowest of the page at 2,000 trials (tests/bench/dashboard)
      const d = [], dots = [];
      evalIndex = [];
      for (const t of trials) {
        for (const p of t.points) { const xy = [x(p), p[1]]; d.push(xy); dots.push(xy); values.push(p[1]); evalIndex.push(t.key); points += 1; }
        d.push([null, null]);
      }
      series = [{ id: "all", name: `${trials.length} trials`, type: "line", data: d, connectNulls: false, showSymbol: false,
        lineStyle: { width: 0.8, opacity: 0.45 }, animation: false, clip: true, silent: true },
      { id: "dots", name: `${trials.length} trials`, type: "scatter", data: dots, symbolSize: 4, large: true, largeThreshold: 500,
        itemStyle: { color: PALETTE[0], opacity: 0.7 }, animation: false, clip: true }];
    }
    const hover = state.hover !== null && evals.trials.find((t) => t.key === state.hover);
    if (hover) series.push({ id: "hover", name: `${hover.key} (highlighted)`, type: "line", data: hover.points.map((p) => [x(p), p[1]]), z: 10,
      symbolSize: 8, lineStyle: { width: 3, color: "#d64545" }, itemStyle: { color: "#d64545" }, animation: false, silent: true });
    const [y, clipped] = yAxis(state.evalMetric ? metricLabel(state.evalMetric, "eval") : "", values);
    const many = trials.length > PER_SERIES_LIMIT;
    charts["eval-curves"].setOption({
      animation: false,
      color: PALETTE,
      legend: { show: true, type: "scroll", top: 0, left: 0, right: 10, textStyle: { fontSize: 11 } },
      grid: { left: 60, right: 20, top: 44, bottom: 40 },
      tooltip: { trigger: "item", formatter: (p) => {
        const name = p.seriesId === "dots" && evalIndex ? evalIndex[p.dataIndex] : p.seriesName;
        return `${esc(name)}<br>${state.x === "time" ? new Date(p.value[0]).toLocaleTimeString() : `step ${p.value[0]}`}: ${fmt(p.value[1])}`;
      } },
      xAxis: xAxis(), yAxis: y,
      graphic: [
        ...(clipped ? [{ type: "text", right: 24, top: 46, style: { text: "outliers off-scale", fill: "#7b8794", fontSize: 11 } }] : []),
        ...(many ? [{ type: "text", left: 70, top: 46, style: { text: "hover a line, or filter the table, to name the trials", fill: "#7b8794", fontSize: 11 } }] : []),
      ],
      dataZoom: [{ type: "inside" }],
      series,
    }, { replaceMerge: ["series", "graphic"] });
    document.getElementById("eval-info").textContent = state.evalMetric ? `${trials.length} trials, ${points} rungs` : "no evaluation yet";
    el.dataset.points = String(points);
    el.dataset.ready = "1";
  }
  let evalIndex = null; // in one-series mode: the trial of each rung drawn
  charts["eval-curves"].on("mouseover", (e) => {
    const key = e.seriesId === "dots" && evalIndex ? evalIndex[e.dataIndex] : e.seriesId && e.seriesId.startsWith("t:") ? e.seriesId.slice(2) : null;
    if (key && state.hover !== key) { state.hover = key; drawCurves(); drawEval(); }
  });
  charts["eval-curves"].on("globalout", () => { if (state.hover !== null) { state.hover = null; drawCurves(); drawEval(); } });
  charts["eval-curves"].on("click", (e) => {
    const key = e.seriesId === "dots" && evalIndex ? evalIndex[e.dataIndex] : e.seriesId && e.seriesId.startsWith("t:") ? e.seriesId.slice(2) : null;
    const t = key && data.trials.find((x) => x.key === key);
    if (t) location.hash = trialHref(studyId, t);
  });

  // -- trials table ---------------------------------------------------------------------------------
  function sortedTrials() {
    const rows = visibleTrials();
    const key = state.sort;
    const val = (t) => (key.startsWith("m:") ? (typeof t.metrics[key.slice(2)] === "number" ? t.metrics[key.slice(2)] : null) : key === "state" ? word(t.state) : t[key]);
    return rows.sort((a, b) => {
      const x = val(a), y = val(b);
      if (x === y) return 0;
      if (x === null || x === undefined) return 1;
      if (y === null || y === undefined) return -1;
      return (x < y ? -1 : 1) * (state.asc ? 1 : -1);
    });
  }

  function rungChips(t) {
    const m = state.evalMetric;
    return t.rungs.map((r) => {
      const v = m && typeof r.metrics[m] === "number" ? ` ${fmt(r.metrics[m], 3)}` : "";
      return `<span class="chip s-${word(r.state)}" title="request ${r.request_id}: ${word(r.state)}">@${r.step}${v}</span>`;
    }).join("");
  }

  function drawTrials() {
    const rows = sortedTrials();
    const pages = Math.max(1, Math.ceil(rows.length / PAGE));
    state.page = Math.min(state.page, pages - 1);
    document.getElementById("trial-info").textContent = `${rows.length} of ${data.trials.length} trials`;
    document.getElementById("page-info").textContent = `page ${state.page + 1} of ${pages}`;
    const cols = [["key", "trial"], ["state", "state"], ["rungs", `rungs${state.evalMetric ? ` (${esc(state.evalMetric)})` : ""}`], ["step", "step"],
      ...data.metrics.map((m) => [`m:${m}`, esc(metricLabel(m, "eval"))]), ["schedule", "schedule"], ["error", "error"]];
    const head = cols.map(([k, t]) => `<th data-key="${esc(k)}" class="${state.sort === k ? "sorted" + (state.asc ? " asc" : "") : ""}">${t}</th>`).join("");
    const body = rows.slice(state.page * PAGE, (state.page + 1) * PAGE).map((t) => `<tr data-trial="${esc(t.key)}" data-node="${t.node}" data-state="${t.state}" data-href="${trialHref(studyId, t)}">
      <td><a href="${trialHref(studyId, t)}">${esc(t.key)}</a></td><td>${badge(t.state)}</td><td class="rungs">${rungChips(t)}</td><td>${t.step}</td>
      ${data.metrics.map((m) => `<td>${fmt(t.metrics[m])}${t.metric_step !== null && t.metric_step !== t.step && m in t.metrics ? `<span class="muted"> @${t.metric_step}</span>` : ""}</td>`).join("")}
      <td class="sched">${esc(t.schedule)}</td><td class="error">${esc(t.error)}</td></tr>`).join("");
    document.getElementById("trials").innerHTML = `<thead><tr>${head}</tr></thead><tbody>${body || `<tr><td colspan="${cols.length}" class="muted">no trial matches</td></tr>`}</tbody>`;
  }
  const table = document.getElementById("trials");
  table.addEventListener("click", (e) => {
    const th = e.target.closest("th[data-key]");
    if (th) {
      if (th.dataset.key === "rungs") return;
      if (state.sort === th.dataset.key) state.asc = !state.asc; else { state.sort = th.dataset.key; state.asc = true; }
      drawTrials();
      return;
    }
    const tr = e.target.closest("tr[data-href]");
    if (tr && !e.target.closest("a")) location.hash = tr.dataset.href;
  });
  table.addEventListener("mouseover", (e) => {
    const tr = e.target.closest("tr[data-trial]");
    if (!tr || state.hover === tr.dataset.trial) return;
    for (const r of table.querySelectorAll("tr.hover")) r.classList.remove("hover");
    tr.classList.add("hover");
    state.hover = tr.dataset.trial;
    drawCurves(); drawEval();
  });
  table.addEventListener("mouseleave", () => { state.hover = null; drawCurves(); drawEval(); });
  const refilter = () => { state.page = 0; drawTrials(); drawCurves(); drawEval(); drawChoices(); };
  document.getElementById("filter").addEventListener("input", (e) => { state.filter = e.target.value; refilter(); });
  document.getElementById("state-filter").addEventListener("change", (e) => { state.stateFilter = e.target.value; refilter(); });
  document.getElementById("prev-page").addEventListener("click", () => { state.page = Math.max(0, state.page - 1); drawTrials(); });
  document.getElementById("next-page").addEventListener("click", () => { state.page += 1; drawTrials(); });

  // -- exports --------------------------------------------------------------------------------------
  document.getElementById("export-json").addEventListener("click", () =>
    download(`${data.study.name}-trials.json`, "application/json", JSON.stringify(sortedTrials(), null, 1)));
  document.getElementById("export-csv").addEventListener("click", () => {
    const rows = sortedTrials();
    const header = ["trial", "state", "step", "rungs", ...data.metrics.map((m) => `${m} (eval)`), "metric_step", ...data.features, "schedule", "error"];
    download(`${data.study.name}-trials.csv`, "text/csv", csv(header, rows.map((t) => [t.key, word(t.state), t.step,
      t.rungs.map((r) => `${r.step}:${word(r.state)}`).join(" "), ...data.metrics.map((m) => t.metrics[m]), t.metric_step,
      ...data.features.map((f) => t.features[f]), t.schedule, t.error])));
  });
  document.getElementById("export-curves").addEventListener("click", () => {
    const rows = [];
    for (const [n, c] of curves.nodes) c.points.forEach((p, i) => rows.push(["step", state.metric, `node ${n}`, p[0], p[1], c.times ? c.times[i] : ""]));
    for (const t of evals.trials) for (const p of t.points) rows.push(["eval", state.evalMetric, t.key, p[0], p[1], p[2] ?? ""]);
    download(`${data.study.name}-curves.csv`, "text/csv", csv(["kind", "metric", "line", "step", "value", "recorded_at"], rows));
  });

  // -- tuned choices --------------------------------------------------------------------------------
  function metricOf(t, m) { const v = t.metrics[m]; return typeof v === "number" ? v : null; }

  function drawChoices() {
    const m = state.pcMetric;
    const feats = data.features;
    const trials = visibleTrials();
    const el = document.getElementById("parallel");
    if (!m) {
      for (const k of ["parallel", "importance", "history", "slices", "contour"]) charts[k].clear();
      el.dataset.lines = "0";
      document.getElementById("pc-info").textContent = "no evaluation yet";
      return;
    }
    const mode = data.modes[m] || "max";
    const numeric = Object.fromEntries(feats.map((f) => [f, trials.every((t) => !(f in t.features) || typeof t.features[f] === "number")]));
    const cats = Object.fromEntries(feats.filter((f) => !numeric[f]).map((f) => [f, [...new Set(trials.map((t) => (f in t.features ? String(t.features[f]) : "–")))].sort()]));
    const scored = trials.filter((t) => metricOf(t, m) !== null);
    const vals = scored.map((t) => metricOf(t, m));
    const lo = vals.length ? Math.min(...vals) : 0, hi = vals.length ? Math.max(...vals) : 1;
    const floor = lo - (hi - lo || 1) * 0.08; // where a trial without the metric (failed, running) is drawn
    const row = (t) => [...feats.map((f) => (numeric[f] ? (f in t.features ? t.features[f] : null) : (f in t.features ? String(t.features[f]) : "–"))),
      metricOf(t, m) ?? floor, word(t.state)];
    const extent = (f) => {
      const xs = trials.filter((t) => f in t.features).map((t) => t.features[f]);
      const [a, b] = [Math.min(...xs), Math.max(...xs)];
      const pad = (b - a) * 0.05 || Math.abs(a) * 0.05 || 1;
      return { min: a - pad, max: b + pad, axisLabel: { formatter: tick } };
    };
    const dims = [...feats.map((f, i) => (numeric[f] ? { dim: i, name: f, ...extent(f) } : { dim: i, name: f, type: "category", data: cats[f] })),
      { dim: feats.length, name: metricLabel(m, "eval"), min: floor, max: hi, axisLabel: { formatter: (v) => (v < lo ? "none" : tick(v)) } },
      { dim: feats.length + 1, name: "state", type: "category", data: WORDS }];
    const unscored = trials.filter((t) => metricOf(t, m) === null);
    const colors = mode === "max" ? ["#d64545", "#f5c26b", "#2fa36b"] : ["#2fa36b", "#f5c26b", "#d64545"];
    charts.parallel.setOption({
      animation: false,
      parallelAxis: dims,
      parallel: { left: 70, right: 110, top: 40, bottom: 30, parallelAxisDefault: { nameTextStyle: { fontSize: 11 }, nameGap: 12 } },
      legend: { top: 0, data: [`${scored.length} with ${m}`, `${unscored.length} without (failed, cancelled, unfinished)`] },
      visualMap: scored.length ? { show: true, type: "continuous", dimension: feats.length, seriesIndex: 0, min: lo, max: hi === lo ? lo + 1e-9 : hi,
        right: 0, top: 60, calculable: true, precision: 4, formatter: tick, text: [mode === "max" ? "better" : "worse", ""],
        inRange: { color: colors } } : undefined,
      tooltip: { trigger: "item" },
      series: [
        { name: `${scored.length} with ${m}`, type: "parallel", lineStyle: { width: 1, opacity: 0.55 }, ...PROGRESSIVE, data: scored.map(row) },
        { name: `${unscored.length} without (failed, cancelled, unfinished)`, type: "parallel", lineStyle: { width: 1, opacity: 0.6, type: "dashed", color: WORD_COLOR.failed },
          data: unscored.map(row) },
      ],
    }, { notMerge: true });
    el.dataset.lines = String(trials.length);
    el.dataset.failedLines = String(unscored.filter((t) => word(t.state) === "failed").length);
    document.getElementById("pc-info").textContent = `${trials.length} trials over ${feats.length} tuned choices (${mode === "max" ? "higher" : "lower"} ${m} is better)`;

    // importance (the server's estimate over every trial), slices of the most important choices
    const imp = Object.entries(data.importance[m] || {}).sort((a, b) => b[1] - a[1]);
    charts.importance.setOption({
      animation: false, grid: { left: 110, right: 30, top: 10, bottom: 40 },
      tooltip: { trigger: "item", formatter: (p) => `${esc(p.name)}: ${fmt(p.value, 3)} of the variance the choices explain` },
      xAxis: { type: "value", max: 1, name: "share of what the choices explain", nameLocation: "middle", nameGap: 22 }, yAxis: { type: "category", data: imp.map((x) => x[0]).reverse() },
      series: [{ type: "bar", data: imp.map((x) => x[1]).reverse(), itemStyle: { color: "#2f6fde" } }],
    }, { notMerge: true });
    document.getElementById("importance").dataset.features = String(imp.length);
    const top = (imp.length ? imp.map((x) => x[0]) : feats).slice(0, SLICES);
    const w = 100 / Math.max(1, top.length);
    charts.slices.setOption({
      animation: false,
      grid: top.map((f, i) => ({ left: `${i * w + 5}%`, width: `${w - 8}%`, top: 30, bottom: 40 })),
      title: top.map((f, i) => ({ text: f, left: `${i * w + 5}%`, top: 4, textStyle: { fontSize: 12, fontWeight: "normal" } })),
      xAxis: top.map((f, i) => (numeric[f] ? { gridIndex: i, type: "value", scale: true } : { gridIndex: i, type: "category", data: cats[f] })),
      yAxis: top.map((f, i) => ({ gridIndex: i, type: "value", scale: true, name: i === 0 ? metricLabel(m, "eval") : "" })),
      tooltip: { trigger: "item", formatter: (p) => `${esc(p.data[2])}: ${fmt(p.data[1])}` },
      series: top.map((f, i) => ({ type: "scatter", xAxisIndex: i, yAxisIndex: i, symbolSize: 6, itemStyle: { color: "#2f6fde", opacity: 0.7 }, ...BULK,
        data: scored.filter((t) => f in t.features).map((t) => [numeric[f] ? t.features[f] : String(t.features[f]), metricOf(t, m), t.key]) })),
    }, { notMerge: true });

    drawContour(m, mode, scored, imp.map((x) => x[0]).filter((f) => numeric[f]), feats.filter((f) => numeric[f]));

    // optimisation history: each trial's metric in the order the trials began, and the best so far
    const order = [...trials].sort((a, b) => (a.started_at || 0) - (b.started_at || 0));
    let best = null;
    const pts = [], line = [];
    order.forEach((t, i) => {
      const v = metricOf(t, m);
      if (v === null) return;
      pts.push([i + 1, v, t.key]);
      if (best === null || (mode === "max" ? v > best : v < best)) best = v;
      line.push([i + 1, best]);
    });
    charts.history.setOption({
      animation: false, grid: { left: 60, right: 20, top: 30, bottom: 40 }, legend: { top: 0 },
      tooltip: { trigger: "item", formatter: (p) => (p.data[2] ? `${esc(p.data[2])}: ${fmt(p.data[1])}` : `best so far: ${fmt(p.data[1])}`) },
      xAxis: { type: "value", name: "trial (in the order they began)", nameLocation: "middle", nameGap: 26, min: 1 },
      yAxis: { type: "value", scale: true, name: metricLabel(m, "eval") },
      series: [{ name: "trial", type: "scatter", symbolSize: 5, data: pts, itemStyle: { color: "#2f6fde", opacity: 0.6 }, ...BULK },
        { name: "best so far", type: "line", step: "end", showSymbol: false, data: line, lineStyle: { color: "#2fa36b", width: 2 } }],
    }, { notMerge: true });
  }
  // the metric over the two most important numeric choices: the trials, and between them a surface
  // interpolated by inverse-distance weighting (on the choices scaled to their ranges), as a heat map
  function drawContour(m, mode, scored, ranked, numericFeats) {
    const el = document.getElementById("contour");
    const [fx, fy] = [...new Set([...ranked, ...numericFeats])];
    const pts = fy === undefined ? [] : scored.filter((t) => typeof t.features[fx] === "number" && typeof t.features[fy] === "number")
      .map((t) => [t.features[fx], t.features[fy], metricOf(t, m), t.key]);
    el.dataset.x = fx || ""; el.dataset.y = fy || ""; el.dataset.points = String(pts.length);
    if (pts.length < 3) {
      charts.contour.clear();
      document.getElementById("contour-info").textContent = "(two numeric choices and three scored trials needed)";
      el.dataset.ready = "1";
      return;
    }
    const span = (i) => { const v = pts.map((p) => p[i]); const a = Math.min(...v), b = Math.max(...v); return [a, b, b - a || 1]; };
    const [x0, , xw] = span(0), [y0, , yw] = span(1);
    const cells = [];
    for (let i = 0; i < CONTOUR_GRID; i++) for (let j = 0; j < CONTOUR_GRID; j++) {
      const u = (i + 0.5) / CONTOUR_GRID, v = (j + 0.5) / CONTOUR_GRID;
      let num = 0, den = 0, exact = null;
      for (const p of pts) {
        const d2 = ((p[0] - x0) / xw - u) ** 2 + ((p[1] - y0) / yw - v) ** 2;
        if (d2 < 1e-12) { exact = p[2]; break; }
        const w = 1 / (d2 * d2);
        num += w * p[2]; den += w;
      }
      cells.push([i, j, exact ?? num / den]);
    }
    const vals = pts.map((p) => p[2]);
    const lo = Math.min(...vals), hi = Math.max(...vals);
    const colors = mode === "max" ? ["#d64545", "#f5c26b", "#2fa36b"] : ["#2fa36b", "#f5c26b", "#d64545"];
    const at = (k, a, w) => a + ((k + 0.5) / CONTOUR_GRID) * w;
    charts.contour.setOption({
      animation: false, grid: { left: 60, right: 80, top: 10, bottom: 40 },
      tooltip: { trigger: "item", formatter: (p) => (p.seriesIndex === 1 ? `${esc(p.data[3])}: ${fmt(p.data[2])}` : `≈ ${fmt(p.data[2])}`) },
      xAxis: [{ type: "category", data: [...Array(CONTOUR_GRID).keys()].map((k) => tick(at(k, x0, xw))), name: fx, nameLocation: "middle", nameGap: 26, axisLabel: { interval: 6 } },
        { type: "value", min: x0, max: x0 + xw, show: false }],
      yAxis: [{ type: "category", data: [...Array(CONTOUR_GRID).keys()].map((k) => tick(at(k, y0, yw))), name: fy, axisLabel: { interval: 6 } },
        { type: "value", min: y0, max: y0 + yw, show: false }],
      visualMap: { type: "continuous", min: lo, max: hi === lo ? lo + 1e-9 : hi, dimension: 2, seriesIndex: [0, 1], right: 0, top: 10, calculable: true,
        precision: 4, formatter: tick, text: [mode === "max" ? "better" : "worse", ""], inRange: { color: colors } },
      series: [{ type: "heatmap", data: cells, itemStyle: { opacity: 0.75 } },
        { type: "scatter", xAxisIndex: 1, yAxisIndex: 1, data: pts, symbolSize: 7, itemStyle: { borderColor: "#1f2933", borderWidth: 1 }, ...BULK }],
    }, { notMerge: true });
    document.getElementById("contour-info").textContent = `${metricLabel(m, "eval")} over ${fx} and ${fy}, ${pts.length} trials`;
    el.dataset.ready = "1";
  }
  charts.contour.on("click", (e) => {
    const t = e.seriesIndex === 1 && e.data && data.trials.find((x) => x.key === e.data[3]);
    if (t) location.hash = trialHref(studyId, t);
  });

  charts.history.on("click", (e) => {
    const t = e.data && e.data[2] && data.trials.find((x) => x.key === e.data[2]);
    if (t) location.hash = trialHref(studyId, t);
  });

  // -- controls and live updates ------------------------------------------------------------------
  function fillMetrics() {
    const steps = curves.names;
    const ev = [...new Set([...(curves.evalNames || []), ...data.metrics])].sort();
    if (!state.metric && steps.length) state.metric = steps.find((n) => /loss/i.test(n)) || steps[0];
    if (!state.evalMetric && ev.length) state.evalMetric = (data.best && data.best.metric) || ev[0];
    if (!state.pcMetric && ev.length) state.pcMetric = (data.best && data.best.metric) || ev[0];
    const opts = (names, sel, kind) => names.map((n) => `<option value="${esc(n)}" ${n === sel ? "selected" : ""}>${esc(metricLabel(n, kind))}</option>`).join("");
    document.getElementById("metric").innerHTML = opts(steps, state.metric, "step") || `<option value="">none</option>`;
    document.getElementById("eval-metric").innerHTML = opts(ev, state.evalMetric, "eval") || `<option value="">none</option>`;
    document.getElementById("pc-metric").innerHTML = opts(ev, state.pcMetric, "eval") || `<option value="">none</option>`;
  }
  document.getElementById("metric").addEventListener("change", async (e) => { state.metric = e.target.value; await loadCurves(false); });
  document.getElementById("eval-metric").addEventListener("change", (e) => { state.evalMetric = e.target.value; drawTrials(); loadEval(); });
  document.getElementById("pc-metric").addEventListener("change", (e) => { state.pcMetric = e.target.value; drawChoices(); });
  document.getElementById("x-axis").addEventListener("change", async (e) => { state.x = e.target.value; await loadCurves(false); drawEval(); });
  document.getElementById("robust").addEventListener("change", (e) => { state.robust = e.target.checked; drawCurves(); drawEval(); });
  document.getElementById("log").addEventListener("change", (e) => { state.log = e.target.checked; drawCurves(); drawEval(); });
  document.getElementById("smooth").addEventListener("input", (e) => { state.smooth = Number(e.target.value); drawCurves(); });

  drawHeader();
  fillMetrics();
  loadEval();
  drawTrials();
  drawChoices();
  const first = await firstP;
  if (!alive(gen)) { window.removeEventListener("resize", onResize); Object.values(charts).forEach((c) => c.dispose()); return null; }
  if (first.kind === "step") state.metric = first.metric;
  applyCurves(first, false);
  if (first.kind !== "step") drawCurves();

  const refresh = throttle(async () => {
    const got = await api(`/dashboard/studies/${id}`);
    if (!alive(gen)) return;
    data = got;
    rebuilds();
    fillMetrics();
    drawHeader(); drawTrials(); drawChoices();
    loadEval();
    if (!state.metric) { const c = await api(`/dashboard/studies/${id}/curves`); if (alive(gen) && c.kind === "step") { state.metric = c.metric; applyCurves(c, false); } }
  }, 500);
  const moreCurves = throttle(async () => { if (await loadCurves(true)) rebuilds(); }, 100);
  return {
    study: studyId,
    since: () => curves.asOf,
    onCounts: refresh,
    onCurves: moreCurves,
    stop: () => { window.removeEventListener("resize", onResize); Object.values(charts).forEach((c) => c.dispose()); },
  };
}
