// The console's charts (uPlot, vendored at build time into /admin/ui/vendor/) and the two views drawn from the
// gateway's in-memory series (GET /admin/series): workers (one line each, with a small chart) and live
// (per model, the last 15 minutes, the current figures under them).
//
// Each chart keeps one uPlot instance for its lifetime and is given new data on every refresh; its container
// carries data-points (how many points its first series has), which the browser tests read.
"use strict";

(() => {
  const { $, el, api, fmt, stamp, replaceRows, addView, setVersion } = window.GatewayConsole;
  const COLORS = ["#1f6feb", "#c4262e", "#9a6700", "#1a7f37", "#8250df", "#0a7ea4"];
  const charts = new Map(); // key -> uPlot

  // -- the library, or why it is missing -----------------------------------------------------------

  function chartsAvailable() {
    if (typeof window.uPlot === "function") return true;
    const notice = $("charts-missing");
    notice.textContent = `Charts are unavailable: ${window.gatewayConsoleMissing || "the charting library did not load"}.`;
    notice.hidden = false;
    return false;
  }

  const present = (values) => values.filter((v) => v !== null && v !== undefined).length;
  const missing = (v) => v === null || v === undefined;

  // A point between two gaps (a percentile seen in one interval only) has no line to show it: a dot does.
  function isolated(u, seriesIdx) {
    const values = u.data[seriesIdx];
    const out = [];
    for (let i = 0; i < values.length; i++) {
      if (!missing(values[i]) && missing(values[i - 1]) && missing(values[i + 1])) out.push(i);
    }
    return out;
  }

  // A chart in `container` (created on first use) showing `data` = [x, ...series]; `series` = [{label, unit}].
  function drawChart(key, container, data, series, { width = 390, height = 170, title = "", bars = false, compact = false } = {}) {
    container.dataset.points = String(present(data[1] || []));
    if (!chartsAvailable()) return null;
    let chart = charts.get(key);
    if (chart && chart.series.length !== series.length + 1) {
      chart.destroy();
      chart = undefined;
    }
    if (!chart) {
      // Bars side by side: the first series left of its period's tick, the second right of it.
      const barPaths = (i) => (bars && uPlot.paths.bars
        ? uPlot.paths.bars({ size: [0.35, 30, 1], align: i === 0 ? -1 : 1 }) : undefined);
      chart = new uPlot({
        width, height, title,
        cursor: { show: !compact },
        padding: compact ? [4, 4, 4, 4] : undefined,
        legend: { show: !compact },
        scales: { x: { time: true, range: bars ? barRange : undefined }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
        axes: compact ? [{ show: false }, { show: false }] : [{}, { size: 60 }],
        series: [{}, ...series.map((s, i) => ({
          label: s.label, stroke: COLORS[i % COLORS.length], width: compact ? 1.5 : 2,
          fill: bars ? COLORS[i % COLORS.length] : undefined, paths: barPaths(i),
          points: { show: !bars, size: 5, filter: isolated },
          value: (u, v) => (v === null || v === undefined ? "-" : `${Number(v).toFixed(s.digits ?? 2)}${s.unit || ""}`),
        }))],
      }, data, container);
      charts.set(key, chart);
    } else {
      chart.setData(data);
    }
    if (chart.root.parentNode !== container) container.replaceChildren(chart.root);
    return chart;
  }

  // Bars stand beside their period's tick: leave half a period free at both ends so none is cut.
  function barRange(u, min, max) {
    const t = u.data[0];
    const step = t.length > 1 ? t[1] - t[0] : 3600;
    return [min - step * 0.6, max + step * 0.6];
  }

  const ms = (values) => values.map((v) => (v === null ? null : v * 1000));
  const pct = (values) => values.map((v) => (v === null ? null : v * 100));

  function showSpan(series) {
    chartsAvailable(); // says so at once when the library is missing, even before there is data
    for (const span of document.querySelectorAll(".series-span")) {
      const seconds = series.points * series.interval_s;
      span.textContent = seconds >= 120 ? `${Math.round(seconds / 60)} min` : `${Math.round(seconds)} s`;
    }
    $("series-interval").textContent = String(series.interval_s);
  }

  // -- workers -------------------------------------------------------------------------------------

  function workerState(w) {
    if (!w.healthy) return el("span", { class: "bad" }, "unhealthy");
    if (!w.available) return el("span", { class: "warn" }, `ejected (${w.ejected_for_s.toFixed(1)} s)`);
    return el("span", { class: "ok" }, "healthy");
  }

  // What a worker caches (the KV blocks indexed from its cache events, w.kv_blocks) and which adapters
  // it holds (w.adapters); a dash where the gateway does not know.

  function workerRow(w, series, t) {
    const spark = el("td", { class: "spark", dataset: { chart: "worker" } });
    const s = series.workers[w.url];
    if (s) {
      drawChart(`worker:${w.url}`, spark, [t, s.in_flight, s.errors_per_s],
        [{ label: "in flight", digits: 0 }, { label: "errors/s" }], { width: 180, height: 36, compact: true });
    }
    return el("tr", { dataset: { worker: w.url } },
      el("td", {}, el("code", {}, w.url)),
      el("td", { class: "state" }, workerState(w)),
      el("td", { class: "num" }, w.in_flight),
      spark,
      el("td", { class: "num" }, w.ejections),
      el("td", { class: "num" }, w.consecutive_failures),
      el("td", {}, w.last_error || "-"),
      el("td", {}, Object.entries(w.errors).map(([k, n]) => `${k}: ${n}`).join(", ") || "-"),
      el("td", { class: "num" }, w.checked_ago_s === null ? "-" : `${w.checked_ago_s.toFixed(1)} s ago`),
      el("td", { class: "held", title: "KV blocks indexed from the worker's cache events, and its recent hit rate" },
        w.kv_blocks == null ? "-" : `${w.kv_blocks}` + (w.kv_hit_rate == null ? "" : ` (${(100 * w.kv_hit_rate).toFixed(0)}% hit)`)),
      el("td", { class: "held adapters", title: "LoRA adapters the worker holds" }, (w.adapters || []).map((a) =>
        a.name + (a.state === "loading" ? " (loading)" : a.pinned ? " (pinned)" : "")).join(", ") || "-"));
  }

  const WORKER_HEADINGS = ["worker", "state", "in flight", "in flight, errors/s", "ejections", "failures in a row",
    "last error", "upstream errors", "last check", "cached blocks", "adapters"];

  async function refreshWorkers() {
    const [data, series] = await Promise.all([api("GET", "/admin/workers"), api("GET", "/admin/series")]);
    showSpan(series);
    const blocks = data.models.map((model) =>
      el("div", { class: "model" },
        el("h3", {}, model.model, " ",
          el("span", { class: "muted small model-load" }, `${model.in_flight} in flight, ${model.queued} queued`)),
        el("table", {},
          el("thead", {}, el("tr", {}, ...WORKER_HEADINGS.map((h) => el("th", {}, h)))),
          el("tbody", {}, ...model.workers.map((w) => workerRow(w, series, series.t))))));
    $("workers").replaceChildren(...blocks);
    stamp("workers-updated");
  }

  // -- live figures --------------------------------------------------------------------------------

  const LIVE_CHARTS = [
    ["traffic", "Requests, errors and refusals (/s)", (s) => [s.requests_per_s, s.errors_per_s, s.refusals_per_s],
      [{ label: "requests/s" }, { label: "errors/s" }, { label: "refusals/s" }]],
    ["ttft", "Time to first token (ms)", (s) => [ms(s.ttft_p50_s), ms(s.ttft_p95_s), ms(s.ttft_p99_s)],
      [{ label: "p50", unit: " ms", digits: 1 }, { label: "p95", unit: " ms", digits: 1 }, { label: "p99", unit: " ms", digits: 1 }]],
    ["latency", "Latency (ms)", (s) => [ms(s.latency_p50_s), ms(s.latency_p95_s), ms(s.latency_p99_s)],
      [{ label: "p50", unit: " ms", digits: 1 }, { label: "p95", unit: " ms", digits: 1 }, { label: "p99", unit: " ms", digits: 1 }]],
    ["tokens", "Tokens/s", (s) => [s.tokens_per_s], [{ label: "tokens/s", digits: 1 }]],
    ["load", "In flight and queued", (s) => [s.in_flight, s.queued],
      [{ label: "in flight", digits: 0 }, { label: "queued", digits: 0 }]],
    ["cache", "Cache hit rate (%)", (s) => [pct(s.cache_hit_rate)], [{ label: "hit rate", unit: " %", digits: 1 }]],
  ];

  function modelCharts(model) {
    let block = $("live-charts").querySelector(`div.model-charts[data-model="${CSS.escape(model)}"]`);
    if (!block) {
      block = el("div", { class: "model-charts", dataset: { model } }, el("h3", {}, model),
        el("div", { class: "chart-grid" }, ...LIVE_CHARTS.map(([name]) => el("div", { class: "chart", dataset: { chart: name } }))));
      $("live-charts").append(block);
    }
    return block;
  }

  function drawLive(series) {
    for (const [model, s] of Object.entries(series.models)) {
      const block = modelCharts(model);
      for (const [name, title, pick, labels] of LIVE_CHARTS) {
        const container = block.querySelector(`div.chart[data-chart="${name}"]`);
        drawChart(`live:${model}:${name}`, container, [series.t, ...pick(s)], labels, { title });
      }
    }
  }

  function liveRow(model, s) {
    return el("tr", { dataset: { model } },
      el("td", {}, model),
      el("td", { class: "num" }, fmt.num(s.requests_per_s)),
      el("td", { class: "num" }, fmt.num(s.errors_per_s)),
      el("td", { class: "num" }, fmt.num(s.refusals_per_s)),
      el("td", { class: "num" }, fmt.num(s.tokens_per_s, 1)),
      el("td", { class: "num" }, s.in_flight),
      el("td", { class: "num" }, s.queued),
      el("td", { class: "num" }, fmt.pct(s.cache_hit_rate)),
      ...["ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "latency_p50_s", "latency_p95_s", "latency_p99_s"]
        .map((k) => el("td", { class: "num" }, fmt.ms(s[k]))));
  }

  async function refreshLive() {
    const [data, series] = await Promise.all([api("GET", "/admin/stats"), api("GET", "/admin/series")]);
    showSpan(series);
    drawLive(series);
    $("live-window").textContent = data.window_s.toFixed(1);
    $("live-refusals").textContent = fmt.num(data.safety_refusals_per_s);
    replaceRows($("live-table").tBodies[0], Object.entries(data.models).map(([model, s]) => liveRow(model, s)));
    setVersion(data.config_version);
    stamp("live-updated");
  }

  addView("workers", refreshWorkers, { poll: true });
  addView("live", refreshLive, { poll: true });
  window.GatewayCharts = Object.freeze({ drawChart, chartsAvailable });
})();
