// The dashboard's shell: sign-in (the token lives in sessionStorage), the hash router, the API helper,
// and the live channel (server-sent events read with fetch, so the token stays in a header; polling
// when the stream is down). Pages are modules exporting render(main, params) -> {onCounts, onCurves, stop}.
import { renderStudies, renderCluster } from "./pages.js";
import { renderStudy } from "./study.js";
import { renderTree } from "./tree.js";

const TOKEN_KEY = "stagetree.token";
const main = document.getElementById("main");
let page = null; // the current page's handlers
let generation = 0; // bumped by each route(): a page rendered for an older one is dropped

// A page's guard: false once the user has left it, so a late refresh never draws over the next page.
export function alive(gen) { return gen === generation; }

export function token() { return sessionStorage.getItem(TOKEN_KEY); }

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

export async function api(path) {
  const r = await fetch(`/api/v1${path}`, { headers: { authorization: `Bearer ${token()}` } });
  if (r.status === 401) { signOut("That token was not accepted: sign in again."); throw new ApiError(401, "unauthenticated"); }
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new ApiError(r.status, body.message || r.statusText);
  return body;
}

export function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

export function fmt(v, digits = 4) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return esc(v);
  if (Number.isInteger(v)) return String(v);
  return Math.abs(v) >= 1e4 || Math.abs(v) < 1e-3 ? v.toExponential(2) : v.toFixed(digits);
}

export function throttle(fn, ms) {
  let timer = null, again = false;
  const run = async () => {
    timer = setTimeout(async () => { timer = null; if (again) { again = false; run(); } }, ms);
    try { await fn(); } catch (e) { console.warn(e); }
  };
  return () => { if (timer) again = true; else run(); };
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  location.hash = "#/signin";
  if (message) sessionStorage.setItem("stagetree.signin-message", message);
}

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
    sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value.trim());
    try { await api("/dashboard/studies"); location.hash = "#/"; }
    catch (err) { if (err.status !== 401) document.getElementById("signin-error").textContent = err.message; }
  });
  return null;
}

async function route() {
  if (page && page.stop) page.stop();
  page = null;
  const gen = ++generation;
  const hash = location.hash || "#/";
  const m = hash.match(/^#token=(.+)$/); // the sign-in URL `stagetree up` prints
  if (m) { sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1])); history.replaceState(null, "", "#/"); return route(); }
  document.getElementById("signout").style.display = token() ? "" : "none";
  if (!token() || hash === "#/signin") { page = renderSignIn(); return; }
  const parts = hash.slice(2).split("/").map(decodeURIComponent);
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.dataset.nav === (parts[0] || "studies"));
  main.innerHTML = `<p class="muted">loading…</p>`;
  try {
    let got;
    if (parts[0] === "study" && parts[1]) got = await renderStudy(main, parts[1], gen);
    else if (parts[0] === "tree" && parts[1]) got = await renderTree(main, parts[1], gen);
    else if (parts[0] === "cluster") got = await renderCluster(main, gen);
    else got = await renderStudies(main, gen);
    if (gen !== generation) { if (got && got.stop) got.stop(); return; }
    page = got;
  } catch (err) {
    if (gen !== generation) return;
    if (err.status === 404) main.innerHTML = `<div class="card" id="not-found"><h1>Not found</h1><p>${esc(err.message)}</p><p><a href="#/">All studies</a></p></div>`;
    else if (err.status !== 401) main.innerHTML = `<div class="card err" id="page-error">${esc(err.message)}</div>`;
  }
}

// -- live updates ---------------------------------------------------------------------------------
const live = { mode: "connecting", poll: null };

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

async function stream() {
  for (;;) {
    if (!token()) { await new Promise((r) => setTimeout(r, 500)); continue; }
    try {
      const r = await fetch("/api/v1/dashboard/events", { headers: { authorization: `Bearer ${token()}` } });
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
          if (ev) dispatch(ev.slice(7).trim());
        }
      }
    } catch (e) {
      console.warn("live stream down; polling", e);
    }
    setLive("polling");
    if (!live.poll) live.poll = setInterval(() => { dispatch("counts"); dispatch("curves"); }, 2000);
    await new Promise((r) => setTimeout(r, 3000));
  }
}

document.getElementById("signout").addEventListener("click", () => signOut(""));
window.addEventListener("hashchange", route);
route();
stream();
