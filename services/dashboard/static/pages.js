// The Studies and Cluster pages.
import { alive, api, esc, fmt, throttle } from "./app.js";

const STATES = ["NOT_SCHED", "SCHED", "DONE", "FAILED", "CANCELLED"];
const STATE_TEXT = { NOT_SCHED: "waiting", SCHED: "running", DONE: "done", FAILED: "failed", CANCELLED: "cancelled" };

export function counts(c) {
  return STATES.filter((s) => c[s]).map((s) => `<span class="badge s-${s}" data-state="${s}" title="${STATE_TEXT[s]}">${STATE_TEXT[s]} ${c[s]}</span>`).join("") || `<span class="muted">no requests</span>`;
}

export function best(b) {
  if (!b) return `<span class="muted">–</span>`;
  return `${esc(b.metric)} <b>${fmt(b.value)}</b> <span class="muted">(${b.mode}, ${esc(b.label || "request " + b.request_id)} @${b.step})</span>`;
}

export async function renderStudies(main, gen) {
  async function draw() {
    const studies = await api("/dashboard/studies");
    if (!alive(gen)) return;
    const rows = studies.map((s) => `<tr data-study="${esc(s.id)}">
      <td><a href="#/study/${encodeURIComponent(s.id)}">${esc(s.name)}</a><br><span class="muted">${esc(s.id)}</span></td>
      <td class="counts">${counts(s.counts)}</td><td>${s.trials}</td><td>${best(s.best)}</td>
      <td>${fmt(s.merge_rate, 2)}</td><td>${s.saved_steps} steps<br><span class="muted">${fmt(s.saved_seconds, 1)} s</span></td>
      <td><a href="#/tree/${encodeURIComponent(s.id)}">stage tree</a></td></tr>`).join("");
    main.innerHTML = `<h1>Studies</h1><div class="card"><table id="studies-table"><thead><tr><th>study</th><th>requests</th>
      <th>trials</th><th>best</th><th>merge rate</th><th>compute saved</th><th></th></tr></thead>
      <tbody>${rows || `<tr><td colspan="7" class="muted">no studies yet: create one with the SDK</td></tr>`}</tbody></table></div>`;
  }
  await draw();
  const again = throttle(draw, 300);
  return { onCounts: again };
}

export async function renderCluster(main, gen) {
  async function draw() {
    const c = await api("/dashboard/cluster");
    if (!alive(gen)) return;
    const nms = c.node_managers.map((nm) => {
      const slots = nm.slots.map((s) => {
        let work = `<span class="muted">idle</span>`;
        if (s.work && s.work.batch_id) {
          const pct = s.work.end > s.work.start ? Math.round((100 * (s.work.step - s.work.start)) / (s.work.end - s.work.start)) : 0;
          work = `batch ${s.work.batch_id} (attempt ${s.work.attempt}) nodes ${s.work.nodes.join(" → ")}, steps ${s.work.start}–${s.work.end}
            <span class="progress" title="step ${s.work.step}"><i style="width:${pct}%"></i></span> ${s.work.step}`;
        } else if (s.work) work = `busy <span class="muted">(another owner's work)</span>`;
        const kind = s.gpu_index >= 0 ? `GPU ${s.gpu_index} ${esc(s.gpu_type)}${s.share ? ` (share ${s.share})` : ""}` : `CPU (${s.cpu_cores || "?"} cores)`;
        return `<tr data-slot="${esc(s.id)}"><td>${esc(s.id)}</td><td>${kind}</td><td>${work}</td></tr>`;
      }).join("");
      const gpus = nm.gpus.length ? `<h2>GPUs</h2><table><tr><th>GPU</th><th>utilization</th><th>memory</th><th>processes</th></tr>${nm.gpus.map((g) =>
        `<tr><td>${g.gpu_index}</td><td>${fmt(g.utilization, 0)} %</td><td>${fmt(g.memory_used / 2 ** 30, 2)} / ${fmt(g.memory_total / 2 ** 30, 2)} GiB</td><td>${(g.processes || []).length}</td></tr>`).join("")}</table>`
        : `<p class="muted">no GPU telemetry (no NVML on this node manager, or none reported yet)</p>`;
      return `<div class="card node-manager" data-nm="${esc(nm.id)}"><h2>${esc(nm.id)} <span class="badge s-${nm.state === "ALIVE" ? "done" : "failed"}">${esc(nm.state)}</span>
        <span class="muted">${esc(nm.address)}</span></h2><table><tr><th>slot</th><th>kind</th><th>running</th></tr>${slots}</table>${gpus}</div>`;
    }).join("");
    const decisions = c.decisions.map((d) => `<tr><td>${esc(d.study)}</td><td><span class="badge s-${d.kind === "failed" ? "failed" : "cancelled"}">${esc(d.kind)}</span></td><td>${esc(d.what)}</td><td class="error">${esc(d.reason)}</td></tr>`).join("");
    main.innerHTML = `<h1>Cluster</h1>${nms || `<p class="muted">no node managers registered</p>`}
      <div class="card"><h2>Recent policy decisions</h2><table id="decisions"><tr><th>study</th><th>decision</th><th>trial</th><th>reason</th></tr>
      ${decisions || `<tr><td colspan="4" class="muted">none</td></tr>`}</table></div>`;
  }
  await draw();
  return { onCounts: throttle(draw, 500), onCurves: throttle(draw, 2000) };
}
