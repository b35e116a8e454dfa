// The psflow dashboard page: polls /api/cluster once a second and redraws.
// Element ids and data-* attributes are stable: tests read them (tests/test_dashboard_browser.py).
"use strict";

const POLL_MS = 1000;
const EVENT_COLORS = {
  worker_lost: "#c53030", worker_back: "#2f855a", worker_replaced: "#dd6b20",
  closure_requeued: "#d69e2e", ps_lost: "#9b2c2c", ps_back: "#38a169", ps_restored: "#38a169",
  checkpoint_written: "#3182ce", training_started: "#4a5568", epoch_end: "#a0aec0",
  training_ended: "#4a5568", task_exited: "#742a2a", membership_changed: "#6b46c1",
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

// A task's state; under psflow local, how its process ended ("killed by SIGKILL (exit 137)").
function stateCell(tr, task) {
  const e = task.exit;
  const text = !e ? task.state
    : task.state === "killed" ? `killed (${e.signal}, exit ${e.status})`
    : task.state === "exited" ? `exited (${e.status})`
    : `${task.state} (${e.description})`;
  const td = cell(tr, text, "state");
  td.setAttribute("data-state", task.state);
  if (task.exit && task.exit.signal) td.setAttribute("data-signal", task.exit.signal);
  td.title = task.error || "";
  return td;
}

function renderWorkers(workers) {
  const body = document.querySelector("#worker-table tbody");
  body.replaceChildren(...workers.map((w) => {
    const tr = document.createElement("tr");
    tr.setAttribute("data-task", w.task);
    tr.setAttribute("data-state", w.state);
    cell(tr, w.task);
    stateCell(tr, w);
    cell(tr, w.pid === null ? "-" : String(w.pid));
    cell(tr, String(w.closures_run), "num");
    cell(tr, String(w.closures_failed), "num");
    cell(tr, String(w.closures_requeued), "num");
    cell(tr, String(w.restarts), "num");
    cell(tr, fmtAge(w.heartbeat_age_seconds));
    return tr;
  }));
}

// Every PS task's dynamic table shards: rows by tier, hit rate, disk traffic.
function renderTables(ps) {
  const rows = ps.flatMap((p) => (p.tables || []).map((t) => [p.task, t]));
  document.getElementById("tables-section").hidden = rows.length === 0;
  const body = document.querySelector("#tables-table tbody");
  body.replaceChildren(...rows.map(([task, t]) => {
    const tr = document.createElement("tr");
    tr.setAttribute("data-task", task);
    tr.setAttribute("data-table", t.table);
    cell(tr, task);
    cell(tr, t.table);
    cell(tr, fmtNum(t.rows), "num");
    cell(tr, fmtNum(t.memory_rows), "num");
    cell(tr, fmtNum(t.disk_rows), "num");
    cell(tr, `${(100 * t.hit_rate).toFixed(1)}%`, "num");
    cell(tr, fmtBytes(t.disk_bytes_read), "num");
    cell(tr, fmtBytes(t.disk_bytes_written), "num");
    cell(tr, fmtBytes(t.disk_bytes), "num");
    return tr;
  }));
}

// A multi-worker group's generation and members (absent in a PS job's document).
function renderMembership(m) {
  const box = document.getElementById("membership");
  if (!m) { box.hidden = true; return; }
  box.hidden = false;
  box.setAttribute("data-generation", m.generation === null ? "" : String(m.generation));
  box.setAttribute("data-members", m.members.join(","));
  box.textContent = m.generation === null ? "group: forming"
    : `group generation ${m.generation}: ${m.members.join(", ")} ` +
      `(${m.members.length} workers, ${m.changes} membership change${m.changes === 1 ? "" : "s"})`;
}

function renderPS(ps) {
  const body = document.querySelector("#ps-table tbody");
  body.replaceChildren(...ps.map((p) => {
    const tr = document.createElement("tr");
    tr.setAttribute("data-task", p.task);
    tr.setAttribute("data-state", p.state);
    cell(tr, p.task);
    stateCell(tr, p);
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
  // Each step's own loss (batch_*), derived from Keras's running mean of the epoch.
  const stepKeys = new Set();
  for (const p of t.steps) for (const k of Object.keys(p)) if (/^batch_.*loss/.test(k)) stepKeys.add(k);
  const lossChart = lineChart(document.getElementById("loss-chart"), [...stepKeys].sort().map(
    (k) => ({name: `${k.slice("batch_".length)} of the batch`,
             points: t.steps.map((p) => [p.step, p[k] === undefined ? null : p[k]])})),
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
    const message = Object.assign(document.createElement("span"),
                                  {className: "message", textContent: ` ${e.message}`});
    li.append(dot, when, ` ${e.kind.replace(/_/g, " ")} `, Object.assign(
      document.createElement("b"), {textContent: e.task}), message);
    // The whole error when the message quotes only its start.
    const error = e.data && typeof e.data.error === "string" ? e.data.error : null;
    if (error && !e.message.includes(error)) {
      const details = document.createElement("details");
      details.append(Object.assign(document.createElement("summary"), {textContent: "full error"}),
                     Object.assign(document.createElement("pre"), {textContent: error}));
      li.append(details);
    }
    return li;
  }));
  timeline(document.getElementById("timeline"), events, doc.time - doc.uptime_seconds,
           doc.time, colorOf);
}

// What psflow local said: the job finished (exit codes), or a task died with restarts off.
function renderJob(job) {
  const box = document.getElementById("job");
  if (!job || (!job.finished && !job.hint)) {
    box.hidden = true;
    box.removeAttribute("data-finished");
    return;
  }
  box.hidden = false;
  box.setAttribute("data-finished", String(job.finished));
  const codes = Object.entries(job.exit_codes).map(([t, c]) => `${t}=${c}`).join(", ");
  const parts = [];
  if (job.finished) {
    parts.push(`job finished, exit codes ${codes || "-"}; this is its final state, ` +
               "served by psflow local until it exits");
  }
  if (job.hint) parts.push(job.hint);
  box.textContent = parts.join(" \u00b7 ");
}

function render(doc) {
  renderJob(doc.job);
  renderTraining(doc.training);
  renderWorkers(doc.workers);
  renderMembership(doc.membership);
  renderPS(doc.ps);
  renderTables(doc.ps);
  renderEvents(doc.events, doc);
  const lost = doc.workers.filter((w) => w.state === "lost").length +
               doc.ps.filter((p) => p.state === "lost").length;
  document.getElementById("summary").textContent =
    `${doc.ps.length} ps, ${doc.workers.length} workers` + (lost ? `, ${lost} lost` : "") +
    ` \u00b7 training ${doc.training.state}`;
  const status = document.getElementById("status");
  const finished = doc.job && doc.job.finished;
  status.textContent = finished ? "job finished"
    : `updated ${new Date(doc.time * 1000).toLocaleTimeString()}`;
  status.setAttribute("data-state", finished ? "finished" : "live");
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
