"""The live view's page (``GET /dashboard``): one self-contained HTML document.

Inline CSS and JS, sparklines drawn as SVG by hand; nothing loaded from elsewhere. Every value
from the state goes into the DOM as text (``textContent``), never as markup: model names and
session ids come from clients. It polls ``/dashboard/state`` every ``REFRESH_MS`` and keeps the
last ``HISTORY`` refreshes of the prefix counters for the sparklines.
"""

from __future__ import annotations

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Mesh · live view</title>
<style>
:root{--bg:#0f1419;--panel:#182029;--line:#2a3642;--text:#dce3ea;--dim:#8a99a8;--ok:#3fb950;--warn:#d29922;
--bad:#f85149;--info:#58a6ff;--pred:#bc8cff}
*{box-sizing:border-box}body{margin:0;background:var(--bg);color:var(--text);font:13px/1.45 system-ui,sans-serif}
header{display:flex;align-items:center;gap:14px;padding:10px 18px;border-bottom:1px solid var(--line);background:var(--panel)}
h1{font-size:16px;margin:0}h2{font-size:13px;margin:0 0 8px;color:var(--dim);text-transform:uppercase;letter-spacing:.06em}
main{display:grid;grid-template-columns:minmax(0,3fr) minmax(0,2fr);gap:14px;padding:14px 18px}
@media (max-width:1100px){main{grid-template-columns:minmax(0,1fr)}}
section{background:var(--panel);border:1px solid var(--line);border-radius:6px;padding:12px 14px;min-width:0;overflow-x:auto}
section.wide{grid-column:1/-1}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:4px 8px;border-bottom:1px solid var(--line);
white-space:nowrap}th{color:var(--dim);font-weight:500}td.r,th.r{text-align:right}td.reason{white-space:normal;color:var(--dim)}
.pill{display:inline-block;padding:0 7px;border-radius:9px;font-size:12px;border:1px solid currentColor}
.ok{color:var(--ok)}.pred{color:var(--pred)}.warn{color:var(--warn)}.bad{color:var(--bad)}.info{color:var(--info)}.dim{color:var(--dim)}
.bar{position:relative;display:inline-block;width:110px;height:10px;background:#0b0f13;border:1px solid var(--line);
border-radius:3px;vertical-align:middle;margin-right:6px}.bar i{position:absolute;left:0;top:0;bottom:0;background:var(--info)}
.bar i.hot{background:var(--warn)}.bar i.full{background:var(--bad)}
.cards{display:flex;gap:10px;flex-wrap:wrap}.card{flex:1;min-width:110px;background:#0b0f13;border:1px solid var(--line);
border-radius:5px;padding:8px 10px}.card b{display:block;font-size:20px}.card span{color:var(--dim);font-size:12px}
#status{margin-left:auto}#keyform{display:none;gap:8px;align-items:center}#keyform input{background:#0b0f13;color:var(--text);
border:1px solid var(--line);border-radius:4px;padding:4px 8px}#keyform button{background:var(--info);border:0;border-radius:4px;
padding:5px 10px;color:#04111f;font-weight:600;cursor:pointer}#notice{display:none;margin:14px 18px;padding:12px 14px;
border:1px solid var(--warn);border-radius:6px;color:var(--warn);background:#21190a}#notice code{color:var(--text)}
svg.spark{vertical-align:middle}.legend i{display:inline-block;width:10px;height:3px;margin:0 4px 2px 10px;vertical-align:middle}
</style></head>
<body>
<header><h1>Mesh · live view</h1><span id="policy" class="dim"></span>
<form id="keyform"><label for="key">admin key</label><input id="key" type="password" autocomplete="off">
<button type="submit">Connect</button></form>
<span id="status" class="dim">connecting…</span></header>
<div id="notice"></div>
<main>
<section class="wide"><div class="cards">
<div class="card"><b id="c-workers">–</b><span>workers healthy</span></div>
<div class="card"><b id="c-inflight">–</b><span>requests in flight</span></div>
<div class="card"><b id="sessions-live">–</b><span>sessions bound</span></div>
<div class="card"><b id="c-hit">–</b><span>hit rate reported / predicted</span></div>
<div class="card"><b id="c-index">–</b><span>index keys</span></div>
<div class="card"><b id="c-waiting">–</b><span>waiting for a slot</span></div>
</div></section>
<section class="wide"><h2>Workers and targets</h2><table><thead><tr><th>worker</th><th>target</th><th>health</th>
<th>circuit</th><th>draining</th><th>in flight / max</th><th>KV usage</th><th class="r">KV capacity</th>
<th class="r">sessions</th><th>KV event stream</th></tr></thead><tbody id="workers"></tbody></table></section>
<section><h2>Prefix hit rate: predicted vs reported</h2>
<div class="legend dim">cached prompt tokens the router predicted vs the workers reported, of the prompt tokens they
reported; history over this page's refreshes<i style="background:var(--pred)"></i>predicted<i style="background:var(--ok)"></i>reported</div>
<table><thead><tr><th>target</th><th class="r">prompt tokens</th><th class="r">cached: predicted</th><th class="r">reported</th>
<th class="r">hit rate: predicted</th><th class="r">reported</th><th>history</th></tr></thead><tbody id="prefix"></tbody></table></section>
<section><h2>Sessions</h2><table><tbody id="sessions"></tbody></table>
<h2 style="margin-top:12px">Next expiries</h2><table><thead><tr><th>session</th><th>target</th><th class="r">expires in</th>
</tr></thead><tbody id="expiries"></tbody></table></section>
<section class="wide"><h2>Last routing decisions</h2><table><thead><tr><th>age</th><th>model</th><th>session</th><th>target</th>
<th class="r">predicted cached blocks</th><th>reason</th></tr></thead><tbody id="decisions"></tbody></table></section>
</main>
<script>
"use strict";
const REFRESH_MS = 2000, HISTORY = 60, STORE = "mesh.dashboard.adminKey";
const series = {};  // target id (or "all") -> [{p, r}]: the prefix counters at each refresh, oldest first
let key = null;

function takeKey() {
  const m = /(?:^#|&)key=([^&]*)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(STORE, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);  // the key leaves the address bar
  }
  return sessionStorage.getItem(STORE);
}
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function row(cells) { const tr = el("tr"); cells.forEach(c => tr.appendChild(c)); return tr; }
function fill(id, rows, empty, span) {
  const body = document.getElementById(id);
  body.replaceChildren(...rows);
  if (!rows.length) { const td = el("td", empty, "dim"); td.colSpan = span; body.appendChild(row([td])); }
}
function pill(text, cls) { const td = el("td"); td.appendChild(el("span", text, "pill " + cls)); return td; }
function num(n) { return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"); }
function pct(x) { return x === null || x === undefined || !isFinite(x) ? "–" : (100 * x).toFixed(1) + " %"; }
function ago(s) { s = Math.max(0, s); return s < 60 ? s.toFixed(1) + " s" : s < 3600 ? (s / 60).toFixed(1) + " min" : (s / 3600).toFixed(1) + " h"; }
function bar(frac, label) {
  const td = el("td"), b = el("span", null, "bar"), i = el("i");
  if (frac !== null) {
    i.style.width = (100 * Math.min(1, Math.max(0, frac))) + "%";
    if (frac >= 1) i.className = "full"; else if (frac >= 0.8) i.className = "hot";
    b.appendChild(i);
  }
  td.appendChild(b); td.appendChild(document.createTextNode(label)); return td;
}
function streamState(s) {
  if (s === "live") return pill("live", "ok");
  if (s === "none") return pill("none", "dim");
  if (s === "not live") return pill("not live", "warn");
  return pill(s, "bad");  // why the index is blind to this worker
}

function renderWorkers(st) {
  const rows = [];
  let healthy = 0, inflight = 0;
  for (const w of st.workers) {
    if (w.healthy) healthy++;
    w.targets.forEach((t, i) => {
      inflight += t.in_flight;
      const first = i === 0, name = el("td", first ? w.name : "", first ? "" : "dim");
      if (first && w.role !== "mixed") name.appendChild(el("span", " " + w.role, "dim"));
      const health = first ? pill(w.healthy ? "healthy" : "unhealthy", w.healthy ? "ok" : "bad") : el("td");
      if (first && w.last_error && !w.healthy) health.title = w.last_error;
      const circuit = first ? pill(w.circuit, w.circuit === "closed" ? "ok" : w.circuit === "open" ? "bad" : "warn") : el("td");
      const draining = first ? el("td", w.draining ? "draining" : "no", w.draining ? "warn" : "dim") : el("td");
      const load = t.max_in_flight ? bar(t.in_flight / t.max_in_flight, t.in_flight + " / " + t.max_in_flight)
                                   : bar(null, t.in_flight + " / no limit");
      const kv = t.kv_usage === null ? el("td", "not reported", "dim") : bar(t.kv_usage, pct(t.kv_usage));
      const cap = el("td", t.kv_capacity_blocks ? num(t.kv_capacity_blocks) + " blocks" : "unknown", "r" + (t.kv_capacity_blocks ? "" : " dim"));
      const stream = first ? streamState(w.kv_events) : (t.index_healthy ? el("td") : pill("not live", "warn"));
      rows.push(row([name, el("td", t.id), health, circuit, draining, load, kv, cap, el("td", t.live_sessions, "r"), stream]));
    });
  }
  fill("workers", rows, "no workers registered", 10);
  document.getElementById("c-workers").textContent = healthy + " / " + st.workers.length;
  document.getElementById("c-workers").className = healthy ? (healthy < st.workers.length ? "warn" : "ok") : "bad";
  document.getElementById("c-inflight").textContent = num(inflight);
}

function spark(points) {
  // the hit rates (0..1, fixed scale) at each refresh, newest at the right edge; a short history
  // is spread over at least a fifth of the width
  const W = 140, H = 26, NS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("class", "spark");
  const base = document.createElementNS(NS, "line");
  base.setAttribute("x1", 0); base.setAttribute("x2", W); base.setAttribute("y1", H - 1); base.setAttribute("y2", H - 1);
  base.setAttribute("stroke", "#2a3642"); svg.appendChild(base);
  const known = points.filter(q => q !== null);
  const step = W / (Math.min(HISTORY, Math.max(points.length, 12)) - 1), x0 = W - step * (points.length - 1);
  for (const [field, color] of [["p", "#bc8cff"], ["r", "#3fb950"]]) {
    if (!known.length) break;
    const pts = [];
    points.forEach((q, i) => { if (q !== null) pts.push((x0 + i * step).toFixed(1) + "," + (H - 2 - (H - 4) * q[field]).toFixed(1)); });
    if (pts.length === 1) pts.unshift((x0 - step).toFixed(1) + "," + pts[0].split(",")[1]);
    const line = document.createElementNS(NS, "polyline");
    line.setAttribute("points", pts.join(" ")); line.setAttribute("fill", "none");
    line.setAttribute("stroke", color); line.setAttribute("stroke-width", "1.6");
    svg.appendChild(line);
  }
  const td = el("td"); td.appendChild(svg); return td;
}
function rates(v) { return v.prompt ? {p: v.predicted / v.prompt, r: v.reported / v.prompt} : null; }
function remember(id, v) {
  const h = series[id] = series[id] || [];
  h.push(rates(v));
  if (h.length > HISTORY) h.shift();
  return h;
}
function renderPrefix(st) {
  const rows = [], pre = st.prefix;
  const line = (label, id, v, cls) => {
    const q = rates(v);
    return row([el("td", label, cls), el("td", num(v.prompt), "r"), el("td", num(v.predicted), "r"), el("td", num(v.reported), "r"),
                el("td", q ? pct(q.p) : "–", "r pred"), el("td", q ? pct(q.r) : "–", "r ok"), spark(remember(id, v))]);
  };
  rows.push(line("all targets", "\u0000all", pre, "info"));
  for (const [tid, v] of Object.entries(pre.targets)) rows.push(line(tid, tid, v));
  fill("prefix", rows, "", 7);
  const q = rates(pre);
  document.getElementById("c-hit").textContent = q ? pct(q.r) + " / " + pct(q.p) : "–";
}

function renderSessions(st) {
  const s = st.sessions;
  document.getElementById("sessions-live").textContent = num(s.live);
  const kv = [["bound", num(s.live) + " of at most " + num(s.max_sessions)], ["idle expiry", ago(s.idle_ttl_s)],
              ["created", num(s.created)], ["expired", num(s.expired)], ["evicted", num(s.evicted)], ["moved", num(s.moves)]];
  fill("sessions", kv.map(([k, v]) => row([el("th", k), el("td", v, "r")])), "", 2);
  fill("expiries", s.next_expiries.map(e => row([el("td", e.session), el("td", e.target), el("td", ago(e.at - st.time), "r")])),
       "no binding expires (none bound, or every session has a request in flight)", 3);
}
function renderDecisions(st) {
  fill("decisions", st.decisions.map(d => {
    const target = el("td", d.target);
    if (d.retry) target.appendChild(el("span", " retry", "warn"));
    return row([el("td", ago(st.time - d.at), "dim"), el("td", d.model), el("td", d.session || "–", d.session ? "" : "dim"),
                target, el("td", num(d.cached_blocks), "r"), el("td", d.reason, "reason")]);
  }), "no request routed yet", 6);
}

function status(text, cls) { const s = document.getElementById("status"); s.textContent = text; s.className = cls; }
function notice(parts) {
  const n = document.getElementById("notice");
  n.replaceChildren(...parts.map(p => typeof p === "string" ? document.createTextNode(p) : el("code", p.code)));
  n.style.display = parts.length ? "block" : "none";
}
function askKey(why) { document.getElementById("keyform").style.display = "flex"; status(why, "warn"); }

async function refresh() {
  if (!key) { askKey("admin key needed"); return; }
  let resp;
  try {
    resp = await fetch("/dashboard/state", {headers: {"Authorization": "Bearer " + key}, cache: "no-store"});
  } catch (e) { status("gateway unreachable, retrying", "bad"); return schedule(); }
  if (resp.status === 403) {
    notice(["The admin API is disabled on this gateway, and this view reads it. Set ", {code: "server.admin_key"},
            " (or ", {code: "server.admin_key_file"}, ", ", {code: "mesh serve --admin-key"}, "), then open ",
            {code: "/dashboard#key=<admin key>"}, "."]);
    status("admin API disabled", "bad"); return schedule();
  }
  if (resp.status === 401) { sessionStorage.removeItem(STORE); key = null; askKey("wrong admin key"); return; }
  if (!resp.ok) { status("state answered " + resp.status + ", retrying", "bad"); return schedule(); }
  const st = await resp.json();
  notice([]);
  document.getElementById("keyform").style.display = "none";
  document.getElementById("policy").textContent = "policy " + (st.policy.name || "?") + (st.policy.inner ? " over " + st.policy.inner.name : "");
  renderWorkers(st); renderPrefix(st); renderSessions(st); renderDecisions(st);
  document.getElementById("c-index").textContent = num(st.index.keys);
  document.getElementById("c-waiting").textContent = num(st.admission_waiting);
  status("updated " + new Date(st.time * 1000).toLocaleTimeString(), "ok");
  document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  schedule();
}
let timer = null;
function schedule() { clearTimeout(timer); timer = setTimeout(refresh, REFRESH_MS); }
document.getElementById("keyform").addEventListener("submit", ev => {
  ev.preventDefault();
  key = document.getElementById("key").value.trim();
  if (key) { sessionStorage.setItem(STORE, key); status("connecting…", "dim"); refresh(); }
});
key = takeKey();
refresh();
</script>
</body></html>
"""
