// The dashboard's shell: sign-in (the token lives in sessionStorage), the hash router and the live
// channel (server-sent events read with fetch, so the token stays in a header; polling when the stream
// is down). Pages are modules exporting render(main, ..., gen) -> {study, onCounts, onCurves, stop}; a
// page with a `study` hears only that study's events (the stream is opened with ?study=).
import { alive, api, clearToken, esc, nextGeneration, setToken, token, whenUnauthenticated } from "./common.js";
import { renderStudies } from "./studies.js";
import { renderStudy } from "./study.js";
import { renderTrial } from "./trial.js";
import { renderTree } from "./tree.js";
import { renderCluster } from "./cluster.js";

const main = document.getElementById("main");
let page = null; // the current page's handlers
let gen = 0;

function signOut(message) {
  clearToken();
  location.hash = "#/signin";
  if (message) sessionStorage.setItem("stagetree.signin-message", message);
}
whenUnauthenticated(signOut);

function renderSignIn() {
  const msg = sessionStorage.getItem("stagetree.signin-message") || "";
  sessionStorage.removeItem("stagetree.signin-message");
  main.innerHTML = `<div class="card signin"><h1>Sign in</h1>
    <p class="muted">Paste a token of the master (the one <code>stagetree up</code> printed, or your
    <code>STAGETREE_TOKEN</code>). It stays in this browser tab only.</p>
    <form id="signin-form"><input id="token" type="password" autocomplete="off" placeholder="token" required>
    <button type="submit">Sign in</button></form><p class="err" id="signin-error">${esc(msg)}</p></div>`;
  document.getElementById("signin-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    setToken(document.getElementById("token").value.trim());
    try { await api("/dashboard/studies"); location.hash = "#/"; }
    catch (err) { if (err.status !== 401) document.getElementById("signin-error").textContent = err.message; }
  });
  return null;
}

async function route() {
  if (page && page.stop) page.stop();
  page = null;
  gen = nextGeneration();
  const mine = gen;
  const hash = location.hash || "#/";
  const m = hash.match(/^#token=(.+)$/); // the sign-in URL `stagetree up` prints
  if (m) { setToken(decodeURIComponent(m[1])); history.replaceState(null, "", "#/"); return route(); }
  document.getElementById("signout").style.display = token() ? "" : "none";
  if (!token() || hash === "#/signin") { page = renderSignIn(); rescope(); return; }
  const parts = hash.slice(2).split("/").map(decodeURIComponent);
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.dataset.nav === (parts[0] === "cluster" ? "cluster" : "studies"));
  main.innerHTML = `<p class="muted">loading…</p>`;
  try {
    let got;
    if (parts[0] === "study" && parts[1]) got = await renderStudy(main, parts[1], mine);
    else if (parts[0] === "trial" && parts[1] && parts[3] !== undefined) got = await renderTrial(main, parts[1], parts[2], parts.slice(3).join("/"), mine);
    else if (parts[0] === "tree" && parts[1]) got = await renderTree(main, parts[1], mine);
    else if (parts[0] === "cluster") got = await renderCluster(main, mine);
    else got = await renderStudies(main, mine);
    if (!alive(mine)) { if (got && got.stop) got.stop(); return; }
    page = got;
    rescope();
  } catch (err) {
    if (!alive(mine)) return;
    if (err.status === 404) main.innerHTML = `<div class="card" id="not-found"><h1>Not found</h1><p>${esc(err.message)}</p><p><a href="#/">All studies</a></p></div>`;
    else if (err.status !== 401) { console.error(err); main.innerHTML = `<div class="card err" id="page-error">${esc(err.message)}</div>`; }
  }
}

// -- live updates ---------------------------------------------------------------------------------
const live = { mode: "connecting", poll: null, scope: undefined, abort: null, wake: null };

function setLive(mode) {
  live.mode = mode;
  document.getElementById("live-mode").textContent = mode;
  document.getElementById("live").classList.toggle("on", mode === "live");
}

function dispatch(kind) {
  if (!page) return;
  if (kind === "counts" && page.onCounts) page.onCounts();
  if (kind === "curves" && page.onCurves) page.onCurves();
}

// the stream follows the page: a study's page reopens it for that study alone
function rescope() {
  const scope = (page && page.study) || null;
  if (scope === live.scope) return;
  live.scope = scope;
  if (live.abort) live.abort.abort();
  if (live.wake) live.wake();
}

async function stream() {
  for (;;) {
    if (!token() || live.scope === undefined) { await new Promise((r) => setTimeout(r, 200)); continue; }
    const scope = live.scope;
    live.abort = new AbortController();
    try {
      // the page's curves were read before the stream opened: `since` asks for what came in between
      const since = scope && page && page.since ? page.since() : null;
      const q = scope ? `?study=${encodeURIComponent(scope)}${since ? `&since=${since}` : ""}` : "";
      const r = await fetch(`/api/v1/dashboard/events${q}`, { headers: { authorization: `Bearer ${token()}` }, signal: live.abort.signal });
      if (!r.ok || !r.body) throw new Error(`events: ${r.status}`);
      setLive("live");
      if (live.poll) { clearInterval(live.poll); live.poll = null; }
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const ev = block.split("\n").find((l) => l.startsWith("event: "));
          if (ev && scope === live.scope) dispatch(ev.slice(7).trim());
        }
      }
    } catch (e) {
      if (scope !== live.scope) continue; // reopened for another page: not a failure
      console.warn("live stream down; polling", e);
    }
    if (scope !== live.scope) continue;
    setLive("polling");
    if (!live.poll) live.poll = setInterval(() => { dispatch("counts"); dispatch("curves"); }, 2000);
    await new Promise((r) => { live.wake = r; setTimeout(r, 3000); });
  }
}

document.getElementById("signout").addEventListener("click", () => signOut(""));
window.addEventListener("hashchange", route);
route();
stream();
