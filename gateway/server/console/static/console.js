// The operator console. Plain JavaScript, loaded from this origin only (see the CSP): this file (sign-in,
// tabs, config, tenancy, playground), charts.js (workers and live views, on uPlot, vendored at build time),
// usage.js (usage over time) and batches.js (every tenant's batches with their progress).
//
// Rules this file keeps: the admin token lives in one variable (never in storage or a cookie) and goes out as
// the x-admin-token header; every value from the gateway (tenant names, errors, model output) is put on the
// page with textContent or as an attribute value, never parsed as HTML.
"use strict";

(() => {
  const REFRESH_MS = 2000;
  let token = null;
  let view = "workers";
  let timer = null;
  let validatedText = null;

  const $ = (id) => document.getElementById(id);

  // An element with text children only: strings become text nodes, never markup.
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "class") node.className = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function replaceRows(tbody, rows) {
    tbody.replaceChildren(...rows);
  }

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function api(method, path, body, contentType) {
    const headers = { "x-admin-token": token };
    let payload;
    if (body !== undefined) {
      headers["content-type"] = contentType || "application/json";
      payload = typeof body === "string" ? body : JSON.stringify(body);
    }
    const response = await fetch(path, { method, headers, body: payload, credentials: "omit", cache: "no-store" });
    const text = await response.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
    if (!response.ok) {
      const message = data && data.error ? data.error.message : `${response.status} ${response.statusText}`;
      throw new ApiError(response.status, message);
    }
    return data;
  }

  const fmt = {
    num: (v, digits = 2) => (v === null || v === undefined ? "-" : Number(v).toFixed(digits)),
    ms: (v) => (v === null || v === undefined ? "-" : `${(v * 1000).toFixed(1)} ms`),
    pct: (v) => (v === null || v === undefined ? "-" : `${(v * 100).toFixed(1)} %`),
  };

  // -- sign in, tabs, refresh ----------------------------------------------------------------------

  async function signIn(event) {
    event.preventDefault();
    token = $("token").value.trim();
    $("token").value = "";
    $("login-error").textContent = "";
    try {
      await api("GET", "/admin/reloads");
    } catch (error) {
      token = null;
      $("login-error").textContent = error.status === 401 || error.status === 403
        ? `Not signed in: ${error.message}` : `The gateway did not answer: ${error.message}`;
      return;
    }
    $("login").hidden = true;
    $("tabs").hidden = false;
    show("workers");
  }

  function signOut() {
    token = null;
    clearInterval(timer);
    for (const section of document.querySelectorAll(".view")) section.hidden = true;
    $("tabs").hidden = true;
    $("login").hidden = false;
    $("version").textContent = "";
  }

  // The views defined here; charts.js (workers, live), usage.js and batches.js add theirs through window.GatewayConsole.
  const refreshers = {
    config: refreshConfig,
    tenancy: refreshTenancy,
    playground: refreshPlayground,
  };
  const polled = new Set(["config"]);

  function show(name) {
    view = name;
    for (const button of document.querySelectorAll("#tabs button[data-view]")) {
      button.classList.toggle("active", button.dataset.view === name);
    }
    for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== `view-${name}`;
    clearInterval(timer);
    refresh();
    if (polled.has(name)) timer = setInterval(refresh, REFRESH_MS);
  }

  async function refresh() {
    if (token === null) return;
    try {
      await refreshers[view]();
    } catch (error) {
      if (error.status === 401 || error.status === 403) signOut();
      else console.warn(error);
    }
  }

  const stamp = (id) => { $(id).textContent = `updated ${new Date().toLocaleTimeString()}`; };

  // What the other scripts of the page use: they load after this one, before the page is wired.
  window.GatewayConsole = Object.freeze({
    $, el, api, fmt, stamp, replaceRows,
    addView(name, refresher, { poll = false } = {}) {
      refreshers[name] = refresher;
      if (poll) polled.add(name);
    },
    setVersion(version) { $("version").textContent = version ? `config ${version.slice(0, 12)}` : ""; },
    tenancy: (action, body) => api("POST", `/admin/plugins/tenancy/${action}`, body || {}),
  });

  // -- config --------------------------------------------------------------------------------------

  async function refreshConfig() {
    const data = await api("GET", "/admin/reloads");
    $("config-version").textContent = data.version || "-";
    $("config-source").textContent = data.source;
    $("config-loaded").textContent = data.loaded_at || "-";
    window.GatewayConsole.setVersion(data.version);
    const rows = data.reloads.map((r) =>
      el("tr", {},
        el("td", {}, r.at_iso.replace("T", " ").slice(0, 19)),
        el("td", {}, r.who),
        el("td", {}, r.source),
        el("td", { class: r.outcome === "refused" ? "bad" : "ok" }, r.outcome),
        el("td", {}, el("code", {}, (r.version || "-").slice(0, 12))),
        el("td", {}, r.reason || "")));
    replaceRows($("reloads-table").tBodies[0], rows);
  }

  const show_json = (v) => (v === null || v === undefined ? "" : JSON.stringify(v));

  async function validateCandidate() {
    const text = $("candidate").value;
    $("apply").disabled = true;
    validatedText = null;
    $("problems").replaceChildren();
    $("diff-table").hidden = true;
    $("config-status").textContent = "validating...";
    try {
      const data = await api("POST", "/admin/config/diff", text, "application/yaml");
      if (!data.valid) {
        $("config-status").textContent = "refused by validation:";
        $("problems").replaceChildren(...data.problems.map((p) => el("li", {}, p)));
        return;
      }
      validatedText = text;
      $("apply").disabled = data.diff.length === 0;
      $("config-status").textContent = data.diff.length
        ? `valid: ${data.diff.length} change(s) against ${data.running_version.slice(0, 12)}`
        : "valid: the same as the running config";
      replaceRows($("diff-table").tBodies[0], data.diff.map((d) =>
        el("tr", { class: `diff-${d.change}` },
          el("td", {}, el("code", {}, d.path)),
          el("td", {}, d.change),
          el("td", {}, el("code", {}, show_json(d.running))),
          el("td", {}, el("code", {}, show_json(d.candidate))))));
      $("diff-table").hidden = data.diff.length === 0;
    } catch (error) {
      $("config-status").textContent = `failed: ${error.message}`;
    }
  }

  async function applyCandidate() {
    if (validatedText === null || validatedText !== $("candidate").value) {
      $("config-status").textContent = "the text changed since it was validated: validate it again";
      $("apply").disabled = true;
      return;
    }
    $("apply").disabled = true;
    try {
      const result = await api("PUT", "/admin/config", validatedText, "application/yaml");
      $("config-status").textContent = result.changed
        ? `reloaded: version ${result.version.slice(0, 12)} is live` : "unchanged: that config was already live";
    } catch (error) {
      $("config-status").textContent = `refused: ${error.message}`;
    }
    validatedText = null;
    await refreshConfig();
  }

  async function reloadFromFile() {
    try {
      const result = await api("POST", "/admin/reload");
      $("config-status").textContent = result.changed
        ? `reloaded from file: version ${result.version.slice(0, 12)}` : "file reloaded: no change";
    } catch (error) {
      $("config-status").textContent = `refused: ${error.message}`;
    }
    await refreshConfig();
  }

  // -- tenancy -------------------------------------------------------------------------------------

  const tenancy = window.GatewayConsole.tenancy;

  function usageText(period) {
    if (!period) return "-";
    const budget = period.budget_tokens ? ` / ${period.budget_tokens}` : "";
    return `${period.tokens}${budget} tokens, ${period.requests} requests`;
  }

  async function refreshTenancy() {
    $("tenancy-status").textContent = "";
    let keys;
    try {
      keys = (await tenancy("list_keys")).result.keys;
    } catch (error) {
      $("tenancy-status").textContent = error.status === 404
        ? "The tenancy plugin is not enabled in the running config." : error.message;
      replaceRows($("keys-table").tBodies[0], []);
      replaceRows($("tenants-table").tBodies[0], []);
      return;
    }
    const usage = await Promise.all(keys.map((k) => tenancy("usage", { key_id: k.id }).then((r) => r.result, () => null)));
    replaceRows($("keys-table").tBodies[0], keys.map((k, i) =>
      el("tr", { dataset: { key: k.id } },
        el("td", {}, el("code", {}, k.id)),
        el("td", {}, k.tenant),
        el("td", {}, k.source === "redis" ? "created here" : "config.yaml"),
        el("td", {}, usageText(usage[i] && usage[i].day)),
        el("td", {}, usageText(usage[i] && usage[i].month)),
        el("td", {}, k.source === "redis"
          ? el("button", { type: "button", class: "revoke", onclick: () => revokeKey(k.id) }, "Revoke") : ""))));
    const tenants = new Map();
    // Tenants declared in the running config, with or without keys yet.
    const running = await api("GET", "/admin/config").catch(() => null);
    const section = running && (running.config.plugins || []).find((p) => p.name === "tenancy");
    for (const name of Object.keys((section && section.config && section.config.tenants) || {})) tenants.set(name, 0);
    for (const k of keys) tenants.set(k.tenant, (tenants.get(k.tenant) || 0) + 1);
    const names = [...tenants.keys()].sort();
    const tenantUsage = await Promise.all(names.map((t) => tenancy("usage", { tenant: t }).then((r) => r.result, () => null)));
    replaceRows($("tenants-table").tBodies[0], names.map((t, i) =>
      el("tr", { dataset: { tenant: t } },
        el("td", {}, t),
        el("td", { class: "num" }, tenants.get(t)),
        el("td", {}, usageText(tenantUsage[i] && tenantUsage[i].day)),
        el("td", {}, usageText(tenantUsage[i] && tenantUsage[i].month)))));
  }

  async function createKey(event) {
    event.preventDefault();
    const body = { tenant: $("new-tenant").value.trim() };
    if ($("new-id").value.trim()) body.id = $("new-id").value.trim();
    const models = $("new-models").value.split(",").map((m) => m.trim()).filter(Boolean);
    if (models.length) body.models = models;
    try {
      const created = (await tenancy("create_key", body)).result;
      $("new-key-id").textContent = created.id;
      $("new-key-tenant").textContent = created.tenant;
      $("new-key-value").textContent = created.key;
      $("new-key").hidden = false;
      $("create-key-form").reset();
    } catch (error) {
      $("tenancy-status").textContent = error.message;
      return;
    }
    await refreshTenancy();
  }

  function dismissKey() {
    $("new-key-value").textContent = "";
    $("new-key").hidden = true;
  }

  async function revokeKey(id) {
    if (!window.confirm(`Revoke key ${id}? Clients using it are refused within a second.`)) return;
    try {
      await tenancy("revoke_key", { id });
    } catch (error) {
      $("tenancy-status").textContent = error.message;
    }
    await refreshTenancy();
  }

  // -- playground ----------------------------------------------------------------------------------

  async function refreshPlayground() {
    const data = await api("GET", "/admin/workers");
    const select = $("chat-model");
    const chosen = select.value;
    select.replaceChildren(...data.models.map((m) => el("option", { value: m.model }, m.model)));
    if (chosen) select.value = chosen;
  }

  function requestId() {
    const bytes = new Uint8Array(16);
    crypto.getRandomValues(bytes);
    return "console-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function showHeaders(response, timings) {
    const rows = [];
    for (const [name, value] of response.headers) {
      if (name.startsWith("x-") || name === "age" || name === "server-timing" || name === "content-type") {
        rows.push(el("tr", {}, el("th", {}, name), el("td", {}, el("code", {}, value))));
      }
    }
    for (const [name, value] of Object.entries(timings)) {
      rows.push(el("tr", {}, el("th", {}, name), el("td", {}, value === null ? "-" : `${value.toFixed(1)} ms`)));
    }
    replaceRows($("chat-headers").tBodies[0], rows);
  }

  async function sendChat(event) {
    event.preventDefault();
    const stream = $("chat-stream").checked;
    const body = {
      model: $("chat-model").value,
      messages: [{ role: "user", content: $("chat-prompt").value }],
      max_tokens: Number($("chat-max").value) || 64,
      stream,
    };
    const headers = { "x-admin-token": token, "content-type": "application/json", "x-request-id": requestId() };
    if ($("chat-key").value) headers.authorization = `Bearer ${$("chat-key").value}`;
    const answer = $("chat-answer");
    answer.textContent = "";
    $("chat-send").disabled = true;
    $("chat-status").textContent = "sending...";
    const started = performance.now();
    const timings = { "time to headers": null, "time to first token": null, "total": null };
    try {
      const response = await fetch("/admin/ui/chat", {
        method: "POST", headers, body: JSON.stringify(body), credentials: "omit", cache: "no-store",
      });
      timings["time to headers"] = performance.now() - started;
      showHeaders(response, timings);
      if (!response.ok || !stream) {
        const data = await response.json().catch(() => null);
        if (!response.ok) {
          answer.textContent = data && data.error ? `${data.error.type}: ${data.error.message}` : `HTTP ${response.status}`;
        } else {
          answer.textContent = data.choices[0].message.content || "";
        }
        timings["time to first token"] = null;
      } else {
        await readStream(response.body, (text) => {
          if (timings["time to first token"] === null) timings["time to first token"] = performance.now() - started;
          answer.append(document.createTextNode(text));
        }, (message) => { answer.append(document.createTextNode(`\n[${message}]`)); });
      }
      timings.total = performance.now() - started;
      showHeaders(response, timings);
      $("chat-status").textContent = `HTTP ${response.status}`;
    } catch (error) {
      $("chat-status").textContent = `failed: ${error.message}`;
    } finally {
      $("chat-send").disabled = false;
    }
  }

  // Server-sent events from a ReadableStream: "data: {...}" lines, "data: [DONE]" at the end.
  async function readStream(body, onText, onError) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        let event;
        try { event = JSON.parse(data); } catch (_) { continue; }
        if (event.error) { onError(event.error.message); continue; }
        const delta = event.choices && event.choices[0] && event.choices[0].delta;
        if (delta && delta.content) onText(delta.content);
      }
    }
  }

  // -- wiring --------------------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", signIn);
    $("logout").addEventListener("click", signOut);
    for (const button of document.querySelectorAll("#tabs button[data-view]")) {
      button.addEventListener("click", () => show(button.dataset.view));
    }
    $("validate").addEventListener("click", validateCandidate);
    $("apply").addEventListener("click", applyCandidate);
    $("reload-file").addEventListener("click", reloadFromFile);
    $("candidate").addEventListener("input", () => { $("apply").disabled = true; });
    $("create-key-form").addEventListener("submit", createKey);
    $("new-key-dismiss").addEventListener("click", dismissKey);
    $("chat-form").addEventListener("submit", sendChat);
    $("token").focus();
  });
})();
