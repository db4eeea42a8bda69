// The Stage tree page: the study's plan laid out by step. Each node is a bar over the steps it spans, on a
// row of its own (its subtree below it), joined to its parent where it branches; its colours say what
// happened to the node itself: the steps trained on it (green; blue while a batch trains it), then the
// rest in its state's colour (waiting, failed, cancelled). A large tree opens collapsed
// to a few hundred rows; search (a node, a trial, a state) opens the way to what it finds, a click opens
// a node's panel, a double click collapses or expands it, and "focus" shows one subtree alone.
import { WORDS, WORD_COLOR, alive, api, badge, esc, fmt, throttle, trialLink } from "./common.js";

const MAX_OPEN_ROWS = 300; // rows a tree opens with (deeper levels collapsed)
const LABEL_ROWS = 90; // names drawn when at most this many rows are in view
const INITIAL_WINDOW = 150; // rows in view at first

export async function renderTree(main, studyId, gen) {
  const id = encodeURIComponent(studyId);
  let [study, tree] = await Promise.all([api(`/studies/${id}`), api(`/dashboard/studies/${id}/tree`)]);
  const st = { collapsed: new Set(), focus: null, matches: new Set(), matchList: [], matchAt: -1, selected: null, opened: false };
  let nodes, kids, rows, rowOf, layoutInfo;

  main.innerHTML = `<h1>Stage tree of <a href="#/study/${id}" id="study-link">${esc(study.name)}</a></h1>
    <div class="row"><div class="card" style="flex: 3 1 760px">
      <div class="controls"><input id="tree-search" placeholder="search: node (n12), trial, state">
        <button type="button" id="search-next" title="next match">next</button><span class="muted" id="search-info"></span>
        <span class="spacer"></span><button type="button" id="expand-all">expand all</button><button type="button" id="collapse-deep">collapse deep levels</button>
        <button type="button" id="unfocus" hidden>show the whole tree</button></div>
      <div class="controls muted" id="tree-info"></div>
      <div class="controls legend">${WORDS.map((w) => `<span><i class="swatch" style="background:${WORD_COLOR[w]}"></i>${w}</span>`).join("")}
        <span>◆ checkpoint</span><span>▸ collapsed (+n below)</span><span>⇄ resumed on another number of ranks</span></div>
      <div id="focus-path" class="muted"></div>
      <div id="tree" class="tree-chart"></div></div>
    <div class="card" style="flex: 1 1 420px" id="node-info"><p class="muted">click a node (double click: collapse or expand it)</p></div></div>`;
  const el = document.getElementById("tree");
  const chart = echarts.init(el, null, { renderer: "canvas" });
  const onResize = () => { chart.resize(); draw(); };
  window.addEventListener("resize", onResize);

  function index() {
    nodes = new Map(tree.nodes.map((n) => [n.id, n]));
    kids = new Map();
    for (const n of tree.nodes) {
      const p = n.parent !== null && nodes.has(n.parent) ? n.parent : null;
      if (!kids.has(p)) kids.set(p, []);
      kids.get(p).push(n.id);
    }
    for (const list of kids.values()) list.sort((a, b) => nodes.get(a).start - nodes.get(b).start || a - b);
  }

  function depthCollapse() {
    // collapse the shallowest level that keeps the open rows under MAX_OPEN_ROWS
    st.collapsed.clear();
    if (tree.nodes.length <= MAX_OPEN_ROWS) return;
    const byDepth = [];
    const stack = (kids.get(null) || []).map((n) => [n, 0]);
    while (stack.length) {
      const [n, d] = stack.pop();
      (byDepth[d] = byDepth[d] || []).push(n);
      for (const c of kids.get(n) || []) stack.push([c, d + 1]);
    }
    let open = 0;
    for (let d = 0; d < byDepth.length; d++) {
      open += byDepth[d].length;
      const next = byDepth[d + 1] ? byDepth[d + 1].length : 0;
      // the roots' children always show (a flat plan is a long list, scrolled); deeper, rows are kept few
      if (d >= 1 && open + next > MAX_OPEN_ROWS) { for (const n of byDepth[d]) if (kids.has(n)) st.collapsed.add(n); return; }
    }
  }

  function layout() {
    // rows in depth-first order under the roots (or the focused node); a collapsed node hides its subtree
    rows = []; rowOf = new Map();
    const hidden = new Map(); // collapsed node -> {count, end, states}
    const roots = st.focus !== null && nodes.has(st.focus) ? [st.focus] : (kids.get(null) || []);
    const stack = [...roots].reverse();
    while (stack.length) {
      const n = stack.pop();
      rowOf.set(n, rows.length);
      rows.push(n);
      if (st.collapsed.has(n)) {
        const info = { count: 0, end: nodes.get(n).end, states: {} };
        const sub = [...(kids.get(n) || [])];
        while (sub.length) {
          const c = sub.pop();
          const cn = nodes.get(c);
          info.count += 1; info.end = Math.max(info.end, cn.end); info.states[cn.state] = (info.states[cn.state] || 0) + 1;
          for (const g of kids.get(c) || []) sub.push(g);
        }
        if (info.count) hidden.set(n, info);
        continue;
      }
      const cs = kids.get(n) || [];
      for (let i = cs.length - 1; i >= 0; i--) stack.push(cs[i]);
    }
    layoutInfo = { hidden };
  }

  function viewRows() {
    // the rows in view now (from the y zoom)
    const opt = chart.getOption();
    const dz = opt && opt.dataZoom ? opt.dataZoom.find((d) => d.yAxisIndex !== undefined && (Array.isArray(d.yAxisIndex) ? d.yAxisIndex.length : true)) : null;
    if (!dz || dz.startValue === undefined) return [0, rows.length - 1];
    return [Math.max(0, Math.floor(dz.startValue)), Math.min(rows.length - 1, Math.ceil(dz.endValue))];
  }

  function draw(keepZoom = true) {
    const maxEnd = Math.max(1, ...tree.nodes.map((n) => n.end));
    const byState = Object.fromEntries([...WORDS, "idle"].map((w) => [w, []]));
    const links = [], ckpts = [], marks = [], found = [], chosen = [];
    for (const n of rows) {
      const node = nodes.get(n), r = rowOf.get(n);
      const hid = layoutInfo.hidden.get(n);
      // what happened to the node itself: its trained steps, then the rest in its state's colour
      const end = Math.max(node.end, node.start + 0.3);
      const cut = Math.min(end, Math.max(node.start, node.trained));
      const rest = node.state === "running" ? "waiting" : node.state;
      if (node.state === "done") byState.done.push({ coords: [[node.start, r], [end, r]] });
      else {
        if (cut > node.start) byState[node.state === "running" ? "running" : "done"].push({ coords: [[node.start, r], [cut, r]] });
        if (end > cut) (byState[rest] || byState.idle).push({ coords: [[cut, r], [end, r]] });
      }
      if (node.parent !== null && rowOf.has(node.parent)) links.push({ coords: [[node.start, rowOf.get(node.parent)], [node.start, r]] });
      for (const c of node.checkpoints) ckpts.push([c, r]);
      if (hid) marks.push({ value: [hid.end, r], hid });
      if (st.matches.has(n)) found.push([node.start, r]);
      if (st.selected === n) chosen.push([node.start, r]);
    }
    const [a, b] = keepZoom && st.opened ? viewRows() : [0, Math.min(rows.length, INITIAL_WINDOW) - 1];
    const inView = b - a + 1;
    const px = (el.clientHeight - 60) / Math.max(1, inView);
    const width = Math.max(1, Math.min(12, px * 0.55));
    const labels = inView <= LABEL_ROWS ? rows.slice(a, b + 1).map((n) => {
      const node = nodes.get(n);
      const hid = layoutInfo.hidden.get(n);
      return { value: [node.start, rowOf.get(n)], label: `n${n}  ${node.trials} trial${node.trials === 1 ? "" : "s"}${node.rescaled ? " ⇄" : ""}${node.progress !== null && node.state === "running" ? ` ${Math.round(100 * node.progress)}%` : ""}${hid ? `  ▸ +${hid.count}` : ""}` };
    }) : [];
    const large = rows.length > 3000;
    const series = [
      { id: "links", type: "lines", coordinateSystem: "cartesian2d", polyline: false, silent: true, data: links, large, lineStyle: { color: "#b8c2cc", width: 1 }, z: 1, animation: false },
      ...Object.entries(byState).map(([w, data]) => ({ id: `s-${w}`, name: w, type: "lines", coordinateSystem: "cartesian2d", data, large, silent: true,
        lineStyle: { color: WORD_COLOR[w], width, cap: "round", opacity: 1 }, z: 2, animation: false })),
      { id: "ckpt", type: "scatter", symbol: "diamond", symbolSize: Math.max(4, Math.min(9, px * 0.8)), data: ckpts, large, silent: true, itemStyle: { color: "#1f2933" }, z: 3, animation: false },
      { id: "collapsed", type: "scatter", symbol: "triangle", symbolRotate: -90, symbolSize: Math.max(6, Math.min(12, px)), data: marks, silent: true,
        itemStyle: { color: "#52606d" }, z: 3, animation: false },
      { id: "found", type: "scatter", symbolSize: Math.max(10, Math.min(18, px * 1.5)), data: found, silent: true, itemStyle: { color: "rgba(0,0,0,0)", borderColor: "#e8590c", borderWidth: 2.5 }, z: 4, animation: false },
      { id: "chosen", type: "scatter", symbolSize: Math.max(12, Math.min(22, px * 1.8)), data: chosen, silent: true, itemStyle: { color: "rgba(0,0,0,0)", borderColor: "#1f2933", borderWidth: 2 }, z: 4, animation: false },
      { id: "labels", type: "scatter", symbolSize: 0, data: labels, silent: true, z: 5, animation: false,
        label: { show: true, position: "top", distance: Math.max(2, width / 2), formatter: (p) => p.data.label, fontSize: 11, color: "#1f2933" } },
    ];
    const zoom = [
      { id: "zx", type: "inside", xAxisIndex: 0, filterMode: "none" },
      { id: "zy", type: "inside", yAxisIndex: 0, filterMode: "none", zoomOnMouseWheel: "shift", moveOnMouseWheel: true, startValue: a, endValue: b },
      { id: "sy", type: "slider", yAxisIndex: 0, filterMode: "none", right: 4, width: 14, startValue: a, endValue: b, showDetail: false },
    ];
    chart.setOption({
      animation: false,
      grid: { left: 30, right: 36, top: 16, bottom: 36 },
      xAxis: { type: "value", name: "step", nameLocation: "middle", nameGap: 24, min: 0, max: maxEnd },
      yAxis: { type: "value", inverse: true, min: -0.7, max: Math.max(0.7, rows.length - 0.3), show: false },
      dataZoom: zoom,
      series,
    }, { replaceMerge: ["series", "dataZoom"] });
    st.opened = true;
    el.dataset.nodeCount = String(tree.nodes.length);
    el.dataset.rows = String(rows.length);
    el.dataset.ready = "1";
    const unique = tree.nodes.reduce((s, n) => s + Math.max(0, n.end - n.start), 0);
    document.getElementById("tree-info").textContent = `${tree.nodes.length} nodes (${rows.length} rows open${layoutInfo.hidden.size ? `, ${layoutInfo.hidden.size} collapsed` : ""}), `
      + `${unique} unique steps, ${tree.nodes.reduce((s, n) => s + n.checkpoints.length, 0)} checkpoints, ${tree.trials.length} trials`;
    document.getElementById("unfocus").hidden = st.focus === null;
    const fp = document.getElementById("focus-path");
    if (st.focus !== null) {
      const chain = [];
      for (let n = nodes.get(st.focus).parent; n !== null && nodes.has(n); n = nodes.get(n).parent) chain.push(n);
      fp.innerHTML = `focused on n${st.focus}${chain.length ? `, below ${chain.reverse().map((n) => `<a href="#" data-focus="${n}">n${n}</a>`).join(" › ")}` : ""}`;
    } else fp.textContent = "";
  }

  function rebuild(keepZoom = true) { layout(); draw(keepZoom); }

  function zoomTo(row, rowsInView = null) {
    const [a, b] = viewRows();
    if (rowsInView === null && row >= a && row <= b) return;
    const half = Math.floor(Math.min(rowsInView || INITIAL_WINDOW, b - a + 1) / 2);
    const start = Math.max(0, row - half);
    chart.dispatchAction({ type: "dataZoom", dataZoomId: "zy", startValue: start, endValue: start + 2 * half });
  }

  // -- interaction --------------------------------------------------------------------------------
  function nodeAt(ev) {
    const p = chart.convertFromPixel({ gridIndex: 0 }, [ev.offsetX, ev.offsetY]);
    if (!p) return null;
    const r = Math.round(p[1]);
    if (r < 0 || r >= rows.length || Math.abs(p[1] - r) > 0.5) return null;
    return rows[r];
  }
  chart.getZr().on("click", (ev) => { const n = nodeAt(ev); if (n !== null) select(n); });
  chart.getZr().on("dblclick", (ev) => { const n = nodeAt(ev); if (n !== null) toggle(n); });
  chart.on("datazoom", throttle(() => draw(true), 120));

  function toggle(n) {
    if (!kids.has(n)) return;
    if (st.collapsed.has(n)) st.collapsed.delete(n); else st.collapsed.add(n);
    rebuild();
  }

  function reveal(n) {
    // open every collapsed ancestor of n (and leave a focus that hides it)
    if (st.focus !== null) {
      let inside = false;
      for (let x = n; x !== null && nodes.has(x); x = nodes.get(x).parent) if (x === st.focus) inside = true;
      if (!inside) st.focus = null;
    }
    for (let x = nodes.get(n).parent; x !== null && nodes.has(x); x = nodes.get(x).parent) st.collapsed.delete(x);
  }

  async function select(n) {
    st.selected = n;
    draw();
    const box = document.getElementById("node-info");
    const node = nodes.get(n);
    box.innerHTML = `<h2 id="node-title">node ${n} ${badge(node.state)}</h2><p class="muted">loading…</p>`;
    const d = await api(`/dashboard/studies/${id}/tree/nodes/${n}?plan_key=${encodeURIComponent(tree.key)}`);
    if (!alive(gen) || st.selected !== n) return;
    const trained = d.state === "done" ? "trained" : `${d.trained > d.start ? `trained to step ${d.trained}` : "not trained"}${d.state === "running" ? ", training" : d.state === "waiting" ? ", waiting for the rest" : d.state === "failed" ? `, then its work failed (see its trials)` : d.state === "cancelled" ? ", the rest cancelled" : ""}`;
    const evals = Object.entries(d.evals).map(([s, m]) => `<div>@${s}: ${Object.entries(m).map(([k, v]) => `${esc(k)} ${fmt(v)}`).join(", ")}</div>`).join("");
    const rowsHtml = d.trials.map((t) => `<tr data-trial="${esc(t.key)}"><td>${trialLink(studyId, t.key)}</td><td>${badge(t.state)}</td>
      <td>${t.until}${t.ends_here ? "" : " →"}</td><td>${Object.entries(t.metrics).map(([k, v]) => `${esc(k)} ${fmt(v)}`).join(", ")}${t.error ? `<div class="error">${esc(t.error)}</div>` : ""}</td></tr>`).join("");
    box.innerHTML = `<h2 id="node-title">node ${n} ${badge(d.state)}</h2>
      <p>steps ${d.start} → ${d.end}: <b>${trained}</b>${d.progress !== null && d.state === "running" ? ` (${Math.round(100 * d.progress)}% of it)` : ""};
        ${d.parent !== null ? `branches from <a href="#" data-select="${d.parent}">node ${d.parent}</a> at step ${d.start}` : "the root"}${d.children.length ? `; ${d.children.length} children` : ""}</p>
      <div class="controls">${kids.has(n) ? `<button type="button" data-toggle="${n}">${st.collapsed.has(n) ? "expand" : "collapse"}</button>` : ""}
        <button type="button" data-focus="${n}">focus on this subtree</button></div>
      <p class="sched">${esc(d.schedule)} <span class="muted">(on steps ${d.start}–${d.end})</span></p>
      <p>checkpoints at ${d.checkpoints.join(", ") || "–"}; ${d.curve_points} curve points</p>
      ${evals ? `<div><b>evaluations</b>${evals}</div>` : ""}
      ${d.path_changes.map((c) => `<p class="path-change">⇄ at step ${c.step}: batch ${c.batch_id} resumed a checkpoint of ${c.from_ranks} rank(s) on ${c.to_ranks} (${esc(c.node_manager)}); from here the run is valid but not the bit-exact one</p>`).join("")}
      <h2>${d.trial_count} trial${d.trial_count === 1 ? "" : "s"} pass${d.trial_count === 1 ? "es" : ""} through it</h2>
      <p class="muted">each trial's own state; "→" when it trains on past this node's end below it</p>
      <div class="scroll"><table id="node-trials"><tr><th>trial</th><th>state</th><th>trains here to</th><th>metrics</th></tr>${rowsHtml}</table></div>
      ${d.trial_count > d.trials.length ? `<p class="muted">the first ${d.trials.length} of ${d.trial_count}</p>` : ""}`;
  }
  main.addEventListener("click", (e) => {
    const a = e.target.closest("[data-focus],[data-toggle],[data-select]");
    if (!a) return;
    e.preventDefault();
    if (a.dataset.focus) { st.focus = Number(a.dataset.focus); st.collapsed.delete(st.focus); rebuild(false); }
    else if (a.dataset.toggle) { toggle(Number(a.dataset.toggle)); select(Number(a.dataset.toggle)); }
    else if (a.dataset.select) { const n = Number(a.dataset.select); reveal(n); rebuild(); zoomTo(rowOf.get(n)); select(n); }
  });
  document.getElementById("unfocus").addEventListener("click", () => { st.focus = null; rebuild(false); });
  document.getElementById("expand-all").addEventListener("click", () => { st.collapsed.clear(); rebuild(); });
  document.getElementById("collapse-deep").addEventListener("click", () => { depthCollapse(); rebuild(false); });

  function search(text) {
    const q = text.trim().toLowerCase();
    st.matches = new Set();
    if (q) {
      const m = q.match(/^n?(\d+)$/);
      if (m && nodes.has(Number(m[1]))) st.matches.add(Number(m[1]));
      if (WORDS.includes(q) || q === "idle") for (const n of tree.nodes) if (n.state === q) st.matches.add(n.id);
      for (const t of tree.trials) if (t.key.toLowerCase() === q || (!m && t.key.toLowerCase().includes(q))) st.matches.add(t.node);
    }
    st.matchList = [...st.matches].sort((a, b) => a - b);
    st.matchAt = -1;
    for (const n of st.matchList.slice(0, 200)) reveal(n);
    rebuild();
    document.getElementById("search-info").textContent = q ? `${st.matchList.length} match${st.matchList.length === 1 ? "" : "es"}` : "";
    el.dataset.matches = String(st.matchList.length);
    next();
  }
  function next() {
    if (!st.matchList.length) return;
    st.matchAt = (st.matchAt + 1) % st.matchList.length;
    const n = st.matchList[st.matchAt];
    reveal(n);
    if (!rowOf.has(n)) rebuild();
    zoomTo(rowOf.get(n), Math.min(LABEL_ROWS / 2, rows.length)); // near enough to read its neighbours' names
    select(n);
  }
  document.getElementById("tree-search").addEventListener("change", (e) => search(e.target.value));
  document.getElementById("search-next").addEventListener("click", next);

  index();
  depthCollapse();
  rebuild(false);

  const refresh = throttle(async () => {
    const got = await api(`/dashboard/studies/${id}/tree`);
    if (!alive(gen)) return;
    const before = nodes.size;
    tree = got;
    index();
    if (tree.nodes.length > MAX_OPEN_ROWS && before <= MAX_OPEN_ROWS) depthCollapse();
    rebuild();
    if (st.selected !== null && nodes.has(st.selected)) select(st.selected);
  }, 1000);
  return { study: studyId, onCounts: refresh, stop: () => { window.removeEventListener("resize", onResize); chart.dispose(); } };
}
