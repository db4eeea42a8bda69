// The Cluster page: how busy the slots are and were (a batch sent to a slot ahead of time, to start when
// it frees, is shown apart and not counted busy), each host's slots with the study and trials each batch
// serves and its worker's log, GPU telemetry, recent failures (what was raised, where the log is) and
// recent policy decisions.
import { alive, api, esc, fmt, throttle, trialLink, when, workerLogHtml } from "./common.js";

const REFRESH_MS = 5000;

function workHtml(w, kind) {
  if (!w) return `<span class="muted">idle</span>`;
  if (!w.batch_id) return `busy <span class="muted">(another owner's work${w.sent_ahead ? ", sent ahead" : ""})</span>`;
  const pct = w.end > w.start ? Math.round((100 * (w.step - w.start)) / (w.end - w.start)) : 0;
  const studies = (w.studies || []).map((s) => `<a href="#/study/${encodeURIComponent(s.id)}">${esc(s.name)}</a>: `
    + s.trials.map((k) => trialLink(s.id, k)).join(", ") + (s.trial_count > s.trials.length ? ` +${s.trial_count - s.trials.length}` : "")).join("; ");
  const first = (w.studies || [])[0];
  // the log's end where this master reads the node manager's files (w.log), else where it is; and in
  // every mode what the trainer logged
  const log = first ? ` <button type="button" data-log="${esc(first.id)}:${w.batch_id}:${w.attempt}">log</button>` : "";
  const status = kind === "next" ? `<span class="badge s-waiting">sent ahead</span>` : w.started ? "" : `<span class="badge s-waiting">starting</span>`;
  return `${status}${studies || `<span class="muted">no live request</span>`}<div class="muted">batch ${w.batch_id} (attempt ${w.attempt}), nodes ${w.nodes.join(" → ")},
    steps ${w.start}–${w.end}${kind === "next" ? "" : ` <span class="progress" title="step ${w.step}"><i style="width:${pct}%"></i></span> ${w.step}`}${log}</div>`;
}

export async function renderCluster(main, gen) {
  main.innerHTML = `<h1>Cluster</h1><div class="card"><div class="row">
      <div class="kpi" id="busy-kpi"></div><div style="flex: 1 1 600px"><h3>Busy slots (the last 30 minutes at most)</h3><div id="utilisation" class="chart small"></div></div></div></div>
    <div id="hosts"></div>
    <div class="card"><h2>Recent failures</h2><table id="failures" class="clickable-rows"></table></div>
    <div class="card"><h2>Recent policy decisions</h2><table id="decisions"></table></div>
    <div class="card" id="cluster-log" hidden></div>`;
  const chart = echarts.init(document.getElementById("utilisation"));
  const onResize = () => chart.resize();
  window.addEventListener("resize", onResize);

  async function draw() {
    const c = await api("/dashboard/cluster");
    if (!alive(gen)) return;
    const s = c.summary;
    document.getElementById("busy-kpi").innerHTML = `<b id="busy-count">${s.busy} / ${s.slots}</b><span>slots busy</span>
      ${s.sent_ahead ? `<span class="muted">+${s.sent_ahead} batch${s.sent_ahead === 1 ? "" : "es"} sent ahead (start when a slot frees)</span>` : ""}`;
    const h = c.history;
    chart.setOption({
      animation: false, grid: { left: 40, right: 20, top: 10, bottom: 30 },
      tooltip: { trigger: "axis", valueFormatter: (v) => fmt(v, 2) },
      xAxis: { type: "time" }, yAxis: { type: "value", min: 0, max: Math.max(1, h.slots), name: "slots" },
      series: [{ type: "line", step: "middle", areaStyle: { opacity: 0.25 }, showSymbol: false, data: h.busy.map((v, i) => [(h.t0 + (i + 0.5) * h.bucket_s) * 1000, v]) },
        { type: "line", showSymbol: false, lineStyle: { type: "dashed", color: "#9aa5b1" }, data: [[h.t0 * 1000, h.slots], [h.t1 * 1000, h.slots]], silent: true }],
    }, { notMerge: true });
    document.getElementById("utilisation").dataset.ready = "1";

    document.getElementById("hosts").innerHTML = c.node_managers.map((nm) => {
      const slots = nm.slots.map((sl) => {
        const kind = sl.gpu_index >= 0 ? `GPU ${sl.gpu_index} ${esc(sl.gpu_type)}${sl.share ? ` (share ${sl.share})` : ""}` : `CPU (${sl.cpu_cores || "?"} cores)`;
        const next = sl.next.map((w) => `<div class="next">${workHtml(w, "next")}</div>`).join("");
        return `<tr data-slot="${esc(sl.id)}"><td>${esc(sl.id)}</td><td>${kind}</td><td>${workHtml(sl.work, "now")}${next}</td></tr>`;
      }).join("");
      const gpus = nm.gpus.length ? `<h3>GPUs</h3><table><tr><th>GPU</th><th>utilization</th><th>memory</th><th>processes</th></tr>${nm.gpus.map((g) =>
        `<tr><td>${g.gpu_index}</td><td>${fmt(g.utilization, 0)} %</td><td>${fmt(g.memory_used / 2 ** 30, 2)} / ${fmt(g.memory_total / 2 ** 30, 2)} GiB</td><td>${(g.processes || []).length}</td></tr>`).join("")}</table>`
        : `<p class="muted">no GPU telemetry (no NVML on this host, or none reported yet)</p>`;
      return `<div class="card node-manager" data-nm="${esc(nm.id)}"><h2>host ${esc(nm.id)} <span class="badge s-${{ ALIVE: "done", LEFT: "cancelled" }[nm.state] || "failed"}">${esc(nm.state.toLowerCase())}</span>
        <span class="muted">${esc(nm.address)}, heard ${when(nm.last_heartbeat)}</span></h2><table><tr><th>slot</th><th>kind</th><th>running</th></tr>${slots}</table>${gpus}</div>`;
    }).join("") || `<div class="card muted">no hosts (node managers) registered</div>`;

    document.getElementById("failures").innerHTML = `<tr><th>when</th><th>study</th><th>trial</th><th>what was raised</th><th>worker log</th></tr>` + (c.failures.map((f) => `<tr data-trial="${esc(f.trial)}">
      <td>${when(f.at)}</td><td><a href="#/study/${encodeURIComponent(f.study_id)}">${esc(f.study)}</a></td><td>${trialLink(f.study_id, f.trial)} <span class="muted">@${f.step}</span></td>
      <td class="error">${esc(f.headline)}</td><td>${f.log_path ? `<code>${esc(f.log_path)}</code> on ${esc(f.node_manager)}` : "–"}</td></tr>`).join("")
      || `<tr><td colspan="5" class="muted">none</td></tr>`);
    document.getElementById("decisions").innerHTML = `<tr><th>study</th><th>decision</th><th>what</th><th>reason</th></tr>` + (c.decisions.map((d) => `<tr>
      <td><a href="#/study/${encodeURIComponent(d.study_id)}">${esc(d.study)}</a></td><td><span class="badge s-cancelled">${esc(d.kind)}</span></td>
      <td>${d.kind === "kill" ? trialLink(d.study_id, d.what) : esc(d.what)}</td><td>${esc(d.reason)}</td></tr>`).join("") || `<tr><td colspan="4" class="muted">none</td></tr>`);
  }

  main.addEventListener("click", async (e) => {
    const btn = e.target.closest("button[data-log]");
    if (btn) {
      const [sid, b, a] = btn.dataset.log.split(":");
      const box = document.getElementById("cluster-log");
      box.hidden = false;
      box.innerHTML = `<p class="muted">reading the log…</p>`;
      try {
        const got = await api(`/dashboard/studies/${encodeURIComponent(sid)}/batches/${b}/log?attempt=${a}`);
        box.innerHTML = workerLogHtml(got);
      } catch (err) { box.textContent = err.message; }
      box.scrollIntoView({ block: "nearest" });
      return;
    }
    const tr = e.target.closest("#failures tr[data-trial]");
    if (tr && !e.target.closest("a")) { const a = tr.querySelector("td:nth-child(3) a"); if (a) location.hash = a.getAttribute("href"); }
  });
  await draw();
  const redraw = throttle(draw, 500);
  // Slots start, progress and free without a study's events (a trainer may report no curve): a look
  // every few seconds besides them.
  const tick = setInterval(() => { if (!document.hidden) redraw(); }, REFRESH_MS);
  return {
    onCounts: redraw, onCurves: throttle(draw, 2000),
    stop: () => { clearInterval(tick); window.removeEventListener("resize", onResize); chart.dispose(); },
  };
}
