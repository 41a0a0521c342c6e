// elastron's web UI: sweeps. #/sweeps lists the tenant's sweeps; #/sweeps/<id> shows one: its
// trials (state, values, metric, job), the best trial highlighted, every trial's metric curve on
// one chart (the best drawn thick), one scatter per varied field (its value against the trial's
// metric), and a link that opens the trials' jobs in the compare view (#/compare?jobs=...).
// Loaded before app.js, whose helpers (api, esc, view, ready, refreshLater, drawChart) it uses
// when its views run.
"use strict";

const SWEEP_FINAL = ["completed", "cancelled"];

async function showSweeps() {
  const { sweeps } = await api("/v1/sweeps");
  view.innerHTML = `
    <h1>Sweeps</h1>
    <table id="sweeps"><thead><tr><th>Sweep</th><th>State</th><th>Trials</th><th>Best</th><th>Rank-hours</th></tr></thead><tbody>
    ${sweeps.map((s) => `
      <tr class="sweep-row" data-id="${esc(s.id)}"><td><a href="#/sweeps/${esc(s.id)}">${esc(s.name)}</a> <span class="muted">${esc(s.id)}</span></td>
        <td>${esc(s.state)}</td><td class="num">${s.trials_started}</td>
        <td class="num">${s.best ? formatNumber(s.best.value) : "–"}</td><td class="num">${s.gpu_hours.toFixed(3)}</td></tr>`).join("")
      || '<tr><td colspan="5" class="muted">No sweep yet: elastron sweep submit FILE (README, "Hyperparameter sweeps").</td></tr>'}
    </tbody></table>`;
  ready();
}

function trialColor(t, best) {
  return best && t.number === best.number ? "#d6336c" : COLORS[t.number % COLORS.length];
}

async function showSweep(id) {
  const sweep = await api(`/v1/sweeps/${encodeURIComponent(id)}`);
  const best = sweep.best;
  const fields = Object.keys(sweep.spec.search_space || {});
  const jobs = sweep.trials.filter((t) => t.job_id).map((t) => t.job_id);
  view.innerHTML = `
    <div id="sweep-page">
      <div class="toolbar"><h1>${esc(sweep.name)}</h1>${stateBadge(sweep.state)}
        ${jobs.length ? `<a id="compare-trials" href="#/compare?jobs=${jobs.map(encodeURIComponent).join(",")}">Compare the trials' jobs</a>` : ""}</div>
      <div class="facts" id="sweep-facts">
        <div><span>Sweep id</span>${esc(sweep.id)}</div>
        <div><span>Metric</span>${esc(sweep.metric.name)} (${esc(sweep.metric.direction)})</div>
        <div><span>Trials</span>${sweep.trials.length} / ${sweep.spec.budget.max_trials}</div>
        <div><span>Sampler / pruner</span>${esc(sweep.spec.sampler.name)} / ${esc(sweep.spec.pruner.name)}</div>
        <div><span>Rank-hours</span>${sweep.gpu_hours.toFixed(3)}</div>
        <div data-fact="best"><span>Best</span>${best ? `#${best.number}: ${formatNumber(best.value)}` : "–"}</div>
      </div>
      ${sweep.message ? `<p class="muted">${esc(sweep.message)}</p>` : ""}
      <h2>Trials</h2>
      <table id="trials"><thead><tr><th>#</th><th>State</th>${fields.map((f) => `<th>${esc(f)}</th>`).join("")}<th>${esc(sweep.metric.name)}</th><th>Iteration</th><th>Job</th></tr></thead><tbody>
      ${sweep.trials.map((t) => `
        <tr class="trial-row${best && t.number === best.number ? " best" : ""}" data-number="${t.number}" data-state="${esc(t.state)}">
          <td class="num"><i class="swatch" style="background:${trialColor(t, best)}"></i>${t.number}</td><td title="${esc(t.message || "")}">${esc(t.state)}</td>
          ${fields.map((f) => `<td class="num">${esc(typeof t.params[f] === "number" ? formatNumber(t.params[f]) : t.params[f])}</td>`).join("")}
          <td class="num">${formatNumber(t.value)}</td><td class="num">${t.iteration || ""}</td>
          <td>${t.job_id ? `<a href="#/jobs/${esc(t.job_id)}">${esc(t.job_id)}</a>` : `<span class="muted">${esc(t.message || "")}</span>`}</td></tr>`).join("")
        || `<tr><td colspan="${fields.length + 5}" class="muted">No trial drawn yet.</td></tr>`}
      </tbody></table>
      <h2>Curves</h2>
      <div class="charts"><div class="chart"><h3>${esc(sweep.metric.name)} per trial</h3><canvas id="sweep-curves"></canvas></div>
      ${fields.map((f, k) => `<div class="chart"><h3>${esc(sweep.metric.name)} against ${esc(f)}</h3><canvas id="sweep-param-${k}" data-field="${esc(f)}"></canvas></div>`).join("")}</div>
    </div>`;
  drawChart(document.getElementById("sweep-curves"), {
    noLabels: true,
    series: sweep.trials.map((t) => ({ label: `#${t.number}`, color: trialColor(t, best), points: t.history })),
  });
  fields.forEach((f, k) => {
    const numeric = sweep.trials.filter((t) => t.value !== null && typeof t.params[f] === "number");
    const choices = [...new Set(sweep.trials.map((t) => String(t.params[f])))];
    const x = (t) => (typeof t.params[f] === "number" ? t.params[f] : choices.indexOf(String(t.params[f])));
    const scored = numeric.length ? numeric : sweep.trials.filter((t) => t.value !== null);
    drawChart(document.getElementById(`sweep-param-${k}`), {
      noLabels: true,
      series: scored.map((t) => ({ label: `#${t.number}`, color: trialColor(t, best), dots: true, points: [[x(t), t.value]] })),
    });
  });
  ready();
  if (!SWEEP_FINAL.includes(sweep.state)) refreshLater(() => showSweep(id).catch(showError));
}
