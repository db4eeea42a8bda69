// The Studies page: every study with its state, when it was created, how long it ran, its trials by
// state, best trial, merge rate and compute saved; searchable, sortable, and a study can be deleted.
import { alive, api, badge, countBadges, duration, esc, fmt, throttle, trialLink, when } from "./common.js";

const COLUMNS = [
  ["name", "study"], ["state", "state"], ["created_at", "created"], ["duration_s", "duration"], ["trials", "trials"],
  ["best", "best"], ["merge_rate", "merge rate"], ["saved_seconds", "compute saved"],
];

export function bestText(studyId, b) {
  if (!b) return `<span class="muted">–</span>`;
  return `${esc(b.metric)} (eval) <b>${fmt(b.value)}</b> <span class="muted">${b.mode}, ${trialLink(studyId, b.trial)} @${b.step}</span>`;
}

export async function renderStudies(main, gen) {
  const state = { q: "", sort: "created_at", asc: false, studies: [] };
  main.innerHTML = `<h1>Studies</h1><div class="card"><div class="controls">
      <input id="study-search" placeholder="search: name, id, state" value="">
      <span class="muted" id="study-info"></span></div>
    <table id="studies-table"></table></div>`;
  const table = document.getElementById("studies-table");

  function draw() {
    const q = state.q.toLowerCase();
    let rows = state.studies.filter((s) => !q || `${s.name} ${s.id} ${s.state} ${s.owner}`.toLowerCase().includes(q));
    const val = (s) => (state.sort === "best" ? (s.best ? s.best.value : null) : s[state.sort]);
    rows = rows.sort((a, b) => {
      const x = val(a), y = val(b);
      if (x === y) return 0;
      if (x === null || x === undefined) return 1;
      if (y === null || y === undefined) return -1;
      return (x < y ? -1 : 1) * (state.asc ? 1 : -1);
    });
    document.getElementById("study-info").textContent = `${rows.length} of ${state.studies.length} studies`;
    const head = COLUMNS.map(([k, t]) => `<th data-key="${k}" class="${state.sort === k ? "sorted" + (state.asc ? " asc" : "") : ""}">${t}</th>`).join("");
    const body = rows.map((s) => {
      const sid = encodeURIComponent(s.id);
      return `<tr data-study="${esc(s.id)}" class="clickable" data-href="#/study/${sid}">
      <td><a href="#/study/${sid}">${esc(s.name)}</a><br><span class="muted">${esc(s.id)}</span></td>
      <td>${badge(s.state)}</td><td>${when(s.created_at)}</td><td>${duration(s.duration_s)}</td>
      <td class="counts"><b>${s.trials}</b> ${countBadges(s.trial_counts, "trials")}</td><td>${bestText(s.id, s.best)}</td>
      <td>${fmt(s.merge_rate, 2)}</td><td>${s.saved_steps} steps<br><span class="muted">${fmt(s.saved_seconds, 1)} s</span></td>
      <td class="actions"><a href="#/tree/${sid}">stage tree</a>
        <button type="button" class="danger" data-delete="${esc(s.id)}" title="cancel its live requests and delete it">delete</button></td></tr>`;
    }).join("");
    table.innerHTML = `<thead><tr>${head}<th></th></tr></thead><tbody>${body ||
      `<tr><td colspan="9" class="muted">${state.studies.length ? "no study matches" : "no studies yet: create one with the SDK"}</td></tr>`}</tbody>`;
  }

  async function load() {
    const got = await api("/dashboard/studies");
    if (!alive(gen)) return;
    state.studies = got;
    draw();
  }

  table.addEventListener("click", async (e) => {
    const th = e.target.closest("th[data-key]");
    if (th) {
      if (state.sort === th.dataset.key) state.asc = !state.asc; else { state.sort = th.dataset.key; state.asc = th.dataset.key === "name"; }
      draw();
      return;
    }
    const del = e.target.closest("button[data-delete]");
    if (del) {
      const s = state.studies.find((x) => x.id === del.dataset.delete);
      if (!s || !confirm(`Delete study "${s.name}"? Its live requests are cancelled and its requests deleted; its plans stay.`)) return;
      del.disabled = true;
      try { await api(`/studies/${encodeURIComponent(s.id)}`, { method: "DELETE" }); await load(); }
      catch (err) { alert(`not deleted: ${err.message}`); del.disabled = false; }
      return;
    }
    const tr = e.target.closest("tr[data-href]");
    if (tr && !e.target.closest("a,button")) location.hash = tr.dataset.href;
  });
  document.getElementById("study-search").addEventListener("input", (e) => { state.q = e.target.value; draw(); });
  await load();
  return { onCounts: throttle(load, 300) };
}
