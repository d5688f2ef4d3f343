// The batches view: every tenant's batches, newest first, from GET /admin/batches (the JSON `gateway batches`
// prints): who owns each, its endpoint and models, its progress as a bar, when it was created and finished,
// and its figures (lines done, failed, queued, output tokens/s). Polled while the view is shown.
//
// Metadata, models, owners and ids come from tenants: they go on the page as text (el() makes text nodes).
"use strict";

(() => {
  const { $, el, api, fmt, stamp, replaceRows, addView } = window.GatewayConsole;
  const LIMIT = 50;
  const FINISHED = ["completed_at", "failed_at", "expired_at", "cancelled_at"];
  const STATUS_CLASS = { completed: "ok", failed: "bad", expired: "bad", cancelled: "warn", cancelling: "warn" };

  const when = (unix) => (unix ? new Date(unix * 1000).toISOString().replace("T", " ").slice(0, 19) : "-");
  const finishedAt = (b) => FINISHED.map((f) => b[f]).find((v) => v) || null;

  function progressCell(b) {
    const counts = b.request_counts;
    const done = counts.completed + counts.failed;
    const bar = el("progress", { max: String(Math.max(counts.total, 1)), value: String(done) });
    const share = counts.total ? `${Math.round((done / counts.total) * 100)} %` : "-";
    return el("td", { class: "progress" }, bar, " ", el("span", { class: "progress-text" }, `${done}/${counts.total} ${share}`));
  }

  function ownerCell(b) {
    return el("td", {}, b.owner, b.key_id ? el("div", { class: "muted small" }, `key ${b.key_id}`) : null);
  }

  function metadataCell(b) {
    const entries = Object.entries(b.metadata || {});
    if (!entries.length) return el("td", { class: "metadata" }, "");
    return el("td", { class: "metadata" }, ...entries.map(([k, v]) => el("div", {}, el("code", {}, k), ` ${v}`)));
  }

  function row(b) {
    const counts = b.request_counts;
    return el("tr", { dataset: { batch: b.id } },
      el("td", {}, el("code", {}, b.id)),
      ownerCell(b),
      el("td", { class: `status ${STATUS_CLASS[b.status] || ""}` }, b.status),
      el("td", {}, b.endpoint),
      el("td", { class: "models" }, b.models && b.models.length ? b.models.join(", ") : "-"),
      progressCell(b),
      el("td", { class: "num", dataset: { field: "completed" } }, counts.completed),
      el("td", { class: "num", dataset: { field: "failed" } }, counts.failed),
      el("td", { class: "num", dataset: { field: "queued" } }, b.queued ?? "-"),
      el("td", { class: "num", dataset: { field: "tokens_per_s" } }, fmt.num(b.output_tokens_per_s, 1)),
      el("td", {}, when(b.created_at)),
      el("td", {}, when(finishedAt(b))),
      metadataCell(b));
  }

  // The figures over the batches listed: active ones, lines done, failed and queued, tokens/s of those running.
  function showTotals(batches) {
    const running = batches.filter((b) => b.status === "in_progress");
    const sum = (list, f) => list.reduce((total, b) => total + (f(b) || 0), 0);
    const figures = {
      active: batches.filter((b) => !["completed", "failed", "expired", "cancelled"].includes(b.status)).length,
      completed: sum(batches, (b) => b.request_counts.completed),
      failed: sum(batches, (b) => b.request_counts.failed),
      queued: sum(batches, (b) => b.queued),
      tokens_per_s: fmt.num(sum(running, (b) => b.output_tokens_per_s), 1),
    };
    for (const cell of $("batches-totals").querySelectorAll("td[data-field]")) {
      cell.textContent = String(figures[cell.dataset.field]);
    }
  }

  async function refreshBatches() {
    let batches;
    try {
      batches = (await api("GET", `/admin/batches?limit=${LIMIT}`)).data;
      $("batches-status").textContent = "";
    } catch (error) {
      if (error.status === 401 || error.status === 403) throw error;
      $("batches-status").textContent = error.status === 404
        ? `The Batch API is not enabled on this gateway: ${error.message}` : error.message;
      replaceRows($("batches-table").tBodies[0], []);
      return;
    }
    showTotals(batches);
    replaceRows($("batches-table").tBodies[0], batches.map(row));
    $("batches-empty").hidden = batches.length > 0;
    stamp("batches-updated");
  }

  addView("batches", refreshBatches, { poll: true });
})();
