// The usage view: one tenant's or key's requests, refusals and tokens per UTC hour or day over the last
// days, from the tenancy plugin's admin action `usage_history` (the same JSON an operator can fetch), charted,
// tabled, and downloadable as CSV built from that JSON, row for row.
"use strict";

(() => {
  const { $, el, api, replaceRows, addView, tenancy } = window.GatewayConsole;
  const { drawChart } = window.GatewayCharts;
  const FIELDS = ["requests", "refusals", "prompt_tokens", "completion_tokens"];
  let shown = null; // the last answer, what the CSV is made of
  let latest = 0; // the newest refresh: an older one whose answer comes later is dropped, not shown

  // Tenants declared in the running config, with or without keys, and every key.
  async function scopes() {
    const keys = (await tenancy("list_keys")).result.keys;
    const running = await api("GET", "/admin/config").catch(() => null);
    const section = running && (running.config.plugins || []).find((p) => p.name === "tenancy");
    const tenants = new Set(Object.keys((section && section.config && section.config.tenants) || {}));
    for (const k of keys) tenants.add(k.tenant);
    return [
      ...[...tenants].sort().map((t) => ({ value: `tenant:${t}`, label: `tenant ${t}` })),
      ...keys.map((k) => ({ value: `key:${k.id}`, label: `key ${k.id} (${k.tenant})` })),
    ];
  }

  async function fillScopes() {
    const select = $("usage-scope");
    const chosen = select.value;
    const options = await scopes();
    select.replaceChildren(...options.map((o) => el("option", { value: o.value }, o.label)));
    if (options.some((o) => o.value === chosen)) select.value = chosen;
  }

  function query() {
    const [kind, ...rest] = $("usage-scope").value.split(":");
    const name = rest.join(":");
    const body = kind === "key" ? { key_id: name } : { tenant: name };
    return { ...body, period: $("usage-period").value, days: Number($("usage-days").value) };
  }

  function showTotals(rows) {
    const totals = Object.fromEntries(FIELDS.map((f) => [f, rows.reduce((sum, r) => sum + r[f], 0)]));
    for (const cell of $("usage-totals").querySelectorAll("td[data-field]")) {
      cell.textContent = String(totals[cell.dataset.field]);
    }
    $("usage-span").textContent = rows.length ? `${rows[0].start.slice(0, 10)} to now` : "-";
  }

  function showRows(rows) {
    const used = rows.filter((r) => FIELDS.some((f) => r[f] !== 0)).reverse();
    replaceRows($("usage-table").tBodies[0], used.map((r) =>
      el("tr", { dataset: { start: r.start } },
        el("td", {}, r.start.replace("T", " ").replace(":00:00Z", ":00")),
        ...FIELDS.map((f) => el("td", { class: "num", dataset: { field: f } }, r[f])))));
  }

  function showCharts(rows) {
    const t = rows.map((r) => r.start_unix);
    const pick = (f) => rows.map((r) => r[f]);
    const options = { width: 560, height: 200, bars: true };
    drawChart("usage:tokens", $("usage-tokens-chart"), [t, pick("prompt_tokens"), pick("completion_tokens")],
      [{ label: "prompt tokens", digits: 0 }, { label: "completion tokens", digits: 0 }], { ...options, title: "Tokens" });
    drawChart("usage:requests", $("usage-requests-chart"), [t, pick("requests"), pick("refusals")],
      [{ label: "requests", digits: 0 }, { label: "refusals", digits: 0 }], { ...options, title: "Requests and refusals" });
  }

  async function refreshUsage() {
    const generation = ++latest;
    $("usage-status").textContent = "";
    window.GatewayCharts.chartsAvailable();
    try {
      await fillScopes();
    } catch (error) {
      if (generation !== latest) return;
      $("usage-status").textContent = error.status === 404
        ? "The tenancy plugin is not enabled in the running config." : error.message;
      return;
    }
    if (generation !== latest) return;
    if (!$("usage-scope").value) {
      $("usage-status").textContent = "No tenant or key yet.";
      return;
    }
    const asked = query();
    const label = `${$("usage-scope").value}/${asked.period}`;
    const answer = (await tenancy("usage_history", asked)).result;
    if (generation !== latest) return; // the operator asked for something else meanwhile
    shown = answer;
    $("usage-table").dataset.shown = label; // what the table holds (a tenant or key, and the period)
    showTotals(shown.rows);
    showRows(shown.rows);
    showCharts(shown.rows);
    $("usage-csv").disabled = false;
  }

  // CSV of an answer: a header, then one line per period (zeros included), oldest first.
  function toCsv(history) {
    const lines = [["start", ...FIELDS].join(",")];
    for (const row of history.rows) lines.push([row.start, ...FIELDS.map((f) => String(row[f]))].join(","));
    return lines.join("\r\n") + "\r\n";
  }

  function downloadCsv() {
    if (!shown) return;
    const blob = new Blob([toCsv(shown)], { type: "text/csv" });
    const url = URL.createObjectURL(blob);
    const name = `usage-${shown.scope}-${shown.name}-per-${shown.period}.csv`.replace(/[^A-Za-z0-9_.-]/g, "_");
    const link = el("a", { href: url, download: name });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("usage-form").addEventListener("submit", (event) => {
      event.preventDefault();
      refreshUsage().catch((error) => { $("usage-status").textContent = error.message; });
    });
    $("usage-csv").addEventListener("click", downloadCsv);
  });
  addView("usage", refreshUsage);
})();
