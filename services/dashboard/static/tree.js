// The Stage tree page: the study's plan drawn as a tree (ECharts tree series), nodes sized by their
// steps and colored by state, checkpoints marked, a node where training resumed a checkpoint on another
// number of ranks (a path change) marked ⇄; a click shows the node's trials, metrics and path changes.
import { alive, api, esc, fmt, throttle } from "./app.js";

const COLOR = { pending: "#9aa5b1", running: "#2f6fde", done: "#2fa36b", failed: "#d64545", cancelled: "#c69026" };

export async function renderTree(main, studyId, gen) {
  const id = encodeURIComponent(studyId);
  const study = await api(`/dashboard/studies/${id}`);
  let tree = await api(`/dashboard/studies/${id}/tree`);
  let selected = null;
  main.innerHTML = `<h1>Stage tree of <a href="#/study/${id}" id="study-link">${esc(study.study.name)}</a></h1>
    <div class="row"><div class="card" style="flex: 3 1 700px"><div class="controls muted" id="tree-info"></div>
      <div class="controls">${Object.entries(COLOR).map(([k, c]) => `<span><span class="badge" style="background:${c}">${k}</span></span>`).join("")}
      <span>◆ checkpoint</span><span>⇄ resumed on another number of ranks</span></div><div id="tree" class="tree-chart"></div></div>
    <div class="card" style="flex: 1 1 420px" id="node-info"><p class="muted">click a node</p></div></div>`;
  const chart = echarts.init(document.getElementById("tree"), null, { renderer: "canvas" });
  const onResize = () => chart.resize();
  window.addEventListener("resize", onResize);
  const trials = new Map(study.trials.map((t) => [t.request_id, t]));

  function build() {
    const nodes = tree.nodes;
    const maxSteps = Math.max(1, ...nodes.map((n) => n.steps));
    const many = nodes.length > 150;
    const items = new Map(nodes.map((n) => [n.id, {
      name: `n${n.id}`,
      value: n.steps,
      nodeId: n.id,
      progress: n.progress,
      symbol: n.checkpoints.length ? "diamond" : "circle",
      symbolSize: 6 + 18 * Math.sqrt(n.steps / maxSteps),
      itemStyle: { color: COLOR[n.state] || COLOR.pending, borderColor: n.checkpoints.length ? "#1f2933" : "#fff", borderWidth: n.checkpoints.length ? 2 : 1 },
      rescaled: n.path_changes.length > 0,
      label: { show: !many, formatter: `n${n.id} [${n.start}, ${n.end}]${n.path_changes.length ? " ⇄" : ""}${n.progress !== null ? ` ${Math.round(100 * n.progress)}%` : ""}` },
      children: [],
    }]));
    const roots = [];
    for (const n of nodes) (n.parent !== null && items.has(n.parent) ? items.get(n.parent).children : roots).push(items.get(n.id));
    const data = roots.length === 1 ? roots[0] : { name: "plan", children: roots, symbolSize: 4, itemStyle: { color: "#7b8794" } };
    const el = document.getElementById("tree");
    el.dataset.nodeCount = String(nodes.length);
    document.getElementById("tree-info").textContent = `${nodes.length} nodes, ${nodes.reduce((a, n) => a + n.steps, 0)} unique steps, `
      + `${nodes.reduce((a, n) => a + n.checkpoints.length, 0)} checkpoints`;
    chart.setOption({
      animation: false,
      tooltip: { trigger: "item", formatter: (p) => p.data.nodeId ? `node ${p.data.nodeId}: ${p.data.value} steps${p.data.rescaled ? ", path changed (⇄)" : ""}${p.data.progress !== null ? `, running: ${Math.round(100 * p.data.progress)}%` : ""}` : "plan" },
      series: [{ type: "tree", data: [data], orient: "LR", top: 20, bottom: 20, left: 40, right: 160,
        initialTreeDepth: -1, expandAndCollapse: false, roam: true, animation: false,
        lineStyle: { width: 1.2, curveness: 0.4 }, label: { position: "top", fontSize: 11 },
        leaves: { label: { position: "right" } } }],
    }, { notMerge: true });
    el.dataset.ready = "1";
    if (selected !== null) info(selected);
  }

  function info(nodeId) {
    const n = tree.nodes.find((x) => x.id === nodeId);
    if (!n) return;
    selected = nodeId;
    const rows = n.trials.slice(0, 200).map((rid) => {
      const t = trials.get(rid);
      if (!t) return "";
      const ms = Object.entries(t.metrics).map(([k, v]) => `${esc(k)} ${fmt(v)}`).join(", ");
      return `<tr data-request="${rid}"><td>${rid}</td><td>${esc(t.label)}</td><td><span class="badge s-${t.state}">${t.state}</span></td><td>${t.step}</td><td>${ms}${t.error ? `<div class="error">${esc(t.error.split("\n")[0])}</div>` : ""}</td></tr>`;
    }).join("");
    document.getElementById("node-info").innerHTML = `<h2 id="node-title">node ${n.id} <span class="badge s-${n.state}">${n.state}</span></h2>
      ${n.progress !== null ? `<p>running: <span class="progress"><i style="width:${Math.round(100 * n.progress)}%"></i></span> ${Math.round(100 * n.progress)}%</p>` : ""}
      <p>steps ${n.start} → ${n.end} (${n.steps})${n.parent !== null ? `, branches from node ${n.parent} at step ${n.start}` : ", the root"}</p>
      <p class="sched muted">${esc(n.schedule)}</p>
      <p>checkpoints at ${n.checkpoints.join(", ") || "–"}; evaluations at ${n.metric_steps.join(", ") || "–"}; ${n.curve_points} curve points</p>
      ${n.path_changes.map((c) => `<p class="path-change">⇄ at step ${c.step}: batch ${c.batch_id} resumed a checkpoint of ${c.from_ranks} rank(s) on ${c.to_ranks} (${esc(c.node_manager)}); from here the run is valid but not the bit-exact one</p>`).join("")}
      <h2>${n.trials.length} trials share it</h2><div class="scroll"><table id="node-trials"><tr><th>request</th><th>trial</th><th>state</th><th>step</th><th>metrics</th></tr>${rows}</table></div>`;
  }

  chart.on("click", (e) => { if (e.data && e.data.nodeId) info(e.data.nodeId); });
  build();
  const refresh = throttle(async () => {
    const [s, t] = await Promise.all([api(`/dashboard/studies/${id}`), api(`/dashboard/studies/${id}/tree`)]);
    if (!alive(gen)) return;
    for (const x of s.trials) trials.set(x.request_id, x);
    tree = t;
    build();
  }, 500);
  return { onCounts: refresh, stop: () => { window.removeEventListener("resize", onResize); chart.dispose(); } };
}
