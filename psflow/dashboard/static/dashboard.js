// The psflow dashboard page: polls /api/cluster once a second and redraws.
// Element ids and data-* attributes are stable: tests read them (tests/test_dashboard_browser.py).
"use strict";

const POLL_MS = 1000;
const EVENT_COLORS = {
  worker_lost: "#c53030", worker_back: "#2f855a", worker_replaced: "#dd6b20",
  closure_requeued: "#d69e2e", ps_lost: "#9b2c2c", ps_back: "#38a169", ps_restored: "#38a169",
  checkpoint_written: "#3182ce", training_started: "#4a5568", epoch_end: "#a0aec0",
  training_ended: "#4a5568",
};
const colorOf = (kind) => EVENT_COLORS[kind] || "#718096";

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : Math.round(n)} ${units[i]}`;
}
const fmtRate = (v, bytes) => (v === null || v === undefined) ? "-"
  : bytes ? `${fmtBytes(v)}/s` : fmtNum(v);
function fmtAge(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  return seconds < 1 ? "now" : `${seconds.toFixed(0)} s ago`;
}
function fmtDuration(s) {
  if (s === null || s === undefined) return "-";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h ${m}m` : m ? `${m}m ${sec}s` : `${sec}s`;
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function stateCell(tr, state) {
  const td = cell(tr, state, "state");
  td.setAttribute("data-state", state);
  return td;
}

function renderWorkers(workers) {
  const body = document.querySelector("#worker-table tbody");
  body.replaceChildren(...workers.map((w) => {
    const tr = document.createElement("tr");
    tr.setAttribute("data-task", w.task);
    tr.setAttribute("data-state", w.state);
    cell(tr, w.task);
    stateCell(tr, w.state).title = w.error || "";
    cell(tr, w.pid === null ? "-" : String(w.pid));
    cell(tr, String(w.closures_run), "num");
    cell(tr, String(w.closures_failed), "num");
    cell(tr, String(w.closures_requeued), "num");
    cell(tr, String(w.restarts), "num");
    cell(tr, fmtAge(w.heartbeat_age_seconds));
    return tr;
  }));
}

function renderPS(ps) {
  const body = document.querySelector("#ps-table tbody");
  body.replaceChildren(...ps.map((p) => {
    const tr = document.createElement("tr");
    tr.setAttribute("data-task", p.task);
    tr.setAttribute("data-state", p.state);
    cell(tr, p.task);
    stateCell(tr, p.state).title = p.error || "";
    cell(tr, String(p.variables), "num");
    cell(tr, fmtBytes(p.variable_bytes), "num");
    cell(tr, fmtRate(p.pushes_per_second), "num");
    cell(tr, fmtRate(p.pulls_per_second), "num");
    cell(tr, fmtRate(p.bytes_in_per_second, true), "num");
    cell(tr, fmtRate(p.bytes_out_per_second, true), "num");
    cell(tr, fmtBytes(p.bytes_in), "num");
    cell(tr, fmtBytes(p.bytes_out), "num");
    cell(tr, String(p.pushes_applied), "num");
    cell(tr, String(p.pushes_duplicate), "num");
    const td = cell(tr, "");
    if (p.staleness_histogram.length) {
      barsInline(td, p.staleness_histogram.map((b) => ({label: `staleness ${b.staleness}`,
                                                         value: b.count})));
      td.appendChild(document.createTextNode(` max ${p.max_staleness}`));
    } else {
      td.textContent = "-";
    }
    return tr;
  }));
}

function renderTraining(t) {
  const facts = [
    ["state", t.state],
    ["epoch", t.epochs === null ? `${t.epoch}` : `${Math.min(t.epoch + 1, t.epochs)}/${t.epochs}`],
    ["step", t.steps_per_epoch ? `${t.step_in_epoch}/${t.steps_per_epoch}` : `${t.step_in_epoch}`],
    ["global step", String(t.global_step)],
    ["steps/s", fmtNum(t.steps_per_second)],
    ["ETA", t.state === "running" ? fmtDuration(t.eta_seconds) : "-"],
    ["elapsed", fmtDuration(t.elapsed_seconds)],
  ];
  const box = document.getElementById("training");
  box.setAttribute("data-state", t.state);
  box.replaceChildren(...facts.map(([k, v]) => {
    const span = document.createElement("span");
    span.className = "fact";
    span.setAttribute("data-fact", k);
    const b = document.createElement("b");
    b.textContent = v;
    span.append(`${k} `, b);
    return span;
  }));
  const stepKeys = new Set();
  for (const p of t.steps) for (const k of Object.keys(p)) if (/loss/.test(k)) stepKeys.add(k);
  const lossChart = lineChart(document.getElementById("loss-chart"), [...stepKeys].sort().map(
    (k) => ({name: k, points: t.steps.map((p) => [p.step, p[k] === undefined ? null : p[k]])})),
    {xLabel: "step"});
  lossChart.setAttribute("data-last-step",
                         String(t.steps.length ? t.steps[t.steps.length - 1].step : 0));
  lossChart.id = "loss-svg";
  const epochKeys = new Set();
  for (const e of t.epoch_logs) for (const k of Object.keys(e)) epochKeys.add(k);
  epochKeys.delete("epoch");
  lineChart(document.getElementById("epoch-chart"), [...epochKeys].sort().map((k) => ({
    name: k, points: t.epoch_logs.map((e) => [e.epoch + 1, e[k] === undefined ? null : e[k]]),
  })), {xLabel: "epoch"});
}

function renderEvents(events, doc) {
  const list = document.getElementById("events");
  const shown = events.filter((e) => e.kind !== "epoch_end").slice(-30).reverse();
  list.replaceChildren(...shown.map((e) => {
    const li = document.createElement("li");
    li.setAttribute("data-kind", e.kind);
    li.setAttribute("data-task", e.task);
    const dot = document.createElement("span");
    dot.className = "dot";
    dot.style.background = colorOf(e.kind);
    const when = document.createElement("time");
    when.textContent = new Date(e.time * 1000).toLocaleTimeString();
    li.append(dot, when, ` ${e.kind.replace(/_/g, " ")} `, Object.assign(
      document.createElement("b"), {textContent: e.task}), ` ${e.message}`);
    return li;
  }));
  timeline(document.getElementById("timeline"), events, doc.time - doc.uptime_seconds,
           doc.time, colorOf);
}

function render(doc) {
  renderTraining(doc.training);
  renderWorkers(doc.workers);
  renderPS(doc.ps);
  renderEvents(doc.events, doc);
  const lost = doc.workers.filter((w) => w.state === "lost").length +
               doc.ps.filter((p) => p.state === "lost").length;
  document.getElementById("summary").textContent =
    `${doc.ps.length} ps, ${doc.workers.length} workers` + (lost ? `, ${lost} lost` : "") +
    ` \u00b7 training ${doc.training.state}`;
  const status = document.getElementById("status");
  status.textContent = `updated ${new Date(doc.time * 1000).toLocaleTimeString()}`;
  status.setAttribute("data-state", "live");
  document.body.setAttribute("data-rounds", String(doc.probe_rounds));
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const reply = await fetch("/api/cluster" + window.location.search,
                              {cache: "no-store", credentials: "same-origin"});
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    render(await reply.json());
  } catch (err) {
    status.textContent = `no answer from the chief (${err.message}); retrying`;
    status.setAttribute("data-state", "offline");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
