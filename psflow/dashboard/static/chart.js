// Tiny SVG charts for the psflow dashboard: a line chart, inline bars, a timeline.
// No dependencies; every function replaces the content of the element it is given.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#2b6cb0", "#c05621", "#2f855a", "#9b2c2c", "#6b46c1", "#b7791f"];

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

function fmtNum(v) {
  if (v === null || v === undefined || !isFinite(v)) return "-";
  const a = Math.abs(v);
  if (a !== 0 && (a < 0.01 || a >= 1e5)) return v.toExponential(2);
  return Number(v.toPrecision(4)).toString();
}

// series: [{name, points: [[x, y], ...]}]; nulls in y are skipped.
function lineChart(container, series, opts) {
  const o = Object.assign({width: 460, height: 200, xLabel: ""}, opts || {});
  const pad = {l: 52, r: 10, t: 10, b: 28};
  const svg = svgEl("svg", {viewBox: `0 0 ${o.width} ${o.height}`, class: "line-chart",
                            role: "img"});
  let xs = [], ys = [], total = 0;
  for (const s of series) for (const [x, y] of s.points) {
    if (y === null || !isFinite(y)) continue;
    xs.push(x); ys.push(y); total++;
  }
  svg.setAttribute("data-points", String(total));
  if (total === 0) {
    svg.appendChild(svgEl("text", {x: o.width / 2, y: o.height / 2, "text-anchor": "middle",
                                   class: "empty"}, "no data yet"));
    container.replaceChildren(svg);
    return svg;
  }
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += Math.abs(y1) * 0.1 || 1; y0 -= Math.abs(y0) * 0.1 || 1; }
  const W = o.width - pad.l - pad.r, H = o.height - pad.t - pad.b;
  const sx = (x) => pad.l + (x - x0) / (x1 - x0) * W;
  const sy = (y) => pad.t + (1 - (y - y0) / (y1 - y0)) * H;
  svg.appendChild(svgEl("rect", {x: pad.l, y: pad.t, width: W, height: H, class: "frame"}));
  for (const [y, label] of [[y0, fmtNum(y0)], [(y0 + y1) / 2, fmtNum((y0 + y1) / 2)],
                            [y1, fmtNum(y1)]]) {
    svg.appendChild(svgEl("line", {x1: pad.l, x2: pad.l + W, y1: sy(y), y2: sy(y),
                                   class: "grid"}));
    svg.appendChild(svgEl("text", {x: pad.l - 4, y: sy(y) + 4, "text-anchor": "end",
                                   class: "tick"}, label));
  }
  svg.appendChild(svgEl("text", {x: pad.l, y: o.height - 8, class: "tick"}, fmtNum(x0)));
  svg.appendChild(svgEl("text", {x: pad.l + W, y: o.height - 8, "text-anchor": "end",
                                 class: "tick"}, fmtNum(x1)));
  svg.appendChild(svgEl("text", {x: pad.l + W / 2, y: o.height - 8, "text-anchor": "middle",
                                 class: "tick"}, o.xLabel));
  series.forEach((s, i) => {
    const pts = s.points.filter(([, y]) => y !== null && isFinite(y));
    if (!pts.length) return;
    const color = PALETTE[i % PALETTE.length];
    const d = pts.map(([x, y], j) => `${j ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`);
    svg.appendChild(svgEl("path", {d: d.join(""), class: "series", stroke: color,
                                   "data-series": s.name}));
    if (pts.length === 1) {
      svg.appendChild(svgEl("circle", {cx: sx(pts[0][0]), cy: sy(pts[0][1]), r: 3,
                                       fill: color}));
    }
    svg.appendChild(svgEl("text", {x: pad.l + 6, y: pad.t + 14 + 14 * i, fill: color,
                                   class: "legend"}, s.name));
  });
  container.replaceChildren(svg);
  return svg;
}

// Inline bars for a histogram: [{label, value}], e.g. staleness -> count.
function barsInline(container, bars) {
  const w = 120, h = 24;
  const svg = svgEl("svg", {viewBox: `0 0 ${w} ${h}`, class: "bars", width: w, height: h});
  const max = Math.max(1, ...bars.map((b) => b.value));
  const bw = bars.length ? w / bars.length : w;
  bars.forEach((b, i) => {
    const bh = Math.max(1, b.value / max * (h - 2));
    const rect = svgEl("rect", {x: i * bw + 1, y: h - bh, width: Math.max(1, bw - 2),
                                height: bh});
    rect.appendChild(svgEl("title", {}, `${b.label}: ${b.value}`));
    svg.appendChild(rect);
  });
  container.replaceChildren(svg);
  return svg;
}

// events: [{time, kind, task, message}] on a time axis from t0 to t1 (epoch seconds).
function timeline(container, events, t0, t1, colorOf) {
  const width = 940, height = 44;
  const svg = svgEl("svg", {viewBox: `0 0 ${width} ${height}`, class: "timeline"});
  if (t1 <= t0) t1 = t0 + 1;
  const sx = (t) => 8 + (t - t0) / (t1 - t0) * (width - 16);
  svg.appendChild(svgEl("line", {x1: 8, x2: width - 8, y1: 30, y2: 30, class: "axis"}));
  for (const e of events) {
    const g = svgEl("g", {"data-kind": e.kind});
    g.appendChild(svgEl("line", {x1: sx(e.time), x2: sx(e.time), y1: 8, y2: 30,
                                 stroke: colorOf(e.kind), "stroke-width": 2}));
    g.appendChild(svgEl("title", {}, `${new Date(e.time * 1000).toLocaleTimeString()} ` +
                                     `${e.task}: ${e.message}`));
    svg.appendChild(g);
  }
  svg.appendChild(svgEl("text", {x: 8, y: 42, class: "tick"},
                        new Date(t0 * 1000).toLocaleTimeString()));
  svg.appendChild(svgEl("text", {x: width - 8, y: 42, "text-anchor": "end", class: "tick"},
                        new Date(t1 * 1000).toLocaleTimeString()));
  container.replaceChildren(svg);
  return svg;
}
