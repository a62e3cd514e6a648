// pie serve's page: a chat over the server's /v1/chat/completions and a live view of /v1/pie/status.
// Plain JavaScript, no framework, no build step. Text from the model or the server is only ever set as
// textContent, never parsed as HTML.
"use strict";

const KEY_STORAGE = "pie-api-key";
const POLL_MS = 1000;
const KEY_BACKOFF_MAX_MS = 60000; // a poll refused for want of a key the user declined is retried ever more slowly
const POLL_TIMEOUT_MS = 5000;
const HISTORY_S = 300;
const RATE_WINDOW_S = 10;
const MAX_TOKENS = 256; // the Max tokens field's default, where the context leaves room for it
const STALL_MS = 30000; // the server sends a keep-alive every 15 s: this long without a byte is a failure

const $ = (id) => document.getElementById(id);

const page = {
  model: null,
  conversation: [],
  controller: null,
  stopped: false,
  history: [], // {t, prompt, generation, steps, batch} per status answer
  planLoaded: false,
  keyDeclined: false,
  keyPrompt: null,
  keyBackoff: 0, // ms to the next poll while the status is refused for its key; 0: not refused
  keyWhy: "", // the server's word for that refusal
  pollTimer: 0, // the next poll's, while none is under way
};

// -- notices: one line per source, shown until that source clears it ---------------------------

const notices = new Map();

function notice(source, text) {
  if (text ? notices.get(source) === text : !notices.has(source)) return;
  if (text) notices.set(source, text);
  else notices.delete(source);
  const box = $("notices");
  box.replaceChildren(...[...notices.values()].map((line) => {
    const p = document.createElement("p");
    p.textContent = line;
    return p;
  }));
}

// -- the API key -------------------------------------------------------------------------------

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Ask for the key once (several requests may be refused at once); resolves true when one was given.
function askKey(why) {
  if (page.keyPrompt) return page.keyPrompt;
  const dialog = $("key-dialog");
  $("key-why").textContent = `The server answered: ${why}`;
  $("key").value = "";
  dialog.returnValue = "";
  page.keyPrompt = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const key = $("key").value.trim();
      const given = dialog.returnValue === "ok" && key !== "";
      if (given) sessionStorage.setItem(KEY_STORAGE, key);
      page.keyDeclined = !given;
      page.keyPrompt = null;
      resolve(given);
      if (given) pollNow(); // a runtime view waiting for the key shows the runtime at once
    }, { once: true });
  });
  dialog.showModal();
  $("key").focus();
  return page.keyPrompt;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) {
    // not JSON: say the status
  }
  return `HTTP ${response.status} ${response.statusText}`.trim();
}

// A fetch or a stream that the network failed rejects with a TypeError whose message is the browser's own ("Failed
// to fetch", "network error"): say what happened. Aborts and timeouts pass on as they are.
function unreached(error) {
  throw error.name === "TypeError" ? new Error("the connection to the server failed") : error;
}

// A 401 that no key was given for: the server wants one, or refused the one sent.
class KeyNeeded extends Error {}

// fetch, asking for the key and retrying while the server answers 401 (unless the user declines).
async function fetchWithKey(url, options, { ask = true } = {}) {
  for (;;) {
    const sent = authHeaders();
    const response = await fetch(url, { ...options, headers: { ...options.headers, ...sent } }).catch(unreached);
    if (response.status !== 401) return response;
    const why = await errorMessage(response);
    if (!ask || !(await askKey(why))) throw new KeyNeeded(sent.Authorization ? why : `${why} (no API key given)`);
  }
}

// -- the chat ----------------------------------------------------------------------------------

function addMessage(role, text) {
  const item = document.createElement("li");
  item.className = role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "text";
  body.dir = "auto"; // right-to-left text is laid out as such, whatever the page's direction
  const words = document.createTextNode(text); // a streamed answer grows in this one node
  body.append(words);
  const meta = document.createElement("div");
  meta.className = "meta";
  item.append(who, body, meta);
  $("messages").append(item);
  item.scrollIntoView({ block: "end" });
  return { item, words, meta, pending: "", frame: 0 };
}

// Streamed text reaches the page once a frame, however fast the tokens come: each token appended to the page
// would lay the answer out again, and a long one would freeze the tab. The transcript follows the answer unless
// the reader has scrolled up.
function show(shown, content) {
  shown.pending += content;
  if (!shown.frame) shown.frame = requestAnimationFrame(() => flush(shown));
}

function flush(shown) {
  cancelAnimationFrame(shown.frame);
  shown.frame = 0;
  if (!shown.pending) return;
  const list = $("messages");
  const following = list.scrollHeight - list.scrollTop - list.clientHeight < 8;
  shown.words.appendData(shown.pending);
  shown.pending = "";
  if (following) list.scrollTop = list.scrollHeight;
}

function numberField(id) {
  const field = $(id);
  if (field.value === "") return undefined;
  if (!field.checkValidity()) throw new Error(`${field.labels[0].textContent.trim()}: ${field.validationMessage}`);
  return Number(field.value);
}

function requestBody(conversation) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = {
    messages: messages.concat(conversation),
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top_p"),
    max_tokens: numberField("max_tokens"),
    seed: numberField("seed"),
  };
  if (page.model) body.model = page.model;
  return body;
}

// The button that is disabled hands the focus to the other: a keyboard user's focus is not dropped to the page's
// start, and the key that sent the message stops its answer.
function setBusy(busy) {
  const [off, on] = busy ? [$("send"), $("stop")] : [$("stop"), $("send")];
  const focused = document.activeElement === off;
  on.disabled = false;
  off.disabled = true;
  if (focused) on.focus();
}

async function send(text) {
  const reply = { text: "", chunks: 0, finish: null, usage: null, started: performance.now() };
  const conversation = page.conversation; // "Clear" starts a new one: this answer stays in its own
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const shown = addMessage("assistant", "");
  shown.item.classList.add("streaming");
  shown.item.setAttribute("aria-busy", "true"); // read out once whole, not token by token
  shown.meta.textContent = "waiting for the server…";
  page.controller = new AbortController();
  page.stopped = false;
  setBusy(true);
  try {
    const body = JSON.stringify(requestBody(conversation));
    const response = await fetchWithKey("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body,
      // The API takes the key as Bearer only. The browser's own (HTTP Basic, given for a --protect-probes server's
      // page) would be refused, and a refused one the browser forgets: the runtime view's polls would go unkeyed.
      credentials: "omit",
      signal: page.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    shown.meta.textContent = "streaming…";
    await readStream(response, reply, shown);
    shown.item.classList.add("done");
    shown.meta.textContent = describeReply(reply);
  } catch (error) {
    if (page.stopped) {
      shown.item.classList.add("stopped");
      shown.meta.textContent = `stopped after ${reply.text.length} characters`;
    } else {
      shown.item.classList.add("failed");
      shown.meta.textContent = `failed: ${error.message}`;
      notice("chat", `The last message failed: ${error.message}`);
    }
  } finally {
    flush(shown);
    shown.item.classList.remove("streaming");
    shown.item.removeAttribute("aria-busy");
    shown.item.dataset.chunks = String(reply.chunks);
    if (reply.text) {
      conversation.push({ role: "assistant", content: reply.text });
    } else if (conversation === page.conversation) { // nothing came back: the question goes back into the box
      conversation.pop();
      if (!$("prompt").value) $("prompt").value = text;
    }
    page.controller = null;
    setBusy(false);
    $("prompt").focus();
  }
}

function describeReply(reply) {
  const seconds = (performance.now() - reply.started) / 1000;
  const tokens = reply.usage ? `${reply.usage.completion_tokens} tokens` : `${reply.text.length} characters`;
  return `${tokens} in ${seconds.toFixed(1)} s · finish: ${reply.finish || "none"}`;
}

// Read the SSE stream of chat chunks into the reply; throws on an error event, a stall or a cut stream.
async function readStream(response, reply, shown) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let stall;
    const timeout = new Promise((_, reject) => {
      stall = setTimeout(() => reject(new Error(`no data from the server for ${STALL_MS / 1000} s`)), STALL_MS);
    });
    let part;
    try {
      part = await Promise.race([reader.read().catch(unreached), timeout]);
    } catch (error) {
      reader.cancel().catch(() => {});
      throw error;
    } finally {
      clearTimeout(stall);
    }
    if (part.done) break;
    buffer += decoder.decode(part.value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue; // ": ping" keep-alives and other fields
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        takeChunk(JSON.parse(data), reply, shown);
      }
    }
  }
  throw new Error("the stream ended before the answer was complete");
}

function takeChunk(chunk, reply, shown) {
  if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
  if (chunk.usage) reply.usage = chunk.usage;
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return;
  const content = choice.delta && choice.delta.content;
  if (content) {
    reply.text += content;
    show(shown, content);
  }
  reply.chunks += 1;
  if (choice.finish_reason) reply.finish = choice.finish_reason;
}

function stop() {
  if (!page.controller) return;
  page.stopped = true;
  page.controller.abort(); // closes the connection: the server cancels the request and frees its pages
}

// -- the live view -----------------------------------------------------------------------------

const PHASES = {
  loading: "The model is loading; the chat answers once it is ready.",
  draining: "The server is shutting down: it finishes the requests in flight and refuses new ones.",
};

// The server answered, with an error other than 401: it is up.
class ErrorAnswer extends Error {}

async function poll() {
  page.pollTimer = 0;
  let next = POLL_MS;
  try {
    const response = await fetchWithKey("/v1/pie/status", {
      cache: "no-store",
      signal: AbortSignal.timeout(POLL_TIMEOUT_MS),
    }, { ask: !page.keyDeclined });
    if (!response.ok) throw new ErrorAnswer(await errorMessage(response));
    const status = await response.json();
    notice("poll", null);
    page.keyBackoff = 0;
    $("enter-key").hidden = true;
    showStatus(status);
    if (!page.planLoaded && status.requests) await loadPlan();
  } catch (error) {
    next = showPollFailure(error);
  } finally {
    page.pollTimer = setTimeout(poll, next);
  }
}

// Poll now rather than when the timer says, unless a poll is under way.
function pollNow() {
  if (!page.pollTimer) return;
  clearTimeout(page.pollTimer);
  poll();
}

// Only a server that did not answer is "unreachable": one that wants the key, or answered with an error, is up.
// Returns the ms to the next poll.
function showPollFailure(error) {
  forgetRun(); // the server that answers next may be another one
  const keyNeeded = error instanceof KeyNeeded; // and the user declined to give it (else it was asked for)
  $("enter-key").hidden = !keyNeeded;
  if (keyNeeded) {
    page.keyWhy = error.message;
    page.keyBackoff = Math.min(KEY_BACKOFF_MAX_MS, 2 * (page.keyBackoff || POLL_MS));
    setPhase("key needed");
    notice("poll", `The runtime view needs this server's API key: ${error.message}. Give it with "Enter API key"; ` +
      `until then the page asks the server again in ${page.keyBackoff / 1000} s.`);
    return page.keyBackoff;
  }
  page.keyBackoff = 0;
  if (error instanceof ErrorAnswer) {
    setPhase("error");
    notice("poll", `The server answered the runtime view with an error: ${error.message}. Retrying every second.`);
  } else {
    const why = error.name === "TimeoutError" ? `no answer within ${POLL_TIMEOUT_MS / 1000} s` : error.message;
    setPhase("unreachable");
    notice("poll", `The runtime view cannot reach the server: ${why}. Retrying every second.`);
  }
  return POLL_MS;
}

async function loadPlan() {
  const response = await fetchWithKey("/v1/pie/plan", { cache: "no-store" }, { ask: false });
  if (!response.ok) return; // 503 while loading: the next status answer tries again
  const plan = await response.json();
  const device = plan.device;
  $("engine").textContent = `${plan.engine} — ${plan.engine_reason}`;
  $("device").textContent = `${device.key}: ${device.name} (${device.vendor}, ${device.architecture}, ${device.kind}, ` +
    `${formatBytes(device.memory_bytes)})`;
  $("profile").textContent = plan.profile || "none";
  $("kv-size").textContent = `${plan.kv_tokens} tokens; context ${plan.context_tokens}; ` +
    `up to ${plan.max_running} requests at once`;
  $("plan").textContent = plan.plan;
  fitMaxTokens(Math.min(plan.context_tokens, plan.kv_tokens));
  page.planLoaded = true;
}

// A sequence holds the context's tokens (or the KV cache's, where fewer), prompt and answer: the Max tokens field's
// maximum leaves the prompt one, its default (a quarter, up to MAX_TOKENS) leaves the conversation the rest. A number
// the user typed stays, and the form's check refuses it on send where it is past the maximum.
function fitMaxTokens(sequenceTokens) {
  const field = $("max_tokens");
  field.max = String(sequenceTokens - 1);
  field.defaultValue = String(Math.min(MAX_TOKENS, Math.floor(sequenceTokens / 4)));
}

function setPhase(phase) {
  const badge = $("phase");
  if (badge.textContent === phase) return;
  badge.textContent = phase;
  badge.dataset.phase = phase;
}

function showStatus(status) {
  page.model = status.model;
  $("model").textContent = status.model;
  setPhase(status.phase);
  notice("phase", status.phase === "failed" ? `The server cannot serve: ${status.error}`
    : status.phase === "stalled" ? `The engine is stalled; new requests are refused until it goes on: ${status.error}`
    : PHASES[status.phase]);
  if (!status.requests) { // no model yet: nothing shown of an earlier server's run stays
    forgetRun();
    showNoRun();
    return;
  }
  if (page.history.length && status.scheduler.steps < page.history[page.history.length - 1].steps) forgetRun();
  const last = page.history[page.history.length - 1];
  const now = {
    t: status.time,
    prompt: status.tokens.prompt,
    generation: status.tokens.generation,
    steps: status.scheduler.steps,
    batch: status.scheduler.batch_tokens,
  };
  if (last && now.t <= last.t) page.history = []; // the server's clock went back
  page.history.push(now);
  while (page.history.length && page.history[0].t < now.t - HISTORY_S) page.history.shift();

  $("running").textContent = status.requests.running;
  $("waiting").textContent = status.requests.waiting;
  $("steps").textContent = now.steps;
  $("preemptions").textContent = status.scheduler.preemptions;
  if (last && now.steps > last.steps) {
    $("batch").textContent = ((now.batch - last.batch) / (now.steps - last.steps)).toFixed(1);
  } else if (last) {
    $("batch").textContent = "idle";
  }
  const prefix = status.prefix_cache;
  $("hit-rate").textContent = !prefix.enabled ? "off"
    : prefix.hit_rate === null ? "–" : `${(100 * prefix.hit_rate).toFixed(1)} %`;
  const rates = page.history.map((_, i) => rateAt(i));
  const current = rates[rates.length - 1];
  $("prompt-rate").textContent = current ? current.prompt.toFixed(1) : "–";
  $("gen-rate").textContent = current ? current.generation.toFixed(1) : "–";
  showPages(status.kv_pages);
  showSparkline(rates);
}

// Forget the run of the server seen so far: after an outage, or counters that went back, the server may be another
// one (restarted, perhaps with another model): its plan is read again and no rate spans the two.
function forgetRun() {
  page.history = [];
  page.planLoaded = false;
}

function showNoRun() {
  for (const dd of document.querySelectorAll("#runtime dd")) dd.textContent = "–";
  const bar = $("kv-bar");
  for (const part of bar.children) part.style.width = "0";
  bar.setAttribute("aria-label", "KV pages: not known yet");
  $("kv-legend").textContent = "–";
  showSparkline([]);
  $("plan").textContent = "not loaded yet";
}

// Tokens per second at history[i], over the RATE_WINDOW_S before it (null for the first answer).
function rateAt(i) {
  const h = page.history;
  let j = i;
  while (j > 0 && h[i].t - h[j - 1].t <= RATE_WINDOW_S) j -= 1;
  if (j === i) j = i - 1;
  if (j < 0) return null;
  const dt = h[i].t - h[j].t;
  return { t: h[i].t, prompt: (h[i].prompt - h[j].prompt) / dt, generation: (h[i].generation - h[j].generation) / dt };
}

function showPages(kv) {
  const share = (n) => `${(100 * n / kv.total).toFixed(2)}%`;
  const bar = $("kv-bar");
  bar.querySelector(".used").style.width = share(kv.used);
  bar.querySelector(".cached").style.width = share(kv.cached);
  // The host pool (--host-kv-tokens), where preempted requests' pages wait, is not on the bar: it is another memory.
  const host = kv.host_total ? `; host pool: ${kv.host_used} of ${kv.host_total} pages in use` : "";
  const text = `${kv.used} used, ${kv.cached} cached, ${kv.free} free of ${kv.total} pages (${kv.page_tokens} tokens each)${host}`;
  bar.setAttribute("aria-label", `KV pages: ${text}`);
  $("kv-legend").textContent = text;
}

function showSparkline(rates) {
  const points = rates.filter(Boolean);
  const top = Math.max(1, ...points.map((r) => Math.max(r.prompt, r.generation)));
  const end = points.length ? points[points.length - 1].t : 0;
  // The chart is a minute wide at first and widens with the history, up to HISTORY_S.
  const span = points.length ? Math.min(HISTORY_S, Math.max(60, end - points[0].t)) : 60;
  const line = (key) => points.map((r) => {
    const x = 300 - (end - r.t) * (300 / span);
    const y = 58 - (r[key] / top) * 56;
    return `${x.toFixed(1)},${y.toFixed(1)}`;
  }).join(" ");
  $("spark-prompt").setAttribute("points", line("prompt"));
  $("spark-gen").setAttribute("points", line("generation"));
  $("spark-max").textContent = `(the chart: ${span.toFixed(0)} s wide, ${top.toFixed(0)} tok/s high)`;
  const last = points[points.length - 1];
  $("spark").setAttribute("aria-label", last
    ? `now ${last.prompt.toFixed(1)} prompt and ${last.generation.toFixed(1)} generation tokens per second`
    : "no rates yet");
}

function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// -- wiring ------------------------------------------------------------------------------------

function submit(event) {
  event.preventDefault();
  const prompt = $("prompt");
  const text = prompt.value.trim();
  if (!text || page.controller) return;
  try {
    requestBody([]); // check the fields before the message leaves the box
  } catch (error) {
    notice("chat", error.message);
    return;
  }
  notice("chat", null);
  prompt.value = "";
  send(text);
}

document.addEventListener("DOMContentLoaded", () => {
  $("max_tokens").defaultValue = String(MAX_TOKENS);
  $("composer").addEventListener("submit", submit);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && page.controller && !$("key-dialog").open) stop();
  });
  $("stop").addEventListener("click", stop);
  $("enter-key").addEventListener("click", () => askKey(page.keyWhy));
  $("clear").addEventListener("click", () => {
    stop();
    page.conversation = [];
    $("messages").replaceChildren();
    notice("chat", null);
  });
  poll();
});
