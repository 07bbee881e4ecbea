// The dashboard page: polls /api/status, fills the totals and the islands table, and draws two uPlot
// charts (loss and eval loss vs tokens per island, departed ones in grey; swarm tokens/s over time). window.dashboard holds
// the latest status and the number of updates drawn (tests wait on it).
"use strict";

const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                 "#bcbd22", "#393b79"];
const GREY = "#9aa3b2";  // departed islands
// colours: given to each island (row key) when first seen and kept, so that they never shift
const dashboard = { updates: 0, status: null, charts: {}, colors: {}, error: null };
window.dashboard = dashboard;

const $ = (id) => document.getElementById(id);
const fmt = (v, digits = 3) => (v === null || v === undefined ? "-" : Number(v).toFixed(digits));
const big = (v) => (v === null || v === undefined ? "-" : Math.round(v).toLocaleString("en-US"));
const tokens = (v) => (v >= 1e6 ? (v / 1e6).toFixed(2) + "M" : v >= 1e3 ? (v / 1e3).toFixed(1) + "k" : String(v));

function colorOf(key) {
  if (!(key in dashboard.colors)) {
    dashboard.colors[key] = PALETTE[Object.keys(dashboard.colors).length % PALETTE.length];
  }
  return dashboard.colors[key];
}

// a series with one or two points has no line to draw: show its points
const fewPoints = (u, si) => u.data[si].filter((v) => v !== null && v !== undefined).length <= 2;

function chartWidth(el) {
  return Math.max(300, el.clientWidth - 4);
}

// (Re)build a chart when its series change (an island came or went), else just give it new data.
function draw(key, el, seriesKey, makeOpts, data) {
  let chart = dashboard.charts[key];
  if (chart && chart._seriesKey !== seriesKey) {
    chart.destroy();
    chart = null;
  }
  if (!chart) {
    chart = new uPlot(makeOpts(chartWidth(el)), data, el);
    chart._seriesKey = seriesKey;
    dashboard.charts[key] = chart;
  } else {
    chart.setData(data);
  }
}

function drawLoss(history, names, departed) {
  const tables = [];
  const series = [{ label: "tokens", value: (u, v) => (v === null ? "-" : tokens(v)) }];
  for (const name of names) {
    const h = history.islands[name];
    // an eval loss is drawn where it changed (the record repeats the latest one)
    const evals = h.eval_loss.map((v, i) => (i > 0 && v === h.eval_loss[i - 1] ? null : v));
    tables.push([h.tokens, h.loss, evals]);
    const stroke = departed.has(name) ? GREY : colorOf(name);
    series.push({ label: `${name} loss`, stroke, width: 1.5, spanGaps: true, points: { show: fewPoints, fill: stroke } });
    series.push({ label: `${name} eval`, stroke, width: 1.5, dash: [6, 4], spanGaps: true,
                  points: { show: true, size: 5, fill: stroke } });
  }
  const data = tables.length ? uPlot.join(tables) : [[], ...series.slice(1).map(() => [])];
  const key = names.map((name) => name + (departed.has(name) ? ":departed" : "")).join(",");
  draw("loss", $("chart-loss"), key, (width) => ({
    width, height: 300, series,
    scales: { x: { time: false } },
    axes: [{ label: "tokens", values: (u, ticks) => ticks.map(tokens) }, { label: "loss (nats)", size: 60 }],
  }), data);
}

function drawSpeed(history) {
  const data = [history.swarm.time, history.swarm.tokens_per_second];
  draw("speed", $("chart-speed"), "speed", (width) => ({
    width, height: 300,
    series: [{}, { label: "swarm tokens/s", stroke: "#1f77b4", width: 2, fill: "rgba(31,119,180,0.08)",
                   points: { show: fewPoints }, value: (u, v) => big(v) }],
    axes: [{}, { label: "tokens/s", size: 70, values: (u, ticks) => ticks.map(big) }],
  }), data);
}

// seconds this island's clock is ahead of the swarm's (negative: behind)
function clock(offset) {
  return offset == null ? "-" : `${offset >= 0 ? "+" : "-"}${Math.abs(offset).toFixed(2)} s`;
}

// how the island takes part in rounds (docs/DESIGN.md, "Islands behind NAT")
const NETWORK = { public: "public", nat: "NAT (client)", client: "client", unknown: "?" };

// why the others flagged an island ("-" when nobody did): docs/SECURITY.md
let FLAGS = {};

function row(island) {
  const tr = document.createElement("tr");
  tr.dataset.island = island.key;
  if (island.departed) tr.className = "departed";
  const seen = island.departed ? `departed ${Math.round(island.departed_s)}s ago` : `${Math.round(island.last_seen_s)}s ago`;
  const cells = [
    island.key, island.device, island.departed ? "departed" : island.state, big(island.inner_step),
    tokens(island.tokens), big(island.tokens_per_second), fmt(island.loss), fmt(island.eval_loss),
    island.fragment_versions.join(","), `${island.rounds_ok}/${island.rounds_failed}`, fmt(island.utilization),
    fmt(island.bytes_per_token, 1), clock(island.clock_offset), NETWORK[island.reachability] || "?", seen,
    FLAGS[island.key] || "-",
  ];
  cells.forEach((text, i) => {
    const td = document.createElement("td");
    if (i === 0) {
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = island.departed ? GREY : colorOf(island.key);
      td.appendChild(swatch);
    }
    td.appendChild(document.createTextNode(text));
    tr.appendChild(td);
  });
  return tr;
}

function render(status) {
  const t = status.totals;
  $("run-id").textContent = `run ${status.run_id}`;
  $("t-islands").textContent = t.islands_alive;
  $("t-speed").textContent = big(t.tokens_per_second);
  $("t-tokens").textContent = tokens(t.tokens_so_far);
  $("t-goodput").textContent = fmt(t.goodput);
  $("t-rounds").textContent = `${t.rounds_ok} / ${t.rounds_failed}`;
  $("t-bytes").textContent = fmt(t.bytes_per_token, 1);
  $("t-refused").textContent = t.refused ?? "-";
  FLAGS = t.flag_reasons || {};
  const flagged = Object.keys(FLAGS).sort();
  $("t-flagged").textContent = flagged.length ? flagged.map((name) => `${name} (${FLAGS[name]})`).join(", ") : "-";
  const names = Object.keys(status.history.islands).sort();
  const body = document.querySelector("#islands tbody");
  names.forEach(colorOf);
  body.replaceChildren(...status.islands.map(row));
  drawLoss(status.history, names, new Set(status.islands.filter((i) => i.departed).map((i) => i.key)));
  drawSpeed(status.history);
  const live = $("live");
  const age = status.updated ? status.time - status.updated : null;
  live.textContent = status.updated
    ? `live: records read ${new Date(status.updated * 1000).toLocaleTimeString()}` : "waiting for the first read…";
  live.className = age !== null && age < 3 * status.poll_seconds + 5 ? "live" : "live stale";
}

function problem(text) {
  dashboard.error = text;
  const live = $("live");
  live.textContent = text;
  live.className = "live stale";
}

async function tick() {
  let status = null;
  try {
    const response = await fetch("/api/status", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    status = await response.json();
  } catch (e) {
    problem(`dashboard unreachable (${e}); retrying…`);
    setTimeout(tick, 3000);
    return;
  }
  try {
    dashboard.status = status;
    render(status);
    dashboard.updates += 1;
    dashboard.error = null;
  } catch (e) {
    console.error(e);
    problem(`could not draw the latest data (${e})`);
  }
  // twice per read of the records: what the dashboard read is on the page half a period later at most
  setTimeout(tick, Math.max(250, 500 * status.poll_seconds));
}

window.addEventListener("resize", () => {
  for (const [key, chart] of Object.entries(dashboard.charts)) {
    chart.setSize({ width: chartWidth($(`chart-${key}`)), height: 300 });
  }
});
tick();
