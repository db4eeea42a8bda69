// The Trial page: one trial in full. Its failure first when it failed (what was raised, the traceback,
// the worker's log), its schedule over every step it was asked for, its rungs, its learning curve with
// its evaluations at their steps, the steps it shares with which other trials, and the batch attempts
// that ran it (host, slot, times, logs).
import { PALETTE, alive, api, badge, duration, esc, fmt, metricLabel, robustRange, throttle, tick, trialLink, when, word, workerLogHtml } from "./common.js";

export async function renderTrial(main, studyId, by, name, gen) {
  const id = encodeURIComponent(studyId);
  const q = by === "request" ? `request_id=${encodeURIComponent(name)}` : `label=${encodeURIComponent(name)}`;
  let t = await api(`/dashboard/studies/${id}/trial?${q}`);
  const state = { metric: null, evalMetric: null, robust: true };
  main.innerHTML = `<h1><a href="#/study/${id}" id="study-link"></a> › <span id="trial-name"></span> <span id="trial-state"></span></h1>
    <div id="failure"></div>
    <div class="row"><div class="card" id="trial-summary"></div><div class="card" id="trial-rungs"><h2>Rungs</h2><table id="rungs"></table></div></div>
    <div class="card"><h2>Schedule</h2><div id="schedule-text" class="sched"></div><div id="schedule-chart" class="chart"></div></div>
    <div class="card"><div class="controls"><h2>Learning curve</h2>
      <label>step metric <select id="trial-metric"></select></label>
      <label>evaluation <select id="trial-eval"></select></label>
      <label><input type="checkbox" id="trial-robust" checked> clip outliers</label>
      <span class="muted" id="trial-curve-info"></span></div><div id="trial-curve" class="chart"></div></div>
    <div class="row"><div class="card"><h2>Shared steps</h2><table id="sharing"></table></div>
      <div class="card"><h2>Batch attempts</h2><table id="attempts"></table><div id="worker-log-box"></div></div></div>`;
  const charts = { schedule: echarts.init(document.getElementById("schedule-chart")), curve: echarts.init(document.getElementById("trial-curve")) };
  const onResize = () => Object.values(charts).forEach((c) => c.resize());
  window.addEventListener("resize", onResize);

  function drawHead() {
    document.getElementById("study-link").textContent = t.study.name;
    document.getElementById("trial-name").textContent = t.key;
    document.getElementById("trial-state").innerHTML = badge(t.state);
    const feats = Object.entries(t.features).map(([k, v]) => `<span class="chip">${esc(k)} = ${esc(typeof v === "number" ? fmt(v) : v)}</span>`).join("");
    const first = t.rungs[0], last = t.rungs[t.rungs.length - 1];
    const ran = first && last && last.done_at && first.created_at ? duration(last.done_at - first.created_at) : "–";
    document.getElementById("trial-summary").innerHTML = `<h2>Trial</h2>
      <div class="kpi"><b>${t.step}</b><span>steps asked</span></div><div class="kpi"><b>${t.trained}</b><span>steps answered</span></div>
      <div class="kpi"><b>${t.rungs.length}</b><span>rungs</span></div><div class="kpi"><b>${ran}</b><span>first asked to last answer</span></div>
      <div class="kpi"><b>node ${t.node}</b><span>of plan ${t.plan_id} (<a href="#/tree/${id}" id="tree-link">in the stage tree</a>)</span></div>
      <p>${feats || `<span class="muted">no tuned choice varies in this study</span>`}</p>`;
  }

  function drawFailure() {
    const f = t.failure;
    const box = document.getElementById("failure");
    if (!f) { box.innerHTML = ""; return; }
    const failed = [...t.rungs].reverse().find((r) => r.state === "FAILED");
    const att = failed && t.attempts.filter((a) => a.batch_id === failed.batch_id).pop();
    box.innerHTML = `<div class="card failure"><h2>Failed: <span id="failure-headline">${esc(f.headline)}</span></h2>
      ${f.traceback ? `<pre id="traceback">${esc(f.traceback)}</pre>` : `<p class="muted">no traceback was kept</p>`}
      <p>Worker log: ${f.log_path ? `<code id="log-path">${esc(f.log_path)}</code>` : `<span class="muted">not said</span>`}
      ${f.node_manager ? ` on host <a href="#/cluster">${esc(f.node_manager)}</a>` : ""}
      ${att ? ` <button type="button" data-log="${att.batch_id}:${att.attempt}">show the log's end</button>` : ""}</p></div>`;
  }

  function drawRungs() {
    const names = [...new Set(t.rungs.flatMap((r) => Object.keys(r.metrics)))].sort();
    document.getElementById("rungs").innerHTML = `<thead><tr><th>step</th><th>state</th>${names.map((m) => `<th>${esc(metricLabel(m, "eval"))}</th>`).join("")}
      <th>asked</th><th>answered</th><th>batch</th></tr></thead><tbody>${t.rungs.map((r) => `<tr data-request="${r.request_id}" data-state="${r.state}">
      <td>${r.step}</td><td>${badge(r.state)}</td>${names.map((m) => `<td>${fmt(r.metrics[m])}</td>`).join("")}
      <td>${when(r.created_at)}</td><td>${when(r.done_at)}</td><td>${r.batch_id ?? "–"}</td></tr>`).join("")}</tbody>`;
  }

  function drawSchedule() {
    document.getElementById("schedule-text").innerHTML = t.schedule.hps.map((h) => `<div><b>${esc(h.name)}</b> = ${esc(h.text)}</div>`).join("");
    const hps = t.schedule.hps.filter((h) => h.numeric);
    const n = Math.max(1, hps.length);
    const el = document.getElementById("schedule-chart");
    el.style.height = `${Math.max(220, 150 * n)}px`;
    charts.schedule.resize();
    charts.schedule.setOption({
      animation: false, color: PALETTE,
      grid: hps.map((h, i) => ({ left: 70, right: 30, top: `${(i * 100) / n + 4}%`, height: `${100 / n - 12}%` })),
      xAxis: hps.map((h, i) => ({ gridIndex: i, type: "value", min: 0, max: t.schedule.horizon, name: i === n - 1 ? "step (the study's horizon; dashed: this trial's rungs)" : "", nameLocation: "middle", nameGap: 24 })),
      yAxis: hps.map((h, i) => ({ gridIndex: i, type: "value", scale: true, name: h.name, nameTextStyle: { align: "left" }, axisLabel: { formatter: tick } })),
      tooltip: { trigger: "axis" },
      series: hps.map((h, i) => ({ name: h.name, type: "line", xAxisIndex: i, yAxisIndex: i, showSymbol: false, data: h.points,
        markLine: { silent: true, symbol: "none", lineStyle: { color: "#9aa5b1", type: "dashed" }, data: t.rungs.map((r) => ({ xAxis: r.step })) } })),
    }, { notMerge: true });
    el.dataset.ready = "1";
  }

  function drawCurve() {
    const names = [...new Set(t.curve.points.flatMap((p) => Object.keys(p[1])))].sort();
    const evNames = [...new Set(t.rungs.flatMap((r) => Object.keys(r.metrics)))].sort();
    if (!state.metric || !names.includes(state.metric)) state.metric = names.find((n) => /loss/i.test(n)) || names[0] || null;
    if (!state.evalMetric || !evNames.includes(state.evalMetric)) state.evalMetric = evNames.find((n) => !/loss/i.test(n)) || evNames[0] || null;
    document.getElementById("trial-metric").innerHTML = names.map((n) => `<option value="${esc(n)}" ${n === state.metric ? "selected" : ""}>${esc(metricLabel(n, "step"))}</option>`).join("") || `<option value="">none</option>`;
    document.getElementById("trial-eval").innerHTML = evNames.map((n) => `<option value="${esc(n)}" ${n === state.evalMetric ? "selected" : ""}>${esc(metricLabel(n, "eval"))}</option>`).join("") || `<option value="">none</option>`;
    const line = state.metric ? t.curve.points.filter((p) => typeof p[1][state.metric] === "number").map((p) => [p[0], p[1][state.metric]]) : [];
    const dots = state.evalMetric ? t.rungs.filter((r) => typeof r.metrics[state.evalMetric] === "number").map((r) => [r.step, r.metrics[state.evalMetric]]) : [];
    const r1 = state.robust ? robustRange(line.map((p) => p[1])) : null;
    const r2 = state.robust ? robustRange(dots.map((p) => p[1])) : null;
    const series = [];
    if (state.metric) series.push({ name: metricLabel(state.metric, "step"), type: "line", showSymbol: false, data: line, yAxisIndex: 0, clip: true });
    if (state.evalMetric) series.push({ name: metricLabel(state.evalMetric, "eval"), type: "line", data: dots, yAxisIndex: 1, symbolSize: 9, symbol: "diamond", lineStyle: { type: "dashed" } });
    charts.curve.setOption({
      animation: false, color: ["#2f6fde", "#e8590c"], legend: { top: 0 }, tooltip: { trigger: "axis" },
      grid: { left: 60, right: 70, top: 36, bottom: 40 },
      xAxis: { type: "value", name: "step", nameLocation: "middle", nameGap: 26, min: 0, max: t.schedule.horizon },
      yAxis: [{ type: "value", scale: true, name: state.metric ? metricLabel(state.metric, "step") : "", ...(r1 ? { min: r1.min, max: r1.max } : {}),
        axisLabel: { formatter: tick, showMinLabel: !r1, showMaxLabel: !r1 } },
        { type: "value", scale: true, name: state.evalMetric ? metricLabel(state.evalMetric, "eval") : "", ...(r2 && dots.length > 4 ? { min: r2.min, max: r2.max } : {}),
        axisLabel: { formatter: tick }, splitLine: { show: false } }],
      dataZoom: [{ type: "inside" }],
      series,
    }, { notMerge: true });
    document.getElementById("trial-curve-info").textContent = `${t.curve.points.length} points${t.curve.total > t.curve.points.length ? ` of ${t.curve.total}` : ""}, ${dots.length} evaluations`;
    const el = document.getElementById("trial-curve");
    el.dataset.points = String(line.length);
    el.dataset.evals = String(dots.length);
    el.dataset.ready = "1";
  }

  function drawSharing() {
    // per piece of its path: who ran the same steps, grouped by how far they ran them with it
    const groups = (p) => {
      const by = new Map();
      for (const x of p.trials) { if (!by.has(x.until)) by.set(x.until, []); by.get(x.until).push(x.key); }
      return [...by.entries()].sort((a, b) => b[0] - a[0]).map(([until, keys]) => `<div><span class="muted">steps ${p.start}–${until}:</span> `
        + keys.map((k) => trialLink(studyId, k)).join(", ") + "</div>").join("");
    };
    document.getElementById("sharing").innerHTML = `<thead><tr><th>its steps</th><th>node</th><th>shared with</th></tr></thead><tbody>${t.path.map((p) => `<tr data-node="${p.node}">
      <td>${p.start}–${p.end}</td><td>${p.node}</td><td>${p.shared_with ? `<b>${p.shared_with}</b> other trial${p.shared_with > 1 ? "s" : ""}${groups(p)}`
        + (p.shared_with > p.trials.length ? `<div class="muted">and ${p.shared_with - p.trials.length} more</div>` : "")
        : `<span class="muted">its own</span>`}</td></tr>`).join("")}</tbody>`;
  }

  function drawAttempts() {
    document.getElementById("attempts").innerHTML = `<thead><tr><th>batch</th><th>attempt</th><th>host</th><th>slot</th><th>state</th><th>started</th><th>ran</th><th></th></tr></thead>
      <tbody>${t.attempts.map((a) => `<tr data-batch="${a.batch_id}"><td>${a.batch_id}</td><td>${a.attempt}</td><td><a href="#/cluster">${esc(a.node_manager)}</a></td>
      <td>${esc(a.slots.join(", "))}</td><td>${esc(a.state.toLowerCase())}</td><td>${when(a.started_at || a.dispatched_at)}</td>
      <td>${a.finished_at ? duration(a.finished_at - (a.started_at || a.dispatched_at)) : "–"}</td>
      <td><button type="button" data-log="${a.batch_id}:${a.attempt}">log</button></td></tr>`).join("") || `<tr><td colspan="8" class="muted">none yet</td></tr>`}</tbody>`;
  }

  async function showLog(key) {
    const [b, a] = key.split(":");
    const box = document.getElementById("worker-log-box");
    box.innerHTML = `<p class="muted">reading the log…</p>`;
    const got = await api(`/dashboard/studies/${id}/batches/${b}/log?attempt=${a}`);
    if (!alive(gen)) return;
    box.innerHTML = workerLogHtml(got);
    box.scrollIntoView({ block: "nearest" });
  }
  main.addEventListener("click", (e) => {
    const btn = e.target.closest("button[data-log]");
    if (btn) showLog(btn.dataset.log).catch((err) => { document.getElementById("worker-log-box").textContent = err.message; });
  });
  document.getElementById("trial-metric").addEventListener("change", (e) => { state.metric = e.target.value; drawCurve(); });
  document.getElementById("trial-eval").addEventListener("change", (e) => { state.evalMetric = e.target.value; drawCurve(); });
  document.getElementById("trial-robust").addEventListener("change", (e) => { state.robust = e.target.checked; drawCurve(); });

  function drawAll() { drawHead(); drawFailure(); drawRungs(); drawSchedule(); drawCurve(); drawSharing(); drawAttempts(); }
  drawAll();
  const refresh = throttle(async () => {
    const got = await api(`/dashboard/studies/${id}/trial?${q}`);
    if (!alive(gen)) return;
    t = got;
    drawAll();
  }, 1000);
  return {
    study: studyId,
    onCounts: refresh,
    onCurves: () => { if (word(t.state) === "running") refresh(); },
    stop: () => { window.removeEventListener("resize", onResize); Object.values(charts).forEach((c) => c.dispose()); },
  };
}
