// A small line chart on a canvas: no library, nothing fetched from the internet. A chart is
// series of [x, y] points (null y = gap) plus an optional band (a min/max area under a line).
// The canvas keeps its point count in data-points (the first series') and every series' label,
// colour and point count in data-series (JSON), so a test can check what was drawn. A series may
// name its colour (the compare view keeps one colour per job on every chart); spec.xFormat formats
// the x axis' two labels.
"use strict";

const COLORS = ["#3559e0", "#e0703b", "#2f9e6b", "#9b51e0", "#d6336c", "#0b8a9f", "#8a6d1f", "#495057"];

function drawChart(canvas, spec) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 400, height = canvas.clientHeight || 180;
  canvas.width = width * dpr;
  canvas.height = height * dpr;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const series = spec.series.filter((s) => s.points.some((p) => p[1] !== null));
  canvas.dataset.points = String(spec.series.length ? spec.series[0].points.filter((p) => p[1] !== null).length : 0);
  canvas.dataset.series = JSON.stringify(spec.series.map((s, k) => ({
    label: s.label, color: s.color || COLORS[k % COLORS.length], points: s.points.filter((p) => p[1] !== null).length,
  })));
  const all = series.flatMap((s) => s.points.filter((p) => p[1] !== null));
  if (spec.band) all.push(...spec.band.filter((b) => b[1] !== null).flatMap((b) => [[b[0], b[1]], [b[0], b[2]]]));
  ctx.fillStyle = "#6b7385";
  ctx.font = "11px system-ui, sans-serif";
  if (!all.length) {
    ctx.fillText(spec.empty || "no data yet", 10, height / 2);
    return;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.05 || 1; y1 += Math.abs(y1) * 0.05 || 1; }
  const left = 58, right = 10, top = 8, bottom = 22;
  const sx = (x) => left + ((x - x0) / (x1 - x0)) * (width - left - right);
  const sy = (y) => top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom);
  ctx.strokeStyle = "#e3e6ec";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    ctx.beginPath();
    ctx.moveTo(left, sy(y));
    ctx.lineTo(width - right, sy(y));
    ctx.stroke();
    ctx.fillText(formatNumber(y), 4, sy(y) + 4);
  }
  const xText = spec.xFormat || String;
  ctx.fillText(xText(x0), left, height - 6);
  const last = xText(x1);
  ctx.fillText(last, width - right - ctx.measureText(last).width, height - 6);
  if (spec.band) {
    const band = spec.band.filter((b) => b[1] !== null);
    if (band.length) {
      ctx.fillStyle = "rgba(53, 89, 224, 0.15)";
      ctx.beginPath();
      band.forEach((b, i) => (i ? ctx.lineTo(sx(b[0]), sy(b[2])) : ctx.moveTo(sx(b[0]), sy(b[2]))));
      band.slice().reverse().forEach((b) => ctx.lineTo(sx(b[0]), sy(b[1])));
      ctx.closePath();
      ctx.fill();
    }
  }
  series.forEach((s, k) => {
    ctx.strokeStyle = s.color || COLORS[k % COLORS.length];
    ctx.fillStyle = s.color || COLORS[k % COLORS.length];
    ctx.lineWidth = 1.6;
    ctx.beginPath();
    let pen = false;
    for (const [x, y] of s.points) {
      if (y === null) { pen = false; continue; }
      pen ? ctx.lineTo(sx(x), sy(y)) : ctx.moveTo(sx(x), sy(y));
      pen = true;
    }
    ctx.stroke();
    if (s.dots) s.points.forEach(([x, y]) => y !== null && ctx.fillRect(sx(x) - 2, sy(y) - 2, 4, 4));
    if (!spec.noLabels) ctx.fillText(s.label, left + 6 + k * 90, top + 10);
  });
}

function formatNumber(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  if (a >= 100) return v.toFixed(0);
  return v.toPrecision(4);
}
