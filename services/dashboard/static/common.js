// What every page shares: the token and the API helper, the one table of state words and colours,
// formatting, scales that ignore outliers, and exports.
const TOKEN_KEY = "stagetree.token";
let generation = 0; // bumped by each route(): a page rendered for an older one is dropped

export function nextGeneration() { return ++generation; }
// A page's guard: false once the user has left it, so a late refresh never draws over the next page.
export function alive(gen) { return gen === generation; }

export function token() { return sessionStorage.getItem(TOKEN_KEY); }
export function setToken(t) { sessionStorage.setItem(TOKEN_KEY, t); }
export function clearToken() { sessionStorage.removeItem(TOKEN_KEY); }

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

let onUnauthenticated = () => {};
export function whenUnauthenticated(fn) { onUnauthenticated = fn; }

export async function api(path, { method = "GET" } = {}) {
  const r = await fetch(`/api/v1${path}`, { method, headers: { authorization: `Bearer ${token()}` } });
  if (r.status === 401) { onUnauthenticated("That token was not accepted: sign in again."); throw new ApiError(401, "unauthenticated"); }
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new ApiError(r.status, body.message || r.statusText);
  return body;
}

// Every state a page shows, in one set of words: a request's state names map onto them.
export const STATE_WORD = { NOT_SCHED: "waiting", SCHED: "running", DONE: "done", FAILED: "failed", CANCELLED: "cancelled" };
export const WORD_COLOR = { waiting: "#9aa5b1", running: "#2f6fde", done: "#2fa36b", failed: "#d64545", cancelled: "#c69026", idle: "#cbd2d9", empty: "#cbd2d9" };
export const WORDS = ["waiting", "running", "done", "failed", "cancelled"];
export function word(state) { return STATE_WORD[state] || state; }
export function badge(state, extra = "") {
  const w = word(state);
  return `<span class="badge s-${esc(w)}" data-state="${esc(state)}">${esc(w)}${extra}</span>`;
}
// counts by state (request state names or words) as badges: "done 3 failed 1"
export function countBadges(c, what = "") {
  const byWord = {};
  for (const [k, n] of Object.entries(c || {})) if (n) byWord[word(k)] = (byWord[word(k)] || 0) + n;
  const names = Object.fromEntries(Object.entries(STATE_WORD).map(([k, v]) => [v, k]));
  const out = WORDS.filter((w) => byWord[w]).map((w) => `<span class="badge s-${w}" data-state="${names[w]}" title="${what} ${w}">${w} ${byWord[w]}</span>`).join("");
  return out || `<span class="muted">none</span>`;
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

// an axis tick: at most four significant digits, no trailing zeros
export function tick(v) {
  if (!Number.isFinite(v)) return String(v);
  if (v === 0) return "0";
  return Math.abs(v) >= 1e5 || Math.abs(v) < 1e-3 ? v.toExponential(1) : String(Number(v.toPrecision(4)));
}

export function when(ts) {
  if (!ts) return "–";
  const d = new Date(ts * 1000);
  const p = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

export function duration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${String(Math.round(s % 60)).padStart(2, "0")} s`;
  return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
}

export function throttle(fn, ms) {
  let timer = null, again = false;
  const run = async () => {
    timer = setTimeout(async () => { timer = null; if (again) { again = false; run(); } }, ms);
    try { await fn(); } catch (e) { console.warn(e); }
  };
  return () => { if (timer) again = true; else run(); };
}

export function trialHref(studyId, t) {
  const sid = encodeURIComponent(studyId);
  return t.label ? `#/trial/${sid}/label/${encodeURIComponent(t.label)}` : `#/trial/${sid}/request/${t.request_id}`;
}
// a trial's key (its label, or #<request id>) as a link
export function trialLink(studyId, key) {
  const t = key.startsWith("#") && /^#\d+$/.test(key) ? { label: "", request_id: key.slice(1) } : { label: key };
  return `<a href="${trialHref(studyId, t)}">${esc(key)}</a>`;
}

// The y range that a few diverged points cannot flatten: the 2nd to 98th percentile, widened by a
// fifth, and the true extremes where they are not far outside it.
export function robustRange(values, log = false) {
  const v = values.filter((x) => Number.isFinite(x) && (!log || x > 0)).sort((a, b) => a - b);
  if (v.length < 20) return null; // too few to call any of them an outlier
  const q = (p) => v[Math.min(v.length - 1, Math.max(0, Math.round(p * (v.length - 1))))];
  const [min, max] = [v[0], v[v.length - 1]];
  if (log) {
    const [lo, hi] = [Math.log10(q(0.02)), Math.log10(q(0.98))];
    const pad = Math.max(0.05, (hi - lo) * 0.2);
    return { min: Math.max(min, 10 ** (lo - pad)), max: Math.min(max, 10 ** (hi + pad)), clipped: min < 10 ** (lo - pad) || max > 10 ** (hi + pad) };
  }
  const [lo, hi] = [q(0.02), q(0.98)];
  const pad = (hi - lo) * 0.2 || Math.abs(hi) * 0.05 || 1;
  const out = { min: Math.max(min, lo - pad), max: Math.min(max, hi + pad) };
  out.clipped = min < out.min || max > out.max;
  return out;
}

export function download(name, mime, text) {
  const url = URL.createObjectURL(new Blob([text], { type: mime }));
  const a = document.createElement("a");
  a.href = url; a.download = name; document.body.appendChild(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

export function csv(header, rows) {
  const cell = (x) => {
    const s = x === null || x === undefined ? "" : typeof x === "object" ? JSON.stringify(x) : String(x);
    return /[",\n]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s;
  };
  return [header, ...rows].map((r) => r.map(cell).join(",")).join("\n") + "\n";
}

// A batch attempt's worker log as GET .../batches/{b}/log answers it: the end of its file where this master
// reads the node manager's files (the embedded mode), else where the file is; and in every mode the
// lines its trainer logged (self.log_text), which the master keeps.
export function workerLogHtml(got) {
  const files = got.readable
    ? got.files.map((f) => `<h3>${esc(f.path)}${f.truncated ? ` <span class="muted">(its last ${f.text.length} characters of ${f.bytes} bytes)</span>` : ""}</h3><pre id="worker-log">${esc(f.text || f.error)}</pre>`).join("")
    : `<p id="worker-log-where">batch ${got.batch_id} attempt ${got.attempt}: the worker's log is ${esc(got.where)}</p>`;
  const n = (got.lines || []).length;
  const lines = n ? `<h3>what its trainer logged <span class="muted">(${n} line${n === 1 ? "" : "s"}, at their steps)</span></h3>
    <pre id="trainer-lines">${esc(got.lines.map((l) => `[step ${l.step}] ${l.line}`).join("\n"))}</pre>` : "";
  return files + lines;
}

// A metric's name with where it comes from, so a training loss and an evaluation loss never look alike.
export function metricLabel(name, kind) { return kind === "eval" ? `${name} (eval)` : `${name} (train)`; }

export const PALETTE = ["#2f6fde", "#e8590c", "#2fa36b", "#9c36b5", "#d6336c", "#0b7285", "#f59f00", "#5c940d", "#364fc7", "#a61e4d",
  "#087f5b", "#862e9c", "#c92a2a", "#1864ab", "#e67700", "#2b8a3e"];
