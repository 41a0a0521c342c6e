// elastron's web UI: the same /v1 API and bearer token as every other client. The token lives
// in this tab's sessionStorage only. Views are chosen by the URL's hash: #/ (jobs), #/jobs/<id>
// (one job, refreshed while it runs), #/compare?jobs=a,b,c[&x=iteration|tokens|time], #/queue (waiting jobs and the cluster's use), #/submit,
// #/sweeps and #/sweeps/<id> (sweeps.js). When a view has drawn its data it sets
// window.elastronReady (ms since navigation start): the browser tests read it.
"use strict";

const TOKEN_KEY = "elastron-token";
// The job states and the final ones, as service/states.py defines them (/ui/config, read first).
let STATES = [];
let FINAL = [];
const REFRESH_MS = 3000;
const view = document.getElementById("view");
let timer = null;
let config = {};
const selected = new Set(); // job ids ticked in the list, for Compare

const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const token = () => sessionStorage.getItem(TOKEN_KEY);

class ApiError extends Error {
  constructor(status, detail) {
    super(typeof detail === "string" ? detail : JSON.stringify(detail));
    this.status = status;
    this.detail = detail;
  }
}

async function api(path, options = {}) {
  const headers = { Authorization: `Bearer ${token()}`, ...(options.headers || {}) };
  const response = await fetch(path, { ...options, headers });
  const text = await response.text();
  let body = text;
  try { body = text ? JSON.parse(text) : null; } catch (_) { /* plain text (logs) */ }
  if (response.status === 401) {
    signOut("Your token was refused (invalid or revoked): sign in again.");
    throw new ApiError(401, body && body.detail);
  }
  if (!response.ok) throw new ApiError(response.status, body && body.detail !== undefined ? body.detail : body);
  return body;
}

function ready() {
  window.elastronReady = performance.now();
}

function stopRefresh() {
  if (timer) clearTimeout(timer);
  timer = null;
}

function refreshLater(fn) {
  stopRefresh();
  timer = setTimeout(fn, REFRESH_MS);
}

// -- sign in ------------------------------------------------------------------------------------
function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  stopRefresh();
  document.getElementById("nav").hidden = true;
  view.innerHTML = "";
  document.getElementById("signin").hidden = false;
  document.getElementById("signin-error").textContent = message || "";
}

document.getElementById("signin-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const value = document.getElementById("token").value.trim();
  const response = await fetch("/v1/jobs?limit=1", { headers: { Authorization: `Bearer ${value}` } });
  if (response.status === 401) {
    document.getElementById("signin-error").textContent = "Sign-in failed: invalid or revoked token.";
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, value);
  document.getElementById("token").value = "";
  route();
});
document.getElementById("signout").addEventListener("click", () => signOut(""));

// -- jobs list ----------------------------------------------------------------------------------
function stateBadge(state) {
  return `<span class="state state-${esc(state)}">${esc(state)}</span>`;
}

function duration(job) {
  if (!job.started_at) return "";
  const end = job.finished_at ? Date.parse(job.finished_at) : Date.now();
  const s = Math.max(0, Math.round((end - Date.parse(job.started_at)) / 1000));
  return s >= 3600 ? `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m` : s >= 60 ? `${Math.floor(s / 60)}m ${s % 60}s` : `${s}s`;
}

function seconds(s) {
  if (s === null || s === undefined) return "–";
  s = Math.round(s);
  return s >= 3600 ? `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m` : s >= 60 ? `${Math.floor(s / 60)}m ${s % 60}s` : `${s}s`;
}

function progress(job) {
  const done = job.iteration || 0;
  const pct = 100 * (job.progress ?? 0);
  const eta = job.eta_s === null || job.eta_s === undefined ? "" : ` <span class="muted eta">ETA ${seconds(job.eta_s)}</span>`;
  return `<span class="progress"><div style="width:${pct.toFixed(1)}%"></div></span>${done}/${job.train_iters}${eta}`;
}

async function showJobs(filter) {
  const query = new URLSearchParams({ limit: "100" });
  if (filter) query.set("state", filter);
  const [page, queue] = await Promise.all([api(`/v1/jobs?${query}`), api("/v1/queue?limit=1")]);
  const c = queue.cluster;
  const cluster = c ? `cluster: ${c.nodes} nodes, CPUs ${c.allocated_cpus}/${c.cpus}, GPUs ${c.allocated_gpus}/${c.gpus} allocated` : "";
  const options = ["", ...STATES].map((s) => `<option value="${s}" ${s === filter ? "selected" : ""}>${s || "all states"}</option>`).join("");
  const rows = page.jobs.map((j) => `
    <tr class="job-row" data-id="${esc(j.id)}">
      <td class="pick"><input type="checkbox" class="pick-job" value="${esc(j.id)}" ${selected.has(j.id) ? "checked" : ""} aria-label="select for compare"></td>
      <td>${esc(j.name)}<div class="muted">${esc(j.id)}</div></td>
      <td>${stateBadge(j.state)}${j.waiting_reason ? `<div class="muted">${j.queue_position ? "#" + j.queue_position + ": " : ""}${esc(j.waiting_reason)}</div>` : ""}</td>
      <td>${j.ranks ?? ""} <span class="muted">${esc(j.layout || "")}</span></td>
      <td>${progress(j)}</td>
      <td class="num">${formatNumber(j.loss)}</td>
      <td class="num">${j.tokens_per_s === null ? "–" : Math.round(j.tokens_per_s).toLocaleString()}</td>
      <td class="num">${j.mfu === null ? "–" : (100 * j.mfu).toFixed(1) + "%"}</td>
      <td>${j.started_at ? new Date(j.started_at).toLocaleString() : ""}</td>
      <td>${duration(j)}</td>
    </tr>`).join("");
  view.innerHTML = `
    <div class="toolbar"><h1>Jobs</h1>
      <select id="state-filter">${options}</select>
      <span class="muted">${page.jobs.length} shown${page.next_cursor ? " (newest 100)" : ""}; refreshes every ${REFRESH_MS / 1000} s</span>
      <button id="compare" type="button">Compare selected</button>
      <span class="muted" id="cluster-use">${esc(cluster)}</span>
    </div>
    <table id="jobs-table">
      <thead><tr><th></th><th>Name</th><th>State</th><th>Ranks / layout</th><th>Iteration</th><th>Loss</th><th>Tokens/s</th><th>MFU</th><th>Started</th><th>Duration</th></tr></thead>
      <tbody>${rows || '<tr><td colspan="10" class="muted">No jobs yet: submit one.</td></tr>'}</tbody>
    </table>`;
  document.getElementById("state-filter").addEventListener("change", (e) => { location.hash = e.target.value ? `#/?state=${e.target.value}` : "#/"; });
  view.querySelectorAll("tr.job-row").forEach((tr) => tr.addEventListener("click", (e) => {
    if (!e.target.closest("td.pick")) location.hash = `#/jobs/${tr.dataset.id}`;
  }));
  const compare = document.getElementById("compare");
  const count = () => { compare.disabled = selected.size < 2; compare.textContent = `Compare selected (${selected.size})`; };
  view.querySelectorAll("input.pick-job").forEach((box) => box.addEventListener("change", () => {
    box.checked ? selected.add(box.value) : selected.delete(box.value);
    count();
  }));
  compare.addEventListener("click", () => { location.hash = `#/compare?jobs=${[...selected].map(encodeURIComponent).join(",")}`; });
  count();
  ready();
  refreshLater(() => showJobs(filter).catch(showError));
}

// -- queue --------------------------------------------------------------------------------------
function usageBar(label, used, total, id) {
  const pct = total > 0 ? Math.min(100, (100 * used) / total) : 0;
  return `<div class="usage" id="${id}" data-used="${used}" data-total="${total}"><span>${esc(label)}</span>
    <span class="progress wide"><div style="width:${pct.toFixed(1)}%"></div></span>${formatNumber(used)} / ${formatNumber(total)} allocated (${pct.toFixed(0)}%)</div>`;
}

async function showQueue() {
  const queue = await api("/v1/queue?limit=500");
  const c = queue.cluster;
  const use = c
    ? `<div class="facts" id="cluster">${usageBar("CPUs", c.allocated_cpus, c.cpus, "use-cpus")}${usageBar("GPUs", c.allocated_gpus, c.gpus, "use-gpus")}
       <div><span>Alive nodes</span>${c.nodes}</div><div><span>Read</span>${c.read_at ? new Date(c.read_at).toLocaleTimeString() : "–"}</div></div>`
    : '<p class="muted" id="cluster">Cluster capacity unknown: the scheduler has not read it yet (is Ray reachable?).</p>';
  const rows = queue.jobs.map((j) => `
    <tr class="job-row queue-row" data-id="${esc(j.id)}">
      <td class="num">${j.position ?? "–"}</td>
      <td>${esc(j.name)}<div class="muted">${esc(j.id)}</div></td>
      <td>${esc(j.tenant)}</td><td class="num">${j.priority}</td><td class="num">${j.ranks ?? ""}</td>
      <td class="reason">${esc(j.waiting_reason || "not scheduled yet")}</td>
      <td>${seconds(j.waited_s)}</td>
    </tr>`).join("");
  view.innerHTML = `
    <div class="toolbar"><h1>Queue</h1><span class="muted">${queue.jobs.length} waiting, in the scheduler's order; refreshes every ${REFRESH_MS / 1000} s</span></div>
    <h2>Cluster use</h2>${use}
    <h2>Waiting jobs</h2>
    <table id="queue-table">
      <thead><tr><th>#</th><th>Name</th><th>Tenant</th><th>Priority</th><th>Ranks</th><th>Why it waits</th><th>Waited</th></tr></thead>
      <tbody>${rows || '<tr><td colspan="7" class="muted">No job is waiting.</td></tr>'}</tbody>
    </table>`;
  view.querySelectorAll("tr.queue-row").forEach((tr) => tr.addEventListener("click", () => { location.hash = `#/jobs/${tr.dataset.id}`; }));
  ready();
  refreshLater(() => showQueue().catch(showError));
}

// -- compare ------------------------------------------------------------------------------------
// Several jobs' curves on shared axes, one colour per job on every chart, and the spec fields
// that differ. Each job's records come downsampled by the server, as for one job's page.
const COMPARE = [
  ["loss", "Loss (train: line, valid: dots)", (r) => num(r.loss), (r) => num(r.valid_loss)],
  ["throughput", "Tokens/s", (r) => num(r.tokens_per_s)],
  ["mfu", "MFU", (r) => num(r.mfu)],
  ["step", "Step time (s)", (r) => num(r.step_time_s)],
  ["lr", "Learning rate", (r) => num(r.lr)],
];
const AXES = {
  iteration: ["iteration", (r) => r.iteration, String],
  tokens: ["tokens consumed", (r, job) => {
    const seq = job.spec && job.spec.model && job.spec.model.seq_length;
    return typeof r.consumed_samples === "number" && seq ? r.consumed_samples * seq : r.iteration * (num(r.tokens) ?? 0);
  }, formatNumber],
  time: ["wall time", (r, job, first) => (typeof r.ts === "number" && typeof first.ts === "number" ? r.ts - first.ts : null), seconds],
};

function flatten(value, prefix = "", out = {}) {
  if (value && typeof value === "object" && !Array.isArray(value)) {
    for (const [k, v] of Object.entries(value)) flatten(v, prefix ? `${prefix}.${k}` : k, out);
  } else if (prefix) {
    out[prefix] = JSON.stringify(value);
  }
  return out;
}

function specDiff(jobs) {
  const flat = jobs.map((j) => flatten(j.spec || {}));
  const fields = [...new Set(flat.flatMap((f) => Object.keys(f)))].sort();
  return fields.filter((f) => new Set(flat.map((x) => (f in x ? x[f] : "(unset)"))).size > 1)
    .map((f) => [f, flat.map((x) => (f in x ? JSON.parse(x[f]) : undefined))]);
}

async function showCompare(ids, axis) {
  axis = AXES[axis] ? axis : "iteration";
  const runs = await Promise.all(ids.map(async (id, k) => {
    const [job, metrics] = await Promise.all([
      api(`/v1/jobs/${encodeURIComponent(id)}`),
      api(`/v1/jobs/${encodeURIComponent(id)}/metrics?max_points=500`),
    ]);
    return { job, records: metrics.records, color: COLORS[k % COLORS.length] };
  }));
  const query = (a) => `#/compare?jobs=${ids.map(encodeURIComponent).join(",")}&x=${a}`;
  if (!document.getElementById("compare-page") || view.dataset.compare !== ids.join(",")) {
    view.dataset.compare = ids.join(",");
    view.innerHTML = `
      <div id="compare-page">
        <div class="toolbar"><h1>Compare ${ids.length} jobs</h1>
          <label>x axis <select id="axis">${Object.entries(AXES).map(([k, [label]]) => `<option value="${k}">${label}</option>`).join("")}</select></label></div>
        <div class="legend" id="legend"></div>
        <div class="charts">${COMPARE.map(([cid, title]) => `<div class="chart"><h3>${esc(title)}</h3><canvas id="cmp-${cid}"></canvas></div>`).join("")}</div>
        <h2>Spec fields that differ</h2>
        <table id="diff"><thead></thead><tbody></tbody></table>
      </div>`;
    document.getElementById("axis").addEventListener("change", (e) => { location.hash = query(e.target.value); });
  }
  document.getElementById("axis").value = axis;
  document.getElementById("legend").innerHTML = runs.map((r) => `
    <a class="legend-item" href="#/jobs/${esc(r.job.id)}" data-id="${esc(r.job.id)}" data-color="${r.color}"><i style="background:${r.color}"></i>${esc(r.job.name)} <span class="muted">${esc(r.job.id)} · ${esc(r.job.state)}</span></a>`).join("");
  const [, x, xFormat] = AXES[axis];
  for (const [cid, , y, dots] of COMPARE) {
    const series = [];
    for (const r of runs) {
      const first = r.records[0] || {};
      const at = (rec) => x(rec, r.job, first);
      series.push({ label: r.job.name, color: r.color, points: r.records.map((rec) => [at(rec), y(rec)]).filter((p) => p[0] !== null) });
      if (dots) series.push({ label: `${r.job.name} valid`, color: r.color, dots: true, points: r.records.map((rec) => [at(rec), dots(rec)]).filter((p) => p[0] !== null) });
    }
    drawChart(document.getElementById(`cmp-${cid}`), { series, xFormat, noLabels: true, empty: axis === "time" ? "no timestamps in these records" : undefined });
  }
  const diff = specDiff(runs.map((r) => r.job));
  document.querySelector("#diff thead").innerHTML = `<tr><th>Field</th>${runs.map((r) => `<th><i class="swatch" style="background:${r.color}"></i>${esc(r.job.name)}</th>`).join("")}</tr>`;
  document.querySelector("#diff tbody").innerHTML = diff.map(([field, values]) => `
    <tr data-field="${esc(field)}"><td>${esc(field)}</td>${values.map((v) => `<td>${v === undefined ? '<span class="muted">unset</span>' : esc(JSON.stringify(v))}</td>`).join("")}</tr>`).join("")
    || `<tr><td colspan="${runs.length + 1}" class="muted">The specs are the same.</td></tr>`;
  ready();
  if (runs.some((r) => !FINAL.includes(r.job.state))) refreshLater(() => showCompare(ids, axis).catch(showError));
}

// -- one job ------------------------------------------------------------------------------------
const CHARTS = [
  ["loss", "Loss (train, valid)", (r) => [["train", r.map((x) => [x.iteration, num(x.loss)])], ["valid", r.map((x) => [x.iteration, num(x.valid_loss)]), true]]],
  ["throughput", "Tokens/s", (r) => [["tokens/s", r.map((x) => [x.iteration, num(x.tokens_per_s)])]]],
  ["mfu", "MFU", (r) => [["MFU", r.map((x) => [x.iteration, num(x.mfu)])]]],
  ["step", "Step time (s), forward-backward min/max over ranks", (r) => [["step", r.map((x) => [x.iteration, num(x.step_time_s)])]], (r) => r.filter((x) => x.timers && x.timers["forward-backward"]).map((x) => [x.iteration, x.timers["forward-backward"][0], x.timers["forward-backward"][1]])],
  ["lr", "Learning rate", (r) => [["lr", r.map((x) => [x.iteration, num(x.lr)])]]],
  ["energy", "Energy per step (J)", (r) => [["J", r.map((x) => [x.iteration, num(x.energy_j)])]], null, "energy unavailable on this hardware"],
];

const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);

function drawCharts(records) {
  for (const [id, , make, band, empty] of CHARTS) {
    const series = make(records).map(([label, points, dots]) => ({ label, points, dots }));
    drawChart(document.getElementById(`chart-${id}`), { series, band: band ? band(records) : null, empty });
  }
}

// Each rank's own step time as a bar; a straggler (slower than the median rank by more than 25 %
// over about the last 10 logged steps: service/stragglers.py) in red, with its ratio.
function drawRanks(job) {
  const box = document.getElementById("ranks");
  const times = job.rank_step_s || [];
  if (!times.length) {
    box.innerHTML = '<p class="muted">No per-rank times yet (they come with the timers, every training.log_interval steps, for 2 to 512 ranks).</p>';
    return;
  }
  const top = Math.max(...times) || 1;
  const slow = new Set(job.stragglers || []);
  const ratio = job.rank_slowness || [];
  const flag = slow.size
    ? `<p class="straggler-flag" id="straggler-flag">Straggler${slow.size > 1 ? "s" : ""}: ${[...slow].map((r) => `rank ${r} (${(ratio[r] ?? 0).toFixed(2)}x the median)`).join(", ")}</p>`
    : '<p class="muted" id="straggler-flag">No straggler.</p>';
  box.innerHTML = flag + times.map((t, r) => `
    <div class="rank-bar${slow.has(r) ? " straggler" : ""}" data-rank="${r}" data-seconds="${t}">
      <span class="rank-name">rank ${r}</span><span class="bar"><i style="width:${((100 * t) / top).toFixed(1)}%"></i></span>
      <span class="num">${(1000 * t).toFixed(1)} ms${ratio[r] !== undefined ? ` · ${ratio[r].toFixed(2)}x` : ""}</span></div>`).join("");
}

// The job's evaluations (GET /v1/jobs/{id}/evals): one chart per task, a line per metric over
// the evaluated checkpoints' iterations (those with scores: only a finished, successful evaluation
// has them), and a row per evaluation.
function drawEvals(evals) {
  const done = evals.filter((e) => e.results);
  const tasks = [...new Set(done.flatMap((e) => Object.keys(e.results)))].sort();
  const box = document.getElementById("eval-charts");
  const ids = tasks.map((t) => `eval-chart-${t.replace(/[^A-Za-z0-9_-]/g, "_")}`);
  if (box.dataset.tasks !== tasks.join(",")) {
    box.dataset.tasks = tasks.join(",");
    box.innerHTML = tasks.length
      ? tasks.map((t, k) => `<div class="chart"><h3>${esc(t)}</h3><canvas id="${ids[k]}" data-task="${esc(t)}"></canvas></div>`).join("")
      : '<p class="muted">No evaluation yet (POST /v1/jobs/{id}/checkpoints/{iteration}/evals, or evaluation.on_checkpoint in the job file).</p>';
  }
  tasks.forEach((task, k) => {
    const metrics = [...new Set(done.flatMap((e) => Object.keys(e.results[task] || {})))].sort();
    const series = metrics.map((m) => ({
      label: m,
      dots: true,
      points: done.filter((e) => e.results[task] && num(e.results[task][m]) !== null)
        .map((e) => [e.iteration, e.results[task][m]]).sort((a, b) => a[0] - b[0]),
    }));
    drawChart(document.getElementById(ids[k]), { series });
  });
  document.querySelector("#evals tbody").innerHTML = evals.map((e) => `
    <tr data-eval="${esc(e.id)}"><td>${e.iteration}</td><td>${esc(e.tasks.join(", "))}</td><td>${esc(e.status)}</td><td>${esc(e.message || "")}</td></tr>`).join("") || '<tr><td colspan="4" class="muted">none yet</td></tr>';
}

async function showJob(id) {
  const [job, metrics, events, checkpoints, evals] = await Promise.all([
    api(`/v1/jobs/${encodeURIComponent(id)}`),
    api(`/v1/jobs/${encodeURIComponent(id)}/metrics?max_points=500`),
    api(`/v1/jobs/${encodeURIComponent(id)}/events?limit=500`),
    api(`/v1/jobs/${encodeURIComponent(id)}/checkpoints`),
    api(`/v1/jobs/${encodeURIComponent(id)}/evals`),
  ]);
  if (!document.getElementById("job-page") || view.dataset.job !== id) {
    view.dataset.job = id;
    view.innerHTML = `
      <div id="job-page">
        <div class="toolbar"><h1 id="job-title"></h1><span id="job-state"></span>
          <button id="cancel" class="danger" type="button">Cancel</button><span id="cancel-result" class="muted"></span></div>
        <div class="facts" id="facts"></div>
        <h2>Per rank: forward-backward time of the last logged step</h2><div id="ranks" class="ranks"></div>
        <h2>Charts</h2>
        <div class="charts">${CHARTS.map(([cid, title]) => `<div class="chart"><h3>${esc(title)}</h3><canvas id="chart-${cid}"></canvas></div>`).join("")}</div>
        <h2>Evaluations</h2><div class="charts" id="eval-charts"></div>
        <table id="evals"><thead><tr><th>Iteration</th><th>Tasks</th><th>Status</th><th>Message</th></tr></thead><tbody></tbody></table>
        <div class="columns">
          <div><h2>Events</h2><ul class="timeline" id="events"></ul></div>
          <div><h2>Checkpoints</h2><table id="checkpoints"><thead><tr><th>Iteration</th><th>Result</th><th>Size</th><th>Seconds</th><th>Where</th></tr></thead><tbody></tbody></table></div>
        </div>
        <h2>Driver log (tail)</h2><pre id="log" class="muted">loading…</pre>
        <h2>Spec as run</h2><pre id="spec"></pre>
      </div>`;
    document.getElementById("cancel").addEventListener("click", () => cancelJob(id));
    loadLog(id);
  }
  document.getElementById("job-title").textContent = job.name;
  document.getElementById("job-state").innerHTML = stateBadge(job.state);
  document.getElementById("cancel").hidden = FINAL.includes(job.state);
  const last = job.last_metrics || {};
  const facts = [
    ["Job id", job.id], ["Ranks / layout", `${job.ranks ?? ""} ${job.layout || ""}`],
    ["Iteration", `${job.iteration ?? 0} / ${job.train_iters}`],
    ["Progress", `${(100 * (job.progress ?? 0)).toFixed(1)}%`], ["ETA", seconds(job.eta_s)],
    ["Loss", formatNumber(num(last.loss))],
    ["Tokens/s", num(last.tokens_per_s) === null ? "–" : Math.round(last.tokens_per_s).toLocaleString()],
    ["MFU", num(last.mfu) === null ? "–" : (100 * last.mfu).toFixed(1) + "%"],
    ["Restarts", job.restarts], ["Time restarting", seconds(job.restart_s)], ["Started", job.started_at ? new Date(job.started_at).toLocaleString() : "–"],
    ["Duration", duration(job) || "–"],
  ];
  if (job.failure_cause) facts.push(["Failure cause", job.failure_cause]);
  document.getElementById("facts").innerHTML = facts.map(([k, v]) => `<div data-fact="${esc(k)}"><span>${esc(k)}</span>${esc(v)}</div>`).join("");
  drawRanks(job);
  drawCharts(metrics.records);
  drawEvals(evals.evals);
  document.getElementById("events").innerHTML = events.events.map((e) => `
    <li><b>${esc(e.kind)}</b> <span class="muted">${e.time ? new Date(e.time).toLocaleTimeString() : ""}${e.iteration !== null ? " · iteration " + e.iteration : ""}</span><br>${esc(e.message || "")}</li>`).join("") || '<li class="muted">none yet</li>';
  document.querySelector("#checkpoints tbody").innerHTML = checkpoints.checkpoints.map((c) => `
    <tr><td>${c.iteration ?? ""}</td><td>${esc(c.result)}</td><td class="num">${c.bytes === null ? "" : (c.bytes / 1048576).toFixed(1) + " MiB"}</td><td class="num">${c.seconds === null ? "" : c.seconds.toFixed(2)}</td><td>${esc(c.uri || "")}</td></tr>`).join("") || '<tr><td colspan="5" class="muted">none yet</td></tr>';
  document.getElementById("spec").textContent = JSON.stringify(job.spec, null, 2);
  ready();
  if (!FINAL.includes(job.state)) refreshLater(() => showJob(id).then(() => loadLog(id)).catch(showError));
}

// Terminal control codes (Ray colours its prefixes): CSI sequences (colours, cursor moves), OSC
// sequences (titles, links), lone escapes and carriage returns (progress bars redraw with them).
const stripAnsi = (text) => text
  .replace(/\x1b\[[0-9;?]*[ -\/]*[@-~]/g, "")
  .replace(/\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)/g, "")
  .replace(/\x1b[@-Z\\-_]?/g, "")
  .replace(/\r(?!\n)/g, "\n")
  .replace(/\r/g, "");

async function loadLog(id) {
  const pre = document.getElementById("log");
  if (!pre) return;
  try {
    const text = await api(`/v1/jobs/${encodeURIComponent(id)}/logs`);
    const lines = stripAnsi(String(text || "")).split("\n");
    pre.textContent = lines.slice(-60).join("\n") || "(empty: the job has not started on Ray yet)";
  } catch (err) {
    pre.textContent = `log unavailable: ${err.message}`;
  }
}

async function cancelJob(id) {
  if (!confirm("Cancel this job? A running job is stopped gracefully (its last checkpoint stays).")) return;
  try {
    const job = await api(`/v1/jobs/${encodeURIComponent(id)}/cancel`, { method: "POST" });
    document.getElementById("cancel-result").textContent = job.state === "cancelled" ? "cancelled" : "stopping…";
    showJob(id).catch(showError);
  } catch (err) {
    document.getElementById("cancel-result").textContent = err.message;
  }
}

// -- submit -------------------------------------------------------------------------------------
function showSubmit() {
  view.innerHTML = `
    <h1>Submit a job</h1>
    <p class="muted">Paste a job file (YAML or JSON, as for <code>elastron train</code>) or choose one. <code>elastron schema</code> prints every field.</p>
    <p><input type="file" id="job-file" accept=".yaml,.yml,.json"></p>
    <textarea id="job-text" spellcheck="false" placeholder="name: my-job&#10;training:&#10;  train_iters: 20"></textarea>
    <p><button id="submit" type="button">Submit</button></p>
    <div id="submit-errors"></div>`;
  document.getElementById("job-file").addEventListener("change", async (e) => {
    const file = e.target.files[0];
    if (file) document.getElementById("job-text").value = await file.text();
  });
  document.getElementById("submit").addEventListener("click", submitJob);
  ready();
}

function showProblems(detail) {
  const box = document.getElementById("submit-errors");
  const items = Array.isArray(detail)
    ? detail.map((d) => `<li class="problem"><b>${esc((d.loc || []).filter((p) => p !== "body").join("."))}</b> ${esc(d.msg)}</li>`)
    : [`<li class="problem">${esc(detail)}</li>`];
  box.innerHTML = `<ul class="problems">${items.join("")}</ul>`;
}

async function submitJob() {
  const text = document.getElementById("job-text").value;
  try {
    const parsed = await api("/ui/parse-job", { method: "POST", headers: { "Content-Type": "text/plain" }, body: text });
    const job = await api("/v1/jobs", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(parsed.spec) });
    location.hash = `#/jobs/${job.id}`;
  } catch (err) {
    if (err.status !== 401) showProblems(err.detail ?? err.message);
  }
}

// -- routing ------------------------------------------------------------------------------------
function showError(err) {
  if (err && err.status === 401) return;
  view.innerHTML = `<p class="error">${esc(err && err.message)}</p>`;
  ready();
}

function renderLinks() {
  const links = [];
  if (config.ray_dashboard_url) links.push(`<a href="${esc(config.ray_dashboard_url)}" target="_blank" rel="noopener">Ray dashboard</a>`);
  if (config.grafana_url) links.push(`<a href="${esc(config.grafana_url)}" target="_blank" rel="noopener">Grafana</a>`);
  document.getElementById("links").innerHTML = links.join("");
}

function route() {
  stopRefresh();
  if (!token()) return signOut("");
  document.getElementById("signin").hidden = true;
  document.getElementById("nav").hidden = false;
  const hash = location.hash || "#/";
  const job = hash.match(/^#\/jobs\/([^/?]+)/);
  if (job) return showJob(decodeURIComponent(job[1])).catch(showError);
  view.dataset.job = "";
  if (hash.startsWith("#/compare")) {
    const params = new URLSearchParams(hash.split("?")[1] || "");
    const ids = (params.get("jobs") || "").split(",").map((s) => s.trim()).filter(Boolean);
    if (!ids.length) { view.innerHTML = '<p class="error">Compare needs jobs: #/compare?jobs=a,b (or tick jobs in the list).</p>'; return ready(); }
    return showCompare(ids, params.get("x")).catch(showError);
  }
  view.dataset.compare = "";
  if (hash.startsWith("#/submit")) return showSubmit();
  if (hash.startsWith("#/queue")) return showQueue().catch(showError);
  const sweep = hash.match(/^#\/sweeps\/([^/?]+)/);
  if (sweep) return showSweep(decodeURIComponent(sweep[1])).catch(showError);
  if (hash.startsWith("#/sweeps")) return showSweeps().catch(showError);
  const state = new URLSearchParams(hash.split("?")[1] || "").get("state") || "";
  return showJobs(state).catch(showError);
}

window.addEventListener("hashchange", route);
fetch("/ui/config")
  .then((r) => r.json())
  .then((c) => { config = c; STATES = c.states || []; FINAL = c.final_states || []; renderLinks(); })
  .catch(() => {})
  .finally(route);
