// The Ratchet console. Everything it shows it reads from the service's own routes with
// the bearer token the user gave (kept in this tab's sessionStorage); everything it
// writes into the page goes in as text (textContent), never as HTML.
"use strict";

const TOKEN_KEY = "ratchet.token";
const RUNS_PAGE = 50;
const RUNS_POLL_MS = 1500; // the list has no stream: one GET /runs per tick
const THREAD_POLL_MS = 1000; // while running: commits without a fact (executing) show too
const DETAIL_WORKERS = 4;

// ---- small helpers -----------------------------------------------------------------

const $ = (selector) => document.querySelector(selector);
const delay = (ms) => new Promise((done) => setTimeout(done, ms));

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else node.setAttribute(name, String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function setText(node, text) {
  const value = text === undefined || text === null ? "" : String(text);
  if (node.textContent !== value) node.textContent = value;
}

/** The problem in its box (its kind, then what it says), or the box hidden for none. */
function showProblem(box, error) {
  box.hidden = !error;
  setText(box, error ? (error.kind ? error.kind + ": " : "") + error.message : "");
}

function iso(sinceUs) {
  return sinceUs ? new Date(sinceUs / 1000).toISOString().replace(/\.\d+Z$/, "Z") : "";
}

function threadHref(thread) {
  return "/console/threads/" + encodeURIComponent(thread);
}

function threadApi(thread, tail) {
  return "/threads/" + encodeURIComponent(thread) + (tail || "");
}

// ---- the service's routes, with the token ------------------------------------------

class Unauthorized extends Error {}

class Problem extends Error {
  constructor(status, body) {
    super((body && body.detail) || "HTTP " + status);
    this.status = status;
    this.kind = (body && body.kind) || "";
  }
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = "Bearer " + token;
  let body;
  if (options.body !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(options.body);
  }
  const response = await fetch(path, {
    method: options.method || "GET",
    headers,
    body,
    cache: "no-store",
    credentials: "omit",
  });
  if (response.status === 401) {
    askForToken(token ? "That token was refused." : "");
    throw new Unauthorized();
  }
  if (!response.ok) {
    let problem = null;
    try {
      problem = await response.json();
    } catch (_) {
      problem = null;
    }
    throw new Problem(response.status, problem);
  }
  return response;
}

async function apiJson(path, options) {
  return (await api(path, options)).json();
}

// ---- the token ---------------------------------------------------------------------

let onSignedIn = null;

function signedOut() {
  return !$("#login").hidden;
}

function askForToken(message) {
  if (signedOut() && !message) return; // asked already: keep what it says
  sessionStorage.removeItem(TOKEN_KEY);
  $("#forget").hidden = true;
  for (const view of document.querySelectorAll("main")) view.hidden = true;
  $("#login").hidden = false;
  setText($("#login-error"), message);
  $("#login-error").hidden = !message;
  $("#token").focus();
}

function setUpLogin(start) {
  onSignedIn = start;
  $("#login").addEventListener("submit", (event) => {
    event.preventDefault();
    const token = $("#token").value.trim();
    if (!token) return;
    sessionStorage.setItem(TOKEN_KEY, token);
    $("#token").value = "";
    $("#login").hidden = true;
    onSignedIn();
  });
  $("#forget").addEventListener("click", () => askForToken(""));
}

function signedIn() {
  $("#forget").hidden = !sessionStorage.getItem(TOKEN_KEY);
}

// ---- the list of Runs --------------------------------------------------------------

function stateBadge(state, cause) {
  const bad = state === "ended" && cause && cause !== "natural";
  const text = state === "ended" && cause ? "ended (" + cause + ")" : state;
  return el("span", { class: "badge state-" + state + (bad ? " bad" : "") }, text);
}

function statusText(status) {
  return status.reason ? status.state + " · " + status.reason : status.state;
}

function runsView() {
  const view = $("#runs-view");
  const query = new URLSearchParams(location.search);
  const filter = $("#state-filter");
  filter.value = query.get("state") || "";
  filter.addEventListener("change", () => {
    const next = new URLSearchParams();
    if (filter.value) next.set("state", filter.value);
    location.search = next.toString();
  });
  const rows = new Map(); // thread id -> {tr, version, detail}
  let running = false;

  const showError = (error) => showProblem($("#runs-error"), error);

  async function details(wanted) {
    const queue = [...wanted];
    const worker = async () => {
      for (let row = queue.shift(); row; row = queue.shift()) {
        try {
          row.detail = await apiJson(threadApi(row.thread));
        } catch (error) {
          if (error instanceof Unauthorized) throw error;
        }
      }
    };
    await Promise.all(Array.from({ length: DETAIL_WORKERS }, worker));
  }

  function cells(row, run) {
    const detail = row.detail || {};
    const tr = row.tr;
    tr.dataset.state = run.state;
    tr.replaceChildren(
      el("td", { class: "thread id" }, el("a", { href: threadHref(run.thread_id) }, run.thread_id)),
      el("td", { class: "run id" }, run.run_id),
      el("td", { class: "state" }, stateBadge(run.state, run.cause)),
      el("td", { class: "status" }, statusText(run.status)),
      el("td", { class: "since mono" }, iso(run.status.since)),
      el("td", { class: "steps num" }, detail.steps === undefined ? "" : detail.steps),
      el("td", { class: "agent mono" }, detail.agent || ""),
    );
  }

  async function tick() {
    const params = new URLSearchParams({ limit: String(RUNS_PAGE) });
    for (const key of ["state", "cursor"]) if (query.get(key)) params.set(key, query.get(key));
    const page = await apiJson("/runs?" + params);
    signedIn();
    view.hidden = false;
    showError(null);
    const changed = [];
    for (const run of page.runs) {
      let row = rows.get(run.thread_id);
      if (!row) {
        row = { thread: run.thread_id, tr: el("tr", { "data-thread": run.thread_id }) };
        rows.set(run.thread_id, row);
      }
      if (row.version !== run.version) changed.push(row);
      row.run = run;
    }
    await details(changed); // steps and agent are in the frontier, not in the listing
    const body = $("#runs tbody");
    const seen = new Set();
    for (const run of page.runs) {
      const row = rows.get(run.thread_id);
      seen.add(run.thread_id);
      if (row.version !== run.version) {
        cells(row, run);
        row.version = run.version;
      }
      body.append(row.tr); // moves it into order: the same element, never a stale one
    }
    for (const [thread, row] of rows) {
      if (!seen.has(thread)) {
        row.tr.remove();
        rows.delete(thread);
      }
    }
    $("#runs-empty").hidden = page.runs.length > 0;
    const next = $("#next-page");
    next.hidden = !page.next_cursor;
    if (page.next_cursor) {
      const after = new URLSearchParams(query);
      after.set("cursor", page.next_cursor);
      next.setAttribute("href", "/?" + after);
    }
    $("#first-page").hidden = !query.get("cursor");
  }

  return async function start() {
    if (running) return;
    running = true;
    try {
      for (;;) {
        if (!document.hidden) {
          try {
            await tick();
          } catch (error) {
            if (error instanceof Unauthorized) return;
            // the token was taken (or no answer came): say why there is no list
            view.hidden = false;
            showError(error);
          }
        }
        await delay(RUNS_POLL_MS);
      }
    } finally {
      running = false;
    }
  };
}

// ---- one thread --------------------------------------------------------------------

function phaseText(phase) {
  switch (phase.kind) {
    case "executing":
      return "executing(" + phase.attempt + ")";
    case "awaiting":
      return "awaiting(" + phase.wait + ")";
    case "completed":
      return phase.output.is_error ? "completed (error)" : "completed";
    case "indeterminate":
      return "indeterminate: " + phase.reason;
    default:
      return phase.kind;
  }
}

function causeText(cause) {
  switch (cause.kind) {
    case "stopped":
      return "stopped: " + cause.reason;
    case "failed":
      return "failed: " + cause.failure + "/" + cause.code + (cause.message ? " — " + cause.message : "");
    case "indeterminate":
      return "indeterminate: " + cause.reason;
    default:
      return cause.kind;
  }
}

function messageItem(message) {
  if (message.kind === "user") {
    return el("li", { class: "msg user" }, el("div", { class: "role" }, "user"),
      el("div", { class: "text" }, message.text));
  }
  if (message.kind === "assistant") {
    const calls = message.tool_calls.map((call) =>
      el("li", {}, el("code", {}, call.tool + "(" + call.arguments + ")"), " ",
        el("span", { class: "muted" }, call.call_id)));
    return el("li", { class: "msg assistant" }, el("div", { class: "role" }, "assistant"),
      message.text ? el("div", { class: "text" }, message.text) : null,
      calls.length ? el("ul", { class: "tool-calls" }, calls) : null);
  }
  return el("li", { class: "msg tool_result" + (message.is_error ? " is-error" : "") },
    el("div", { class: "role" }, "tool result ",
      el("span", { class: "call" }, message.tool + " · " + message.call_id)),
    el("div", { class: "text" }, message.content));
}

function commitRow(record) {
  const commit = record.commit;
  const facts = commit.events.map((fact) => fact.type).join(", ");
  const status = commit.status ? statusText(commit.status) : "";
  const phases = commit.batch
    ? commit.batch.calls.map((call) => call.call_id + " " + phaseText(call.phase)).join("; ")
    : "";
  return el("tr", { "data-seq": record.seq, "data-label": commit.label },
    el("td", { class: "num" }, record.seq),
    el("td", { class: "label" }, commit.label),
    el("td", { class: "facts muted" }, facts),
    el("td", { class: "status" }, status),
    el("td", { class: "phases phase" }, phases));
}

function lastOffset(records) {
  for (let i = records.length - 1; i >= 0; i -= 1) {
    const events = records[i].commit.events;
    if (events.length) return records[i].seq + ":" + (events.length - 1);
  }
  return null;
}

function threadView(thread) {
  const view = $("#thread-view");
  const records = [];
  let summary = null;
  let batchKey = "";
  let ticketKey = "";
  let live = false;
  let following = false;
  let polling = false;

  // -- rendering

  function renderSummary() {
    setText($("#thread-id"), thread);
    document.title = thread + " · Ratchet console";
    setText($("#run-id"), summary.run_id);
    setText($("#agent"), summary.agent);
    const state = summary.run_state;
    const stateCell = $("#run-state");
    const text = !state ? "" : state.kind === "ended" ? "ended (" + causeText(state.cause) + ")" : state.kind;
    if (stateCell.dataset.text !== text) {
      stateCell.dataset.text = text;
      stateCell.dataset.state = state ? state.kind : "";
      stateCell.dataset.cause = state && state.kind === "ended" ? state.cause.kind : "";
      const bad = state && state.kind === "ended" && state.cause.kind !== "natural";
      stateCell.replaceChildren(
        el("span", { class: "badge state-" + (state ? state.kind : "") + (bad ? " bad" : "") }, text));
    }
    setText($("#run-status"), statusText(summary.status) + "  since " + iso(summary.status.since));
    setText($("#steps"), summary.steps);
    setText($("#version"), summary.version);
    $("#controls").hidden = !state || state.kind === "ended";
  }

  function renderTranscript(fresh) {
    const list = $("#transcript");
    for (const record of fresh) for (const message of record.commit.messages) list.append(messageItem(message));
  }

  function renderCommits(fresh) {
    const body = $("#commits tbody");
    for (const record of fresh) body.append(commitRow(record));
  }

  function renderBatch() {
    let batch = null;
    for (const record of records) if (record.commit.batch) batch = record.commit.batch;
    const key = JSON.stringify(batch);
    if (key === batchKey) return;
    batchKey = key;
    setText($("#batch-info"), batch ? "step " + batch.step + " · " + batch.status : "none yet");
    $("#batch tbody").replaceChildren(...(batch ? batch.calls : []).map((call) =>
      el("tr", { "data-call": call.call_id, "data-phase": call.phase.kind },
        el("td", { class: "id" }, call.call_id),
        el("td", {}, call.tool),
        el("td", {}, el("code", {}, call.arguments)),
        el("td", { class: "phase phase-" + call.phase.kind }, phaseText(call.phase)),
        el("td", { class: "num" }, call.attempts))));
  }

  function renderTicket() {
    const state = summary.run_state;
    const ticket = state && state.kind === "awaiting" ? state.ticket : null;
    const key = ticket ? ticket.correlation : "";
    if (key === ticketKey) return;
    ticketKey = key;
    const section = $("#ticket");
    section.hidden = !ticket;
    section.replaceChildren(...(ticket ? ticketContent(ticket).filter(Boolean) : []));
  }

  function ticketContent(ticket) {
    const target = ticket.target;
    const parts = [];
    const expires = target.kind === "tool_call" ? "; then the wait expires (the call fails, the Run goes on)" : "";
    const deadline = ticket.deadline_us ? el("p", { class: "muted" }, "answer by " + iso(ticket.deadline_us) + expires) : null;
    if (target.kind === "tool_call") {
      parts.push(el("h2", {}, "Awaiting " + target.wait.replace("_", " ")),
        el("p", {}, "Call ", el("code", { class: "ticket-call" }, target.tool + "(" + target.arguments + ")"),
          " ", el("span", { class: "muted" }, target.call_id)), deadline);
      if (target.wait === "permission") parts.push(permissionForm());
      else if (target.wait === "external_result") parts.push(resultForm());
      else if (target.wait === "scheduled_action") {
        parts.push(actions(button("Fire now", "fire", () => resume({ kind: "scheduled_action" }))));
      } else parts.push(el("p", { class: "muted" }, "Answered by its child Run when that ends."));
    } else if (target.kind === "user_input") {
      parts.push(el("h2", {}, "Awaiting user input"),
        el("p", { class: "ticket-prompt" }, target.prompt || "(no prompt)"), deadline, inputForm());
    } else {
      parts.push(el("h2", {}, "Paused (" + target.reason + ")"), deadline,
        actions(button("Unpause", "unpause", () => resume({ kind: "pause" }))));
    }
    return parts;
  }

  function button(label, name, onClick) {
    const node = el("button", { type: "button", id: "ticket-" + name, class: name }, label);
    node.addEventListener("click", onClick);
    return node;
  }

  function actions(...children) {
    return el("div", { class: "actions" }, ...children);
  }

  function permissionForm() {
    const note = el("input", { type: "text", id: "ticket-note", placeholder: "note (optional)", "aria-label": "note" });
    const decide = (approve) => () => resume({ kind: "permission", approve, note: note.value });
    return actions(button("Approve", "approve", decide(true)), button("Deny", "deny", decide(false)), note);
  }

  function inputForm() {
    const text = el("input", { type: "text", id: "ticket-text", placeholder: "answer", "aria-label": "answer" });
    return actions(text, button("Answer", "answer", () => resume({ kind: "user_input", text: text.value })));
  }

  function resultForm() {
    const output = el("textarea", { id: "ticket-output", placeholder: "the tool's output", "aria-label": "output" });
    const isError = el("input", { type: "checkbox", id: "ticket-is-error" });
    const send = () => resume({ kind: "external_result", output: { content: output.value, is_error: isError.checked } });
    return el("div", {}, output, actions(el("label", {}, isError, " the tool failed"), button("Send result", "answer", send)));
  }

  const showError = (error) => showProblem($("#error"), error);

  // -- actions (through the service's routes; the stream shows what they committed)

  async function act(path, body) {
    for (const node of view.querySelectorAll("#ticket button, #controls button")) node.disabled = true;
    try {
      await api(threadApi(thread, path), { method: "POST", body });
      showError(null);
    } catch (error) {
      if (error instanceof Unauthorized) return;
      showError(error);
    } finally {
      for (const node of view.querySelectorAll("#ticket button, #controls button")) node.disabled = false;
      refresh();
    }
  }

  const resume = (payload) => act("/resume", { payload });

  $("#cancel").addEventListener("click", () => act("/cancel"));
  $("#stop").addEventListener("click", () => {
    const reason = $("#stop-reason").value.trim() || "stopped from the console";
    act("/stop", { reason });
  });

  // -- reading: the frontier and the log, whenever the stream says something happened

  async function load() {
    summary = await apiJson(threadApi(thread));
    const fresh = [];
    let after = records.length ? records[records.length - 1].seq : 0;
    while (after !== null) {
      const page = await apiJson(threadApi(thread, "/commits?limit=500&after=" + after));
      fresh.push(...page.commits);
      after = page.next_after;
    }
    records.push(...fresh);
    signedIn();
    view.hidden = false;
    renderSummary();
    renderTicket();
    renderTranscript(fresh);
    renderCommits(fresh);
    renderBatch();
  }

  let loading = null;
  let again = false;

  function refresh() {
    if (loading) {
      again = true;
      return loading;
    }
    loading = (async () => {
      try {
        do {
          again = false;
          await load();
        } while (again);
      } catch (error) {
        if (!(error instanceof Unauthorized)) {
          view.hidden = false;
          showError(error);
        }
      } finally {
        loading = null;
      }
    })();
    return loading;
  }

  function setLive(on) {
    live = on;
    $("#live").hidden = !on;
  }

  async function follow() {
    following = true;
    let cursor = lastOffset(records);
    let backoff = 500;
    while (!signedOut()) {
      try {
        const headers = { Accept: "text/event-stream" };
        if (cursor) headers["Last-Event-ID"] = cursor;
        const response = await api(threadApi(thread, "/stream"), { headers });
        setLive(true);
        backoff = 500;
        for await (const frame of sseFrames(response)) {
          if (frame.id) cursor = frame.id;
          if (frame.event === "thread_status" || frame.event === "fact") refresh();
          // "delta": live text no store holds; the page shows committed facts only
        }
      } catch (error) {
        if (error instanceof Unauthorized) break;
      }
      setLive(false);
      await delay(backoff);
      backoff = Math.min(backoff * 2, 5000);
    }
    setLive(false);
    following = false; // start() follows again once a token is given
  }

  async function poll() {
    polling = true;
    for (;;) {
      await delay(THREAD_POLL_MS);
      const running = summary && summary.run_state && summary.run_state.kind === "running";
      if (!document.hidden && !signedOut() && (running || !live)) await refresh();
    }
  }

  return async function start() {
    await refresh();
    if (!summary) return;
    if (!following) follow();
    if (!polling) poll();
  };
}

// Server-sent events read from a fetch() body: EventSource cannot send the token.
async function* sseFrames(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const blocks = buffer.split(/\r\n\r\n|\n\n|\r\r/);
      buffer = blocks.pop();
      for (const block of blocks) {
        const frame = sseFrame(block);
        if (frame) yield frame;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function sseFrame(block) {
  const frame = { event: "message", data: [], id: null };
  for (const line of block.split(/\r\n|\n|\r/)) {
    if (!line || line.startsWith(":")) continue; // a ping
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") frame.event = value;
    else if (field === "data") frame.data.push(value);
    else if (field === "id") frame.id = value;
  }
  if (!frame.data.length) return null;
  return { event: frame.event, id: frame.id, data: frame.data.join("\n") };
}

// ---- which page --------------------------------------------------------------------

function main() {
  const prefix = "/console/threads/";
  const path = location.pathname;
  let start;
  if (path.startsWith(prefix)) {
    let thread = null;
    try {
      thread = decodeURIComponent(path.slice(prefix.length));
    } catch (_) {
      // not percent-encoded UTF-8: it names no thread (taken as raw text, it named
      // another thread, whose page and buttons then stood behind this address)
    }
    if (thread === null) {
      const box = $("#error");
      box.hidden = false;
      setText(box, "This address names no thread: it is not percent-encoded UTF-8.");
      $("#thread-view").hidden = false;
      return;
    }
    start = threadView(thread);
  } else {
    start = runsView();
  }
  setUpLogin(start);
  start();
}

main();
