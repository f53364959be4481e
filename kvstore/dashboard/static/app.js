// kvstore dashboard: polls /api/cluster and draws everything as plain SVG / HTML.
// No dependencies, no build step: this file is served as is by `kvstore dashboard`.
"use strict";

const OPS = ["get", "match_prefix", "exists"];
const TIERS = [["dram", "DRAM"], ["nvme", "NVMe"], ["hbm", "HBM"], ["remote", "remote"]];
const REASONS = [
  ["evicted", "evicted", "#f97316"], ["invalidated", "invalidated", "#e879f9"], ["corrupt", "corrupt", "#ef4444"],
  ["never_stored", "never stored", "#64748b"], ["node_down", "node down", "#eab308"], ["deadline", "deadline", "#06b6d4"],
];
const PATHS = [["local", "local (shm)", "#38bdf8"], ["tcp", "TCP", "#f472b6"], ["grpc", "gRPC stream", "#facc15"], ["nvme", "NVMe", "#34d399"]];
const MOVES = [["evictions/dram", "DRAM evictions", "#f97316"], ["evictions/nvme", "NVMe evictions", "#ef4444"],
  ["promotions", "promotions", "#38bdf8"], ["demotions", "demotions", "#a78bfa"]];
const COLOR = { hbm: "#a78bfa", dram: "#38bdf8", nvme: "#34d399", remote: "#fbbf24" };
// where the conductor expected a routed prompt's tokens to come from
const SOURCES = [["engine", "engine cache", COLOR.hbm], ["pool_dram", "pool DRAM", COLOR.dram], ["pool_nvme", "NVMe", COLOR.nvme],
  ["pool_remote", "remote", COLOR.remote], ["compute", "computed", "#64748b"]];
const WINDOW_S = 300;
const MAX_POINTS = 900;

const state = { op: "all", data: null, points: [], seq: -1, lastOk: 0, failing: false, interval: 1 };

// ---------------------------------------------------------------- formatting
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
function pct(x, digits = 1) { return x == null || !isFinite(x) ? "—" : (100 * x).toFixed(digits) + "%"; }
function num(x) {
  if (x == null || !isFinite(x)) return "—";
  const a = Math.abs(x);
  if (a >= 1e9) return (x / 1e9).toFixed(a >= 1e10 ? 1 : 2) + "G";
  if (a >= 1e6) return (x / 1e6).toFixed(a >= 1e7 ? 1 : 2) + "M";
  if (a >= 1e4) return (x / 1e3).toFixed(1) + "k";
  return Number.isInteger(x) ? String(x) : x.toFixed(x < 10 ? 2 : 1);
}
function bytes(x) {
  if (x == null || !isFinite(x)) return "—";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(x) >= 1024 && i < u.length - 1) { x /= 1024; i++; }
  return (i === 0 ? x.toFixed(0) : x.toFixed(x < 10 ? 2 : 1)) + " " + u[i];
}
function axisBytes(x) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (x >= 1024 && i < u.length - 1) { x /= 1024; i++; }
  return (Number.isInteger(x) ? x : x.toFixed(1)) + " " + u[i];
}
function dur(s) {
  if (s == null || !isFinite(s)) return "—";
  if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms";
  return s.toFixed(2) + " s";
}
function ago(sec) {
  if (sec < 90) return Math.round(sec) + " s";
  if (sec < 5400) return Math.round(sec / 60) + " min";
  if (sec < 172800) return (sec / 3600).toFixed(1) + " h";
  return (sec / 86400).toFixed(1) + " d";
}

// ---------------------------------------------------------------- counters
const ops = () => (state.op === "all" ? OPS : [state.op]);
function get(c, key) { return c[key] || 0; }
function lookups(c) { return ops().reduce((s, op) => s + get(c, `lookups/${op}`), 0); }
function hits(c, tier) { return ops().reduce((s, op) => s + (tier ? get(c, `hits/${op}/${tier}`) : TIERS.reduce((t, [k]) => t + get(c, `hits/${op}/${k}`), 0)), 0); }
function tokens(c, tier) { return ops().reduce((s, op) => s + (tier ? get(c, `hit_tokens/${op}/${tier}`) : TIERS.reduce((t, [k]) => t + get(c, `hit_tokens/${op}/${k}`), 0)), 0); }
function misses(c, reason) { return ops().reduce((s, op) => s + (reason ? get(c, `misses/${op}/${reason}`) : REASONS.reduce((t, [k]) => t + get(c, `misses/${op}/${k}`), 0)), 0); }
function bytesMoved(c, path) { return get(c, `bytes/${path}/read`) + get(c, `bytes/${path}/write`); }
function windowSum(fn, seconds) {
  const now = state.points.length ? state.points[state.points.length - 1].t : 0;
  let v = 0, dt = 0;
  for (let i = state.points.length - 1; i >= 0 && now - state.points[i].t < seconds; i--) { v += fn(state.points[i].d); dt += state.points[i].dt; }
  return { v, dt };
}

// ---------------------------------------------------------------- SVG helpers
function svg(w, h, body) { return `<svg viewBox="0 0 ${w} ${h}" preserveAspectRatio="none" xmlns="http://www.w3.org/2000/svg">${body}</svg>`; }
function size(el) { return [Math.max(el.clientWidth, 200), Math.max(el.clientHeight, 80)]; }
// the last WINDOW_S seconds in `n` fixed time buckets (aligned to the clock, so bars do not jitter):
// each bucket sums the deltas of the polls that ended in it
function buckets(n) {
  const pts = state.points.filter((p) => p.dt > 0);
  const width = WINDOW_S / n;
  const t1 = Math.ceil((pts.length ? pts[pts.length - 1].t : Date.now() / 1000) / width) * width;
  const t0 = t1 - WINDOW_S;
  const out = [];
  for (const p of pts) {
    if (p.t <= t0) continue;
    const i = Math.min(n - 1, Math.floor((p.t - t0) / width));
    let b = out.length && out[out.length - 1].i === i ? out[out.length - 1] : null;
    if (!b) { b = { i, t: t0 + (i + 1) * width, dt: 0, d: {} }; out.push(b); }
    b.dt += p.dt;
    for (const k in p.d) b.d[k] = (b.d[k] || 0) + p.d[k];
  }
  return { pts: out, t0, t1, width };
}
function timeAxis(w, h, pad, t0, t1) {
  let out = "";
  for (let m = 0; m <= 5; m++) {
    const x = pad.l + ((w - pad.l - pad.r) * m) / 5;
    const label = m === 5 ? "now" : `-${5 - m}m`;
    out += `<text x="${x}" y="${h - 4}" text-anchor="${m === 0 ? "start" : m === 5 ? "end" : "middle"}">${label}</text>`;
  }
  return out;
}
function legend(el, items) { el.innerHTML = items.map(([, label, color]) => `<span><i style="background:${color}"></i>${esc(label)}</span>`).join(""); }

// stacked per-interval bars: the share of lookups each tier answered
function ratioChart(el) {
  const [w, h] = size(el);
  const pad = { l: 38, r: 8, t: 8, b: 18 };
  const { pts, t0, t1, width } = buckets(60);
  const iw = w - pad.l - pad.r, ih = h - pad.t - pad.b;
  const x = (t) => pad.l + ((t - t0) / (t1 - t0)) * iw;
  let body = "";
  for (const f of [0, 0.25, 0.5, 0.75, 1]) {
    const y = pad.t + ih * (1 - f);
    body += `<line class="gridline" x1="${pad.l}" x2="${w - pad.r}" y1="${y}" y2="${y}"/><text x="${pad.l - 6}" y="${y + 4}" text-anchor="end">${f * 100}%</text>`;
  }
  let any = false;
  for (const p of pts) {
    const n = lookups(p.d);
    if (n <= 0) continue;
    any = true;
    const bw = Math.max(1.5, (width / (t1 - t0)) * iw - 2);
    let y = pad.t + ih;
    for (const [tier, label] of TIERS) {
      const f = hits(p.d, tier) / n;
      if (f <= 0) continue;
      const bh = f * ih;
      y -= bh;
      body += `<rect x="${(x(p.t) - bw - 1).toFixed(1)}" y="${y.toFixed(1)}" width="${bw.toFixed(1)}" height="${bh.toFixed(1)}" rx="1.5" fill="${COLOR[tier]}"><title>${label}: ${pct(f)} of ${num(n)} lookups</title></rect>`;
    }
  }
  if (!any) body += `<text class="empty" x="${pad.l + iw / 2}" y="${pad.t + ih / 2}" text-anchor="middle">no lookups in the last 5 minutes</text>`;
  body += timeAxis(w, h, pad, t0, t1);
  el.innerHTML = svg(w, h, body);
}

// a round axis maximum: 1, 2, 2.5, 5 × 10^k of `unit`s (1024^k for bytes)
function axis(max, binary) {
  const unit = binary && max > 0 ? Math.pow(1024, Math.max(0, Math.floor(Math.log(max) / Math.log(1024)))) : 1;
  const m = max / unit;
  if (!(m > 0)) return { max: unit, unit };
  const p = Math.pow(10, Math.floor(Math.log10(m)));
  const step = [1, 2, 2.5, 5, 10].find((f) => f * p >= m);
  return { max: step * p * unit, unit };
}

function lineChart(el, series, fmt, binary) {
  const [w, h] = size(el);
  const pad = { l: 64, r: 8, t: 8, b: 18 };
  const { pts, t0, t1 } = buckets(100);
  const iw = w - pad.l - pad.r, ih = h - pad.t - pad.b;
  const values = series.map(([fn]) => pts.map((p) => fn(p.d) / p.dt));
  const max = axis(Math.max(0, ...values.flat()), binary).max;
  const x = (t) => pad.l + ((t - t0) / (t1 - t0)) * iw;
  const y = (v) => pad.t + ih * (1 - v / max);
  let body = "";
  for (const f of [0, 0.5, 1]) body += `<line class="gridline" x1="${pad.l}" x2="${w - pad.r}" y1="${y(f * max)}" y2="${y(f * max)}"/><text x="${pad.l - 6}" y="${y(f * max) + 4}" text-anchor="end">${fmt(f * max)}</text>`;
  series.forEach(([, label, color], i) => {
    if (!pts.length) return;
    const d = pts.map((p, j) => `${j ? "L" : "M"}${x(p.t).toFixed(1)},${y(values[i][j]).toFixed(1)}`).join("");
    body += `<path d="${d}" fill="none" stroke="${color}" stroke-width="1.8" stroke-linejoin="round"><title>${esc(label)}</title></path>`;
  });
  body += timeAxis(w, h, pad, t0, t1);
  el.innerHTML = svg(w, h, body);
}

function sparkline(el, fn) {
  const w = 200, h = 52;
  const { pts } = buckets(60);
  const live = pts.filter((p) => lookups(p.d) > 0);
  if (live.length < 2) { el.innerHTML = ""; return; }
  const t0 = live[0].t, t1 = live[live.length - 1].t;
  const xs = [], ys = [];
  for (const p of live) { xs.push(((p.t - t0) / (t1 - t0)) * w); ys.push(h - 3 - fn(p.d, lookups(p.d)) * (h - 6)); }
  if (xs.length < 2) { el.innerHTML = ""; return; }
  const d = xs.map((xv, i) => `${i ? "L" : "M"}${xv.toFixed(1)},${ys[i].toFixed(1)}`).join("");
  el.setAttribute("viewBox", `0 0 ${w} ${h}`);
  el.setAttribute("preserveAspectRatio", "none");
  el.innerHTML = `<path d="${d}L${xs[xs.length - 1]},${h}L${xs[0]},${h}Z" fill="rgba(52,211,153,.12)"/><path d="${d}" fill="none" stroke="#34d399" stroke-width="1.6" vector-effect="non-scaling-stroke"/>`;
}

function barRow({ label, value, frac, color, text, attrs = "", title = "" }) {
  const w = Math.max(0, Math.min(1, frac || 0)) * 100;
  return `<div class="row${value ? "" : " zero"}" ${attrs} title="${esc(title)}"><span class="label">${label}</span>` +
    `<span class="track"><span style="width:${w.toFixed(2)}%;background:${color}"></span></span><span class="num" data-value="${value}">${text}</span></div>`;
}

// ---------------------------------------------------------------- panels
function renderKpis(d) {
  const c = d.totals;
  const n = lookups(c), hit = hits(c), miss = misses(c), tok = tokens(c);
  const ratio = n > 0 ? hit / n : null;
  const hr = $("hit-ratio");
  hr.textContent = pct(ratio);
  hr.dataset.value = ratio == null ? "" : String(ratio);
  const last = windowSum((p) => hits(p), 60), lastN = windowSum((p) => lookups(p), 60);
  $("hit-ratio-sub").textContent = lastN.v > 0 ? `last minute ${pct(last.v / lastN.v)} · ${num(hit)} of ${num(n)} blocks` : `${num(hit)} of ${num(n)} blocks`;
  sparkline($("hit-spark"), (p, k) => hits(p) / k);
  // tokens when the writers gave token counts; else the hits themselves, in blocks and bytes served
  const served = ["local", "tcp", "grpc"].reduce((s, k) => s + get(c, `bytes/${k}/read`), 0);
  const byTokens = tok > 0 || hit === 0;
  $("hit-tokens-title").textContent = byTokens ? "Tokens from cache" : "Blocks from cache";
  $("hit-tokens").textContent = num(byTokens ? tok : hit);
  $("hit-tokens").dataset.value = String(byTokens ? tok : hit);
  $("hit-tokens").dataset.unit = byTokens ? "tokens" : "blocks";
  $("hit-tokens-sub").textContent = tok > 0 ? TIERS.filter(([k]) => tokens(c, k) > 0).map(([k, l]) => `${l} ${pct(tokens(c, k) / tok, 0)}`).join(" · ")
    : hit > 0 ? `${bytes(served)} served · no token counts given` : "no hits yet";
  $("lookups").textContent = num(n);
  $("lookups").dataset.value = String(n);
  const rate = windowSum((p) => lookups(p), 10);
  $("lookups-sub").textContent = `${num(rate.dt > 0 ? rate.v / rate.dt : 0)} blocks/s now`;
  $("misses-total").textContent = num(miss);
  $("misses-total").dataset.value = String(miss);
  const top = REASONS.map(([k, l]) => [misses(c, k), l]).sort((a, b) => b[0] - a[0])[0];
  $("misses-sub").textContent = miss > 0 ? `mostly ${top[1]} (${pct(top[0] / miss, 0)})` : "none";
  const bw = windowSum((p) => PATHS.reduce((s, [k]) => s + bytesMoved(p, k), 0), 10);
  const bwRate = bw.dt > 0 ? bw.v / bw.dt : 0;
  $("bandwidth").textContent = bytes(bwRate) + "/s";
  $("bandwidth").dataset.value = String(bwRate);
  $("bandwidth-sub").textContent = `${bytes(PATHS.reduce((s, [k]) => s + bytesMoved(c, k), 0))} in total`;
  const up = d.nodes.filter((x) => x.status === "up").length;
  $("nodes-up").textContent = `${up} / ${d.nodes.length}`;
  $("nodes-up").dataset.value = String(up);
  $("nodes-up").style.color = up < d.nodes.length ? "var(--bad)" : "";
  $("nodes-sub").textContent = up < d.nodes.length ? `${d.nodes.length - up} not answering` : d.nodes.length ? "all answering" : "no nodes";
}

function renderMisses(c) {
  const total = misses(c);
  $("misses-note").textContent = total ? `${num(total)} blocks` : "";
  const max = Math.max(1, ...REASONS.map(([k]) => misses(c, k)));
  $("misses").innerHTML = REASONS.map(([k, label, color]) => {
    const v = misses(c, k);
    const share = total ? ` <small>${pct(v / total, 0)}</small>` : "";
    return barRow({ label, value: v, frac: v / max, color, text: `${num(v)}${share}`, attrs: `data-reason="${k}"`,
      title: k === "node_down" || k === "deadline" ? "seen by cluster clients (an owner did not answer), reported to the nodes" : "" });
  }).join("");
}

function renderCapacity(d) {
  const skipped = get(d.totals, "skipped_saves");
  $("capacity-note").innerHTML = "used of capacity, per node and tier" + (skipped > 0
    ? ` · <span data-k="skipped_saves" data-value="${skipped}" title="chunks engines computed and their connector's save_policy did not store: not expected to be read again">${num(skipped)} chunks not stored by policy</span>`
    : "");
  const rows = [];
  const up = d.nodes.filter((n) => n.tiers && n.status === "up");
  const groups = up.length > 1 ? [["cluster", d.tiers], ...up.map((n) => [n.title || n.name, n.tiers])] : up.map((n) => [n.title || n.name, n.tiers]);
  for (const [name, tiers] of groups) {
    rows.push(`<div class="row group">${esc(name)}</div>`);
    for (const [k, label] of TIERS) {
      const t = tiers[k];
      if (!t) continue;
      const f = t.capacity ? t.used / t.capacity : 0;
      rows.push(barRow({ label, value: t.used, frac: f, color: COLOR[k], title: `${num(t.blocks)} blocks, ${pct(f)} full`,
        text: `${bytes(t.used)} <small>/ ${bytes(t.capacity)} · ${num(t.blocks)} blocks</small>`, attrs: `data-tier="${k}" data-node="${esc(name)}"` }));
    }
  }
  $("capacity").innerHTML = rows.join("") || `<div class="note">no node answering</div>`;
}

function address(url) { return url ? url.replace(/^https?:\/\//, "").replace(/\/(metrics|conductor\/state)$/, "") : ""; }

function renderReplication(r) {
  const el = $("replication");
  if (!r) { el.innerHTML = ""; return; }
  const parts = [`<span data-k="factor">replication ${r.factor == null ? "—" : "R = " + r.factor}</span>`];
  parts.push(`<span data-k="suspected" data-value="${r.suspected.length}" class="${r.suspected.length ? "bad" : ""}">` +
    (r.suspected.length ? `${r.suspected.length} suspected: ${r.suspected.map(esc).join(", ")}` : "no node suspected") + "</span>");
  parts.push(`<span data-k="under_replicated" data-value="${r.under_replicated}" class="${r.under_replicated ? "warn" : ""}" ` +
    `title="block copies cluster clients' puts could not write (an owner suspect or failing)">${num(r.under_replicated)} copies under-replicated</span>`);
  el.innerHTML = parts.join("");
}

function renderNodes(d) {
  const now = d.now;
  $("nodes-note").textContent = d.source || "";
  renderReplication(d.replication);
  $("nodes").innerHTML = d.nodes.map((n) => {
    const ratio = n.lookups > 0 ? n.hits / n.lookups : null;
    const meta = n.status === "up"
      ? `${esc(address(n.url))} · v${esc(n.version || "?")} · up ${ago(now - (n.start_time || now))}`
      : n.last_seen ? `last seen ${ago(now - n.last_seen)} ago` : "never answered";
    const mini = n.status === "up"
      ? `<div class="mini"><span class="track"><span style="width:${((ratio || 0) * 100).toFixed(1)}%;background:var(--good)"></span></span><span>${pct(ratio, 0)} hits · ${num(n.lookups)}</span></div>`
      : "";
    return `<div class="node" data-node="${esc(n.name)}" data-status="${n.status}"><div class="head"><span class="dot"></span><span class="name" title="${esc(n.url || "")}">${esc(n.title || n.name)}</span>` +
      `<span class="note">${n.status === "up" ? n.scrape_ms.toFixed(0) + " ms" : n.status}</span></div><div class="meta">${meta}</div>${mini}` +
      (n.error ? `<div class="err">${esc(n.error)}</div>` : "") + `</div>`;
  }).join("") || `<div class="note">no nodes</div>`;
}

function us(x) { return x == null ? "—" : dur(x / 1e6); }

function renderConductors(d) {
  const now = d.now;
  $("conductors").innerHTML = d.conductors.map((c) => {
    const rejected = Object.values(c.rejected).reduce((s, v) => s + v, 0);
    const why = Object.entries(c.rejected).filter(([, v]) => v > 0).map(([k, v]) => `${esc(k)} ${num(v)}`).join(", ");
    const figures = c.decision_us == null ? "" :
      `<div class="meta"><span data-k="decision_p50" data-value="${c.decision_us.p50 ?? ""}">decision ${us(c.decision_us.p50)}</span>` +
      ` <small>p50</small> · <span data-k="decision_p99" data-value="${c.decision_us.p99 ?? ""}">${us(c.decision_us.p99)}</span> <small>p99</small></div>` +
      `<div class="meta"><span data-k="ttft_err" data-value="${c.ttft_err_median ?? ""}" title="median of |predicted − measured| / measured TTFT">` +
      `TTFT prediction error ${pct(c.ttft_err_median, 0)}</span></div>` +
      `<div class="meta"><span data-k="routed" data-value="${c.routed}">${num(c.routed)} routed</span> · ` +
      `<span data-k="rejected" data-value="${rejected}" class="${rejected ? "warn" : ""}">${num(rejected)} rejected${why ? ` (${why})` : ""}</span>` +
      (c.pool_errors ? ` · <span data-k="pool_errors" data-value="${c.pool_errors}" class="warn">${num(c.pool_errors)} pool errors</span>` : "") + `</div>`;
    const head = c.status === "up" ? `${c.alive} / ${c.engines} engines alive${c.pd ? " · P/D" : ""}`
      : c.last_seen ? `last seen ${ago(now - c.last_seen)} ago` : "never answered";
    return `<div class="node" data-conductor="${esc(c.name)}" data-status="${c.status}"><div class="head"><span class="dot"></span>` +
      `<span class="name" title="conductor ${esc(c.url)}">${esc(address(c.name))}</span><span class="note">${c.status === "up" ? c.scrape_ms.toFixed(0) + " ms" : esc(c.status)}</span></div>` +
      `<div class="meta">${head}</div>${figures}` + (c.error ? `<div class="err">${esc(c.error)}</div>` : "") + `</div>`;
  }).join("");
}

const ENGINE_STATUS = { up: "alive", down: "dead", partial: "dead for some", unknown: "unknown", left: "left" };

function renderEngines(d) {
  const card = $("engines-card");
  card.hidden = !d.conductors || d.conductors.length === 0;
  card.classList.toggle("first", !card.hidden && d.nodes.length === 0);  // only conductors: their engines lead
  if (card.hidden) return;
  renderConductors(d);
  const answering = d.conductors.filter((c) => c.status === "up").length;
  $("engines-note").textContent = `${d.engines.length} engine${d.engines.length === 1 ? "" : "s"} · ${answering} of ${d.conductors.length} conductor${d.conductors.length === 1 ? "" : "s"} answering`;
  const head = `<div class="erow head"><span>engine</span><span>state</span><span class="n">routed</span><span class="n">running / queued</span>` +
    `<span>hit ratio</span><span>prompt tokens by source</span><span class="n">TTFT pred / meas</span><span class="n">KV view</span></div>`;
  const rows = d.engines.map((e) => {
    const total = SOURCES.reduce((s, [k]) => s + (e.tokens[k] || 0), 0);
    const segs = SOURCES.map(([k, label, color]) => {
      const v = e.tokens[k] || 0;
      return v > 0 ? `<span data-source="${k}" data-value="${v}" style="width:${((100 * v) / total).toFixed(2)}%;background:${color}" title="${label}: ${num(v)} tokens (${pct(v / total, 0)})"></span>` : "";
    }).join("");
    const split = total ? SOURCES.filter(([k]) => e.tokens[k] > 0).map(([k, label]) => `${label} ${pct(e.tokens[k] / total, 0)}`).join(" · ") : "none yet";
    const v = e.view;
    const view = v == null ? `<span data-k="staleness" data-value="" class="note" title="no conductor follows this engine's KV events: its cache gets no credit">no KV events</span>`
      : v.staleness_s == null ? `<span data-k="staleness" data-value="" class="note">no event yet</span>`
      : `<span data-k="staleness" data-value="${v.staleness_s}" class="${v.connected ? "" : "warn"}" title="${num(v.events)} events, ${num(v.resyncs)} resyncs${v.connected ? "" : ", not connected"}">${dur(v.staleness_s)} old</span>`;
    const t = e.ttft;
    const ttft = t == null ? `<span data-k="ttft" data-value="" class="note">—</span>`
      : `<span data-k="ttft" data-value="${t.measured_p50_ms}" data-predicted="${t.predicted_p50_ms}" data-err="${t.abs_err_median}" ` +
        `title="median over its last ${num(t.n)} first tokens; median |predicted − measured| / measured ${pct(t.abs_err_median, 0)}">` +
        `${dur(t.predicted_p50_ms / 1e3)} / ${dur(t.measured_p50_ms / 1e3)} <small>${pct(t.abs_err_median, 0)}</small></span>`;
    const live = e.running != null;
    return `<div class="erow" data-engine="${esc(e.engine_id)}" data-status="${e.status}">` +
      `<span class="name"><span class="dot"></span><span><b title="${esc(e.url)}">${esc(e.engine_id)}</b> <small>${esc(e.role)}${e.models.length ? " · " + e.models.map(esc).join(", ") : ""}</small>` +
      (e.errors.length ? `<span class="err">${e.errors.map(esc).join("; ")}</span>` : "") + `</span></span>` +
      `<span data-k="status">${ENGINE_STATUS[e.status] || esc(e.status)}</span>` +
      `<span class="n" data-k="routed" data-value="${e.routed}" title="requests routed here, summed over conductors; ${num(e.served)} served">${num(e.routed)}</span>` +
      `<span class="n"><span data-k="running" data-value="${live ? e.running : ""}">${live ? num(e.running) : "—"}</span> / ` +
      `<span data-k="queued" data-value="${live ? e.queued : ""}">${live ? num(e.queued) : "—"}</span></span>` +
      `<span class="ratio"><span class="track"><span style="width:${((e.hit_ratio || 0) * 100).toFixed(1)}%;background:var(--good)"></span></span>` +
      `<span data-k="hit_ratio" data-value="${e.hit_ratio ?? ""}">${pct(e.hit_ratio, 0)}</span></span>` +
      `<span class="sources"><span class="track stack" data-k="tokens" data-value="${total}">${segs}</span><small>${num(total)} · ${split}</small></span>` +
      `<span class="n">${ttft}</span><span class="n">${view}</span></div>`;
  });
  $("engines").innerHTML = rows.length ? head + rows.join("") : `<div class="note">no engine reported yet</div>`;
}

function renderNamespaces(d) {
  const c = d.totals, rows = {};
  for (const key in c) {
    if (!key.startsWith("ns/")) continue;
    const [, ns, op, kind] = key.split("/");
    if (!ops().includes(op)) continue;
    const r = rows[ns] || (rows[ns] = { ns, hits: 0, misses: 0, tokens: 0 });
    r[kind] += c[key];
  }
  const list = Object.values(rows).map((r) => ({ ...r, n: r.hits + r.misses })).filter((r) => r.n > 0).sort((a, b) => b.n - a.n).slice(0, 8);
  $("namespaces").innerHTML = list.map((r) => {
    const special = r.ns === "other" || r.ns === "unknown" || /^0+$/.test(r.ns);
    const name = special ? `<em>${/^0+$/.test(r.ns) ? "no namespace" : r.ns}</em>` : d.names[r.ns] ? esc(d.names[r.ns]) : `<code>${esc(r.ns)}</code>`;
    return barRow({ label: name, value: r.n, frac: r.hits / r.n, color: "#34d399", text: `${pct(r.hits / r.n, 0)} <small>${num(r.n)}</small>`,
      attrs: `data-namespace="${esc(r.ns)}"`, title: `${r.ns}: ${num(r.hits)} hits, ${num(r.misses)} misses, ${num(r.tokens)} tokens from cache` });
  }).join("") || `<div class="note">no lookups yet</div>`;
}

function renderAgents(d) {
  // kvstore_agent_*: which integration (vLLM connector, SGLang HiCache, plain SDK...) reads and writes what
  const c = d.totals, rows = {};
  for (const key in c) {
    if (!key.startsWith("agent/")) continue;
    const [, agent, op, result] = key.split("/");
    const r = rows[agent] || (rows[agent] = { agent, read: {}, lookup: {}, write: {}, bytes: {}, calls: {}, seconds: {} });
    if (r[op]) r[op][result] = (r[op][result] || 0) + c[key];
  }
  const list = Object.values(rows).map((r) => {
    const hit = r.read.hit || 0, n = hit + (r.read.miss || 0);
    const calls = r.calls.all || 0;
    return { ...r, hit, n, mean: calls ? (r.seconds.all || 0) / calls : null, any: n + (r.lookup.hit || 0) + (r.lookup.miss || 0) + (r.write.stored || 0) };
  }).filter((r) => r.any > 0).sort((a, b) => b.n - a.n || b.any - a.any).slice(0, 8);
  $("agents").innerHTML = list.map((r) => {
    const lk = (r.lookup.hit || 0) + (r.lookup.miss || 0);
    const title = `${r.agent}: reads ${num(r.hit)} hits of ${num(r.n)} (${bytes(r.bytes.read || 0)}), lookups ${num(r.lookup.hit || 0)} of ${num(lk)}, ` +
      `writes ${num(r.write.stored || 0)} stored (${bytes(r.bytes.write || 0)}), ${num(r.write.refused || 0)} refused; ` +
      `${num(r.calls.all || 0)} calls, mean ${r.mean == null ? "—" : dur(r.mean)}`;
    return barRow({ label: esc(r.agent), value: r.n, frac: r.n ? r.hit / r.n : 0, color: "#a78bfa",
      text: `${r.n ? pct(r.hit / r.n, 0) : "—"} <small>${bytes(r.bytes.read || 0)} · ${r.mean == null ? "—" : dur(r.mean)}</small>`,
      attrs: `data-agent="${esc(r.agent)}" data-reads="${r.n}" data-read-hits="${r.hit}" data-read-bytes="${r.bytes.read || 0}" data-written="${r.write.stored || 0}"`, title });
  }).join("") || `<div class="note">no agent has called yet</div>`;
}

function renderLatency(d) {
  const lo = Math.log10(2e-5), hi = Math.log10(10);
  const pos = (s) => Math.max(0, Math.min(100, ((Math.log10(Math.max(s, 2e-5)) - lo) / (hi - lo)) * 100));
  const rows = d.latency.filter((m) => m.count > 0).slice(0, 9).map((m) => {
    const bar = m.p50 == null ? `<span class="note">idle</span>`
      : `<svg viewBox="0 0 100 14" preserveAspectRatio="none"><line x1="0" x2="100" y1="7" y2="7" stroke="#1e2a44" stroke-width="6" vector-effect="non-scaling-stroke" stroke-linecap="round"/>` +
        `<line x1="${pos(m.p50)}" x2="${pos(m.p99)}" y1="7" y2="7" stroke="#38bdf8" stroke-width="3" vector-effect="non-scaling-stroke"/></svg>`;
    return `<div class="row" data-method="${esc(m.method)}" title="${esc(m.method)}: ${num(m.count)} calls in total"><span class="label">${esc(m.method)}</span><span class="lat">${bar}</span>` +
      `<span class="num">${m.p50 == null ? "—" : dur(m.p50)} <small>${m.p99 == null ? "" : dur(m.p99)}</small></span></div>`;
  });
  $("latency").innerHTML = rows.join("") || `<div class="note">no calls yet</div>`;
}

function render() {
  const d = state.data;
  if (!d) return;
  renderKpis(d);
  ratioChart($("ratio-chart"));
  renderMisses(d.totals);
  renderCapacity(d);
  lineChart($("moves-chart"), MOVES.map(([k, label, color]) => [(c) => get(c, k), label, color]), (v) => num(v) + "/s", false);
  lineChart($("bw-chart"), PATHS.map(([k, label, color]) => [(c) => bytesMoved(c, k), label, color]), (v) => axisBytes(v) + "/s", true);
  renderNodes(d);
  renderEngines(d);
  renderNamespaces(d);
  renderAgents(d);
  renderLatency(d);
  const banner = $("banner");
  banner.hidden = !d.source_status;
  banner.textContent = d.source_status || "";
}

// ---------------------------------------------------------------- polling
async function poll() {
  try {
    const r = await fetch(`/api/cluster?since=${state.seq}`, { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const d = await r.json();
    if (d.seq < state.seq) state.points = [];  // the dashboard restarted
    for (const p of d.history) state.points.push(p);
    if (state.points.length > MAX_POINTS) state.points.splice(0, state.points.length - MAX_POINTS);
    state.seq = d.seq;
    state.interval = d.interval || 1;
    state.data = d;
    state.lastOk = Date.now();
    state.failing = false;
    document.title = d.title;
    render();
    document.body.dataset.seq = String(d.seq);
  } catch (e) {
    state.failing = true;
    $("banner").hidden = false;
    $("banner").textContent = `cannot reach the dashboard server (${e.message}); retrying`;
  }
  const live = $("live");
  live.className = "live " + (state.failing ? "err" : "ok");
  $("live-text").textContent = state.failing ? "disconnected" : `live · every ${state.interval}s`;
  setTimeout(poll, state.interval * 1000);
}

$("ops").addEventListener("click", (ev) => {
  const b = ev.target.closest("button[data-op]");
  if (!b) return;
  state.op = b.dataset.op;
  for (const x of $("ops").querySelectorAll("button")) x.classList.toggle("on", x === b);
  render();
});
window.addEventListener("resize", render);
legend($("tier-legend"), TIERS.map(([k, l]) => [k, l, COLOR[k]]));
legend($("moves-legend"), MOVES);
legend($("bw-legend"), PATHS);
legend($("source-legend"), SOURCES);
poll();
