// tokenmill console: playground and dashboard over the public API. The API key stays in
// this browser (localStorage) and is sent only to this server, as a bearer token.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "tokenmill.apiKey";
const state = { history: [], controller: null, pollTimer: null, stats: null };

// -- the key and requests --------------------------------------------------------------
function apiKey() { return $("api-key").value.trim(); }

// a server with a key store says so on the page: without a key, ask for one instead of
// sending requests that can only be refused
function needsKey() { return document.body.dataset.keys === "required" && !apiKey(); }
const KEY_NOTE = "enter an API key to use this server";

function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorMessage(resp) {
  let text = "";
  try { text = await resp.text(); } catch (e) { /* body unreadable: use the status */ }
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return `${resp.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `${resp.status}: ${text || resp.statusText}`;
}

function showError(el, message) {
  el.textContent = message || "";
  el.hidden = !message;
}

// -- playground -----------------------------------------------------------------------
async function loadModels() {
  const select = $("model");
  if (needsKey()) { showError($("error"), KEY_NOTE); return; }
  try {
    const resp = await fetch("/v1/models", { headers: authHeaders() });
    if (!resp.ok) { showError($("error"), await errorMessage(resp)); return; }
    const body = await resp.json();
    const current = select.value;
    select.replaceChildren(...body.data.map((m) => {
      const o = document.createElement("option");
      o.value = o.textContent = m.id;
      return o;
    }));
    if (current && body.data.some((m) => m.id === current)) select.value = current;
    showError($("error"), "");
  } catch (e) {
    showError($("error"), "could not reach the server: " + e.message);
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const r = document.createElement("span");
  r.className = "role";
  r.textContent = role;
  const body = document.createElement("span");
  body.className = "content";
  body.textContent = text;
  div.append(r, body);
  $("messages").append(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return body;
}

function parseJsonField(id, name) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  try { return JSON.parse(text); } catch (e) { throw new Error(`${name} is not valid JSON: ${e.message}`); }
}

function numberField(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function setFigure(id, value) { $(id).textContent = value; }

function resetFigures() {
  for (const id of ["fig-ttft", "fig-tps", "fig-prompt", "fig-cached", "fig-completion", "fig-cost", "fig-finish"]) {
    setFigure(id, "–");
  }
}

function setRunning(running) {
  $("send").disabled = running;
  $("stop").disabled = !running;
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim()) return;
  showError($("error"), "");
  let body;
  try {
    body = {
      model: $("model").value,
      messages: [],
      stream: true,
      stream_options: { include_usage: true },
      temperature: numberField("temperature"),
      top_p: numberField("top_p"),
      max_tokens: numberField("max_tokens"),
      seed: numberField("seed"),
      response_format: parseJsonField("response-format", "response_format"),
      tools: parseJsonField("tools", "tools"),
    };
  } catch (e) { showError($("error"), e.message); return; }
  const system = $("system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  body.messages.push(...state.history, { role: "user", content: text });
  addMessage("user", text);
  $("prompt").value = "";
  const out = addMessage("assistant", "");
  resetFigures();
  setRunning(true);
  const controller = new AbortController();
  state.controller = controller;
  const t0 = performance.now();
  let tFirst = null, chunks = 0, answer = "", finish = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: authHeaders({ "Content-Type": "application/json" }), body: JSON.stringify(body),
    });
    if (!resp.ok) {
      out.parentElement.remove();
      showError($("error"), await errorMessage(resp));
      return;
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const msg = JSON.parse(data);
          if (msg.error) { showError($("error"), msg.error.message); continue; }
          for (const c of msg.choices || []) {
            const d = c.delta || {};
            let piece = d.content || "";
            if (d.tool_calls) piece += d.tool_calls.map((t) => `\n[tool call] ${t.function.name}(${t.function.arguments})`).join("");
            if (piece) {
              if (tFirst === null) { tFirst = performance.now(); setFigure("fig-ttft", `${(tFirst - t0).toFixed(0)} ms`); }
              chunks += 1;
              answer += piece;
              out.textContent = answer;
              $("messages").scrollTop = $("messages").scrollHeight;
              const secs = (performance.now() - tFirst) / 1000;
              if (secs > 0.05) setFigure("fig-tps", (chunks / secs).toFixed(1));
            }
            if (c.finish_reason) { finish = c.finish_reason; setFigure("fig-finish", finish); }
          }
          if (msg.usage) showUsage(msg.usage, tFirst);
        }
      }
    }
    state.history.push({ role: "user", content: text }, { role: "assistant", content: answer });
  } catch (e) {
    if (e.name === "AbortError") {
      setFigure("fig-finish", "stopped");
      state.history.push({ role: "user", content: text }, { role: "assistant", content: answer });
    } else {
      showError($("error"), "the request failed: " + e.message);
    }
  } finally {
    state.controller = null;
    setRunning(false);
  }
}

function showUsage(usage, tFirst) {
  setFigure("fig-prompt", usage.prompt_tokens);
  setFigure("fig-completion", usage.completion_tokens);
  setFigure("fig-cached", (usage.prompt_tokens_details || {}).cached_tokens ?? 0);
  if (usage.cost) setFigure("fig-cost", Number(usage.cost.total_usd).toPrecision(3));
  if (tFirst !== null && usage.completion_tokens > 1) {
    const secs = (performance.now() - tFirst) / 1000;
    if (secs > 0) setFigure("fig-tps", ((usage.completion_tokens - 1) / secs).toFixed(1));
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

// -- dashboard ------------------------------------------------------------------------
const fmtInt = (v) => (v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US"));
const fmtRate = (v) => (v === null || v === undefined ? "–" : v.toFixed(1));
const fmtMs = (v) => (v === null || v === undefined ? "–" : (v * 1000).toFixed(v < 0.01 ? 1 : 0));
const fmtUsd = (v) => (v === null || v === undefined ? "–" : Number(v).toPrecision(3));

function chips(el, counts) {
  const entries = Object.entries(counts || {}).sort();
  el.replaceChildren(...entries.map(([k, v]) => {
    const s = document.createElement("span");
    s.dataset.key = k;
    s.textContent = `${k}: ${v}`;
    return s;
  }));
}

function bucketRemaining(b) { return b ? `${fmtInt(b.remaining)} / ${fmtInt(b.limit)}` : "–"; }

function renderStats(s) {
  state.stats = s;
  const admin = s.scope === "server";
  document.querySelectorAll("#dashboard [data-admin]").forEach((el) => { el.hidden = !admin; });
  $("dash-scope").textContent = admin ? `server view (${s.model})` : `tenant ${s.tenant} (${s.model})`;
  $("dash-updated").textContent = new Date(s.time * 1000).toLocaleTimeString();
  if (admin) {
    const e = s.engine, t = s.totals;
    $("stat-running").textContent = fmtInt(e.running);
    $("stat-waiting").textContent = fmtInt(e.waiting);
    $("stat-kv").textContent = `${fmtInt(e.kv_blocks_used)} / ${fmtInt(e.kv_blocks_total)}`;
    $("stat-prefix").textContent = e.prefix_cache_hit_rate === null ? "–" : `${(100 * e.prefix_cache_hit_rate).toFixed(1)}%`;
    const d = e.kv_disk;  // the disk tier under the prefix cache, when served with --kv-disk-dir
    $("card-disk").hidden = !d;
    if (d) {
      const rate = d.hit_rate === null ? "–" : `${(100 * d.hit_rate).toFixed(1)}%`;
      $("stat-disk").textContent = `${rate} · ${(d.used_bytes / 2 ** 30).toFixed(2)} / ${(d.capacity_bytes / 2 ** 30).toFixed(1)} GiB`;
    }
    $("stat-generation-total").textContent = fmtInt(t.generation_tokens);
    renderModels(t.models);
    $("stat-prompt-total").textContent = fmtInt(t.prompt_tokens);
    chips($("response-counts"), t.responses_by_status);
  }
  const w = s.window;
  $("stat-prompt-tps").textContent = fmtRate(w.prompt_tps);
  $("stat-output-tps").textContent = fmtRate(w.output_tps);
  $("stat-ttft").textContent = `${fmtMs(w.ttft_p50)} / ${fmtMs(w.ttft_p99)} ms`;
  $("stat-itl").textContent = `${fmtMs(w.itl_p50)} / ${fmtMs(w.itl_p99)} ms`;
  chips($("status-counts"), w.requests_by_status);
  const rows = s.tenants.map((t) => {
    const tr = document.createElement("tr");
    tr.dataset.tenant = t.tenant;
    const h = t.headroom, sp = h.spend;
    const cells = [t.tenant, fmtInt(t.requests), fmtInt(t.errors), fmtInt(t.prompt_tokens), fmtInt(t.cached_tokens),
      fmtInt(t.completion_tokens), fmtUsd(t.cost_usd),
      sp.budget_usd === null ? `${fmtUsd(sp.spent_usd)} / no budget` : `${fmtUsd(sp.spent_usd)} / ${fmtUsd(sp.budget_usd)}`,
      bucketRemaining(h.requests_per_minute), bucketRemaining(h.tokens_per_minute),
      h.max_concurrency ? `${h.inflight} / ${h.max_concurrency}` : `${h.inflight}`];
    tr.replaceChildren(...cells.map((c) => { const td = document.createElement("td"); td.textContent = c; return td; }));
    return tr;
  });
  document.querySelector("#tenants tbody").replaceChildren(...rows);
  $("batches-title").hidden = !s.batches;
  chips($("batch-counts"), s.batches);
  renderRollouts(s.rollouts);
  const sr = s.series;
  const ms = (arr) => arr.map((v) => (v === null ? null : v * 1000));
  drawChart($("chart-tps"), sr.t, [sr.output_tps, sr.prompt_tps]);
  drawChart($("chart-ttft"), sr.t, [ms(sr.ttft_p50), ms(sr.ttft_p99)]);
  drawChart($("chart-itl"), sr.t, [ms(sr.itl_p50), ms(sr.itl_p99)]);
  drawChart($("chart-requests"), sr.t, [sr.requests, sr.errors]);
}

function drawChart(canvas, t, series) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  canvas.width = w * ratio;
  canvas.height = h * ratio;
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, w, h);
  const styles = getComputedStyle(document.documentElement);
  const colors = [styles.getPropertyValue("--accent").trim(), styles.getPropertyValue("--accent2").trim()];
  let max = 0;
  for (const s of series) for (const v of s) if (v !== null && v > max) max = v;
  const top = max > 0 ? max * 1.1 : 1;
  const left = 36, bottom = h - 14;
  g.strokeStyle = "#d8dde6";
  g.fillStyle = "#667085";
  g.font = "10px system-ui, sans-serif";
  g.beginPath(); g.moveTo(left, 4); g.lineTo(left, bottom); g.lineTo(w - 2, bottom); g.stroke();
  g.fillText(top >= 100 ? top.toFixed(0) : top.toPrecision(2), 2, 12);
  g.fillText("0", 2, bottom);
  g.fillText(`-${Math.round((t.length * 5) / 60)} min`, left, h - 2);
  g.fillText("now", w - 24, h - 2);
  const x = (i) => left + ((w - left - 4) * i) / Math.max(1, t.length - 1);
  const y = (v) => bottom - ((bottom - 6) * v) / top;
  series.forEach((s, k) => {
    g.strokeStyle = colors[k % colors.length];
    g.lineWidth = 1.5;
    g.beginPath();
    let pen = false;
    s.forEach((v, i) => {
      if (v === null) { pen = false; return; }
      if (pen) g.lineTo(x(i), y(v)); else g.moveTo(x(i), y(v));
      pen = true;
    });
    g.stroke();
  });
}

// Tokens and spend by the model or LoRA adapter requests named (an admin's view); an
// adapter's row names its base model.
function renderModels(models) {
  const rows = (models || []).map((m) => {
    const tr = document.createElement("tr");
    tr.dataset.model = m.model;
    const cells = [m.model, m.parent || "–", fmtInt(m.samples), fmtInt(m.prompt_tokens), fmtInt(m.generation_tokens),
      fmtUsd(m.cost_usd)];
    tr.replaceChildren(...cells.map((c) => { const td = document.createElement("td"); td.textContent = c; return td; }));
    return tr;
  });
  document.querySelector("#models tbody").replaceChildren(...rows);
}

// Rollouts (an admin's view, served with --rollout): each arm's weight, requests,
// errors and checked answers, and the last decision with who took it and why.
function renderRollouts(rollouts) {
  $("rollouts-title").hidden = !rollouts || !rollouts.length;
  $("rollouts").hidden = $("rollouts-title").hidden;
  // success: of the answers whose request carried a check of its own (a json_schema, a forced tool call)
  const arm = (a) => `${a.model}: weight ${fmtInt(a.weight)} · ${fmtInt(a.requests)} req · ${fmtInt(a.errors)} err` +
    (a.checked ? ` · ${fmtInt(a.passed)} of ${fmtInt(a.checked)} checked passed` : "");
  const rows = (rollouts || []).map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.rollout = r.id;
    const d = r.decisions.length ? r.decisions[r.decisions.length - 1] : null;
    const last = d ? `${d.action} by ${d.by} at ${new Date(d.time * 1000).toLocaleTimeString()}` +
      (d.evidence ? ` (${d.evidence.rule})` : "") : "none";
    const agree = r.agreement && r.agreement.checked ? `${(100 * r.agreement.rate).toFixed(0)}% of ${r.agreement.checked}` : "–";
    const cells = [r.id, r.state, arm(r.stable), arm(r.canary), agree, last];
    tr.replaceChildren(...cells.map((c) => { const td = document.createElement("td"); td.textContent = c; return td; }));
    return tr;
  });
  document.querySelector("#rollouts tbody").replaceChildren(...rows);
}

async function pollStats() {
  if (needsKey()) { showError($("dash-error"), KEY_NOTE); return; }
  try {
    const resp = await fetch("/v1/stats?window=60", { headers: authHeaders() });
    if (!resp.ok) { showError($("dash-error"), await errorMessage(resp)); return; }
    showError($("dash-error"), "");
    renderStats(await resp.json());
  } catch (e) {
    showError($("dash-error"), "could not reach the server: " + e.message);
  }
}

function schedulePolling() {
  clearInterval(state.pollTimer);
  state.pollTimer = null;
  if ($("dashboard").hidden) return;
  pollStats();
  state.pollTimer = setInterval(pollStats, Number($("refresh").value));
}

// -- wiring ---------------------------------------------------------------------------
function showTab(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.tab === name);
  $("playground").hidden = name !== "playground";
  $("dashboard").hidden = name !== "dashboard";
  schedulePolling();
}

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, apiKey());
    loadModels();
    schedulePolling();
  });
  $("forget-key").addEventListener("click", () => {
    localStorage.removeItem(KEY_STORE);
    $("api-key").value = "";
  });
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => showTab(tab.dataset.tab));
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => { state.history = []; $("messages").replaceChildren(); resetFigures(); });
  $("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(); });
  $("refresh").addEventListener("change", schedulePolling);
  showTab(location.hash === "#dashboard" ? "dashboard" : "playground");
  loadModels();
}

init();
