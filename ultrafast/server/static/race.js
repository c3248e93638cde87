// The race page: one prompt streamed by both tiers through the OpenAI-compatible API, with each request's
// figures as they arrive, and the server's own figures polled from /metrics. Plain JavaScript, no build step.
"use strict";

const TIERS = ["standard", "ultrafast"];
const $ = (id) => document.getElementById(id);
const state = { prices: {}, abort: null, samples: [] };

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || resp.statusText;
  } catch (e) {
    return resp.status + " " + resp.statusText;
  }
}

function fmt(x, digits) { return x == null || !isFinite(x) ? "–" : x.toFixed(digits); }
function usd(x) { return x == null ? "–" : "$" + (x < 0.01 ? x.toPrecision(3) : x.toFixed(4)); }

// ---- models and prices

async function loadModels() {
  const resp = await fetch("/v1/models", { headers: headers(false) });
  if (!resp.ok) { $("m-error").textContent = "models: " + (await errorText(resp)); return; }
  const { data } = await resp.json();
  const sel = $("model");
  const chosen = sel.value;
  sel.textContent = "";
  for (const m of data) {
    state.prices[m.id] = m.pricing || {};
    sel.append(new Option(m.id, m.id, false, m.id === chosen));
  }
  showPrices();
}

function showPrices() {
  const p = state.prices[$("model").value] || {};
  for (const tier of TIERS) {
    const t = p[tier];
    $(tier + "-price").textContent = t ? `$${t.input} in · $${t.output} out per million tokens` : "";
  }
}

function cost(tier, usage) {
  const p = (state.prices[$("model").value] || {})[tier];
  if (!p || !usage) return null;
  const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
  return ((usage.prompt_tokens - cached) * p.input + cached * p.cached_input + usage.completion_tokens * p.output) / 1e6;
}

// ---- one tier's streamed request

function lane(tier) {
  const set = (name, v) => { $(tier + "-" + name).textContent = v; };
  return {
    reset() {
      $(tier + "-text").textContent = "";
      for (const n of ["ttft", "tokens", "tps", "tau", "cost"]) set(n, "–");
      set("status", "waiting");
    },
    set,
    append(text) { $(tier + "-text").textContent += text; },
    text() { return $(tier + "-text").textContent; },
  };
}

// SSE events from a fetch body: calls onEvent(parsed JSON) per `data:` line until [DONE]
async function readEvents(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function race1(tier, prompt, signal) {
  const L = lane(tier);
  L.set("status", "prefill");
  const body = {
    model: $("model").value, service_tier: tier, stream: true, temperature: 0,
    max_tokens: parseInt($("max-tokens").value, 10) || 256,
    stream_options: { include_usage: true, continuous_usage_stats: true },
    messages: [{ role: "user", content: prompt }],
  };
  const t0 = performance.now();
  let tFirst = null, tokensAtFirst = 0, tokens = 0, usage = null;
  const resp = await fetch("/v1/chat/completions",
                           { method: "POST", headers: headers(true), body: JSON.stringify(body), signal });
  if (!resp.ok) { L.set("status", "error: " + (await errorText(resp))); return null; }
  let final = null;
  await readEvents(resp, (chunk) => {
    if (chunk.error) throw new Error(chunk.error.message);
    const now = performance.now();
    const choice = chunk.choices && chunk.choices[0];
    const text = choice && choice.delta && choice.delta.content;
    if (chunk.usage) { usage = chunk.usage; tokens = usage.completion_tokens; }
    if (text) {
      if (tFirst === null) {
        tFirst = now; tokensAtFirst = tokens;
        L.set("ttft", fmt((now - t0) / 1000, 2) + " s");
        L.set("status", "decoding");
      }
      L.append(text);
    }
    if (chunk.time_info) final = chunk.time_info;
    L.set("tokens", String(tokens));
    if (tFirst !== null && now > tFirst) L.set("tps", fmt((tokens - tokensAtFirst) / ((now - tFirst) / 1000), 1));
    L.set("cost", usd(cost(tier, usage)));
  });
  if (final) {
    if (final.decode_tokens_per_s != null) L.set("tps", fmt(final.decode_tokens_per_s, 1));
    L.set("tau", final.tau != null ? fmt(final.tau, 2) : (tier === "standard" ? "1.00" : "–"));
  }
  const seconds = (performance.now() - t0) / 1000;
  L.set("status", "done in " + fmt(seconds, 2) + " s");
  return { text: L.text(), seconds };
}

async function race(ev) {
  ev.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  state.abort = new AbortController();
  const signal = state.abort.signal;
  $("run").disabled = true; $("stop").disabled = false;
  $("match").textContent = ""; $("match").className = "match";
  TIERS.forEach((t) => lane(t).reset());
  const one = (tier) => race1(tier, prompt, signal).catch((e) => {
    lane(tier).set("status", e.name === "AbortError" ? "stopped" : "error: " + e.message);
    return null;
  });
  let runs;
  if ($("sequential").checked) {
    runs = [];
    for (const t of TIERS) runs.push(await one(t));
  } else {
    runs = await Promise.all(TIERS.map(one));
  }
  const [std, fast] = runs;
  if (std !== null && fast !== null) {
    const same = std.text === fast.text;
    let at = 0;
    while (!same && std.text[at] === fast.text[at]) at++;
    $("match").textContent = (same ? "identical text in both tiers" : "the texts differ from character " + at)
                             + ` · wall-clock: standard ${fmt(std.seconds, 2)} s, ultrafast ${fmt(fast.seconds, 2)} s`
                             + ` (${fmt(std.seconds / fast.seconds, 2)}x)`;
    $("match").className = "match " + (same ? "same" : "differ");
  }
  $("run").disabled = false; $("stop").disabled = true;
}

// ---- the server's figures, from its Prometheus exposition

function parseMetrics(text) {
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    out.push({ name: m[1], labels, value: parseFloat(m[3]) });
  }
  return out;
}

function total(samples, name, where) {
  return samples.filter((s) => s.name === name && Object.entries(where).every(([k, v]) => s.labels[k] === v))
                .reduce((a, s) => a + s.value, 0);
}

async function pollMetrics() {
  let resp;
  try {
    resp = await fetch("/metrics", { headers: headers(false) });
  } catch (e) {
    $("m-error").textContent = "metrics: " + e.message;
    return;
  }
  if (!resp.ok) { $("m-error").textContent = "metrics: " + (await errorText(resp)); return; }
  $("m-error").textContent = "";
  const samples = parseMetrics(await resp.text());
  const model = $("model").value;
  const now = performance.now();
  const tokensNow = {};
  for (const tier of TIERS) {
    const w = { model, tier };
    $(`m-${tier}-requests`).textContent = total(samples, "ultrafast_requests_total", w);
    tokensNow[tier] = total(samples, "ultrafast_tokens_total", { ...w, kind: "completion" });
    $(`m-${tier}-tokens`).textContent = tokensNow[tier];
    $(`m-${tier}-spend`).textContent = usd(total(samples, "ultrafast_cost_usd_total", w));
  }
  // tokens/s over the last ~3 s: the counters grow as requests end, so this is a recent average
  state.samples.push({ t: now, tokens: tokensNow });
  while (state.samples.length > 2 && now - state.samples[0].t > 3000) state.samples.shift();
  const first = state.samples[0];
  for (const tier of TIERS) {
    const dt = (now - first.t) / 1000;
    $(`m-${tier}-tps`).textContent = dt > 0 ? fmt((tokensNow[tier] - first.tokens[tier]) / dt, 1) : "–";
  }
  const n = total(samples, "ultrafast_spec_tau_count", { model });
  $("m-ultrafast-tau").textContent = n > 0 ? fmt(total(samples, "ultrafast_spec_tau_sum", { model }) / n, 2) : "–";
  $("m-slots").textContent = total(samples, "ultrafast_kv_slots_in_use", { model }) + " of "
                             + total(samples, "ultrafast_kv_slots", { model });
  $("m-queue").textContent = total(samples, "ultrafast_queue_depth", { model });
  $("m-updated").textContent = "(from /metrics, " + new Date().toLocaleTimeString() + ")";
}

function init() {
  $("key").value = sessionStorage.getItem("ultrafast-key") || "";
  $("key").addEventListener("change", () => {
    sessionStorage.setItem("ultrafast-key", $("key").value.trim());
    loadModels();
  });
  $("model").addEventListener("change", showPrices);
  $("ask").addEventListener("submit", race);
  $("prompt").addEventListener("keydown", (e) => {  // Ctrl+Enter races
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("ask").requestSubmit();
  });
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  loadModels();
  pollMetrics();
  setInterval(pollMetrics, 1000);
}

document.addEventListener("DOMContentLoaded", init);
