// Lockstep console: keeps the API key in this tab's session storage, loads each view with it in
// the X-API-Key header (never in a URL), refreshes the live parts, and calls the API for
// checkpoint actions and the playground. No framework, no build step.
"use strict";

const KEY = "lockstep-api-key";
const timers = [];
const $ = (sel, root = document) => root.querySelector(sel);

function key() { return sessionStorage.getItem(KEY); }

async function api(url, options = {}) {
  const headers = { "X-API-Key": key(), ...(options.headers || {}) };
  return fetch(url, { ...options, headers, cache: "no-store" });
}

async function detail(resp) {
  const text = await resp.text();
  try { return JSON.parse(text).detail || text; } catch (e) { return text; }
}

function showLogin(message) {
  sessionStorage.removeItem(KEY);
  timers.splice(0).forEach(clearInterval);
  $("#view").replaceChildren();
  $("#clock").hidden = true;
  $("#forget").hidden = true;
  $("#login").hidden = false;
  $("#login-error").textContent = message || "";
  $("#api-key").focus();
}

// A view's HTML, or null after showing the sign-in form (a key the server refuses).
async function fetchView(url) {
  const resp = await api(url);
  if (resp.status === 401) { showLogin(await detail(resp)); return null; }
  return { status: resp.status, html: await resp.text() };
}

function refresh(el, url, every) {
  timers.push(setInterval(async () => {
    if (document.hidden || el.contains(document.activeElement)) return; // never under the user
    const got = await fetchView(url).catch(() => null);
    if (got && got.status === 200) { el.innerHTML = got.html; el.dataset.updated = Date.now(); }
  }, every));
}

function startRefreshing(root) {
  root.querySelectorAll("[data-refresh]").forEach((el) =>
    refresh(el, el.dataset.refresh, Number(el.dataset.every || 3000)));
}

async function loadView() {
  timers.splice(0).forEach(clearInterval);
  const view = document.body.dataset.view;
  if (!key()) { showLogin(); return; }
  $("#login").hidden = true;
  $("#forget").hidden = false;
  const clock = $("#clock");
  clock.hidden = false;
  refresh(clock, clock.dataset.refresh, Number(clock.dataset.every));
  fetchView(clock.dataset.refresh).then((got) => { if (got) clock.innerHTML = got.html; });
  if (!view) return;
  const url = view + (document.body.dataset.page === "runs" ? location.search : "");
  const got = await fetchView(url);
  if (!got) return;
  const main = $("#view");
  main.innerHTML = got.html;
  main.dataset.status = got.status;
  const live = main.firstElementChild && main.firstElementChild.dataset.live;
  if (live) refresh(main, url, Number(live));
  startRefreshing(main);
  if (document.body.dataset.page === "playground") bindPlayground();
}

// ---------------------------------------------------------------- checkpoint actions
async function act(button) {
  const cell = button.closest("[data-base]");
  const base = cell.dataset.base;
  const action = button.dataset.action;
  if (button.dataset.confirm && !confirm(button.dataset.confirm)) return;
  const calls = {
    publish: [base + "/publish", "POST"],
    unpublish: [base + "/publish", "DELETE"],
    delete: [base, "DELETE"],
    download: [base + "/external_weights_urls", "GET"],
    expiry: [base + "/ttl", "PUT"],
  };
  const [url, method] = calls[action];
  const options = { method };
  if (action === "expiry") {  // as `tinker checkpoint set-ttl`: hours from now, or never
    const hours = prompt("Expire in how many hours from now? Leave empty to keep it.", "");
    if (hours === null) return;
    const ttl = hours.trim() === "" ? null : Math.round(Number(hours) * 3600);
    if (ttl !== null && !(ttl > 0)) { alert(`expiry: not a positive number of hours: ${hours}`); return; }
    options.headers = { "Content-Type": "application/json" };
    options.body = JSON.stringify({ ttl_seconds: ttl });
  }
  button.disabled = true;
  const resp = await api(url, options);
  button.disabled = false;
  if (!resp.ok) { alert(`${action}: ${resp.status} ${await detail(resp)}`); return; }
  if (action !== "download") { loadView(); return; }
  const { urls } = await resp.json();
  const list = $(".files", cell);
  list.replaceChildren(...Object.entries(urls).map(([name, href]) => {
    const li = document.createElement("li");
    const a = document.createElement("a");
    a.href = href; a.download = name; a.textContent = name;
    li.append(a);
    return li;
  }));
  const first = $("a", list);
  if (first) first.focus();
}

// ---------------------------------------------------------------- playground
function readImage(input) {
  const file = input && input.files[0];
  if (!file) return Promise.resolve(null);
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function renderSamples(model, body) {
  const column = document.createElement("section");
  column.className = "column";
  column.dataset.model = model;
  const h = document.createElement("h2");
  h.textContent = model;
  column.append(h);
  body.choices.forEach((choice, i) => {
    const art = document.createElement("article");
    art.className = "sample";
    const title = document.createElement("h3");
    title.textContent = `Sample ${i + 1}`;
    const text = document.createElement("p");
    text.className = "text";
    text.textContent = choice.message.content;
    const tokens = (choice.logprobs && choice.logprobs.content) || [];
    const total = tokens.reduce((s, t) => s + t.logprob, 0);
    const sum = document.createElement("p");
    sum.className = "note";
    sum.textContent = `${tokens.length} tokens, logprob ${total.toFixed(3)} (finish: ${choice.finish_reason})`;
    const details = document.createElement("details");
    const summary = document.createElement("summary");
    summary.textContent = "Tokens and their logprobs";
    const table = document.createElement("table");
    table.innerHTML = "<thead><tr><th scope='col'>token</th><th scope='col'>logprob</th></tr></thead>";
    const tbody = document.createElement("tbody");
    tokens.forEach((t) => {
      const tr = document.createElement("tr");
      const a = document.createElement("td"); a.textContent = JSON.stringify(t.token);
      const b = document.createElement("td"); b.textContent = t.logprob.toFixed(4);
      tr.append(a, b);
      tbody.append(tr);
    });
    table.append(tbody);
    details.append(summary, table);
    art.append(title, text, sum, details);
    column.append(art);
  });
  return column;
}

async function sample(form, model, image) {
  const content = image
    ? [{ type: "text", text: form.prompt.value }, { type: "image_url", image_url: { url: image } }]
    : form.prompt.value;
  const resp = await api("/oai/api/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({
      model,
      messages: [{ role: "user", content }],
      n: Number(form.n.value),
      max_tokens: Number(form.max_tokens.value),
      temperature: Number(form.temperature.value),
      logprobs: true,
    }),
  });
  if (!resp.ok) {
    const err = document.createElement("p");
    err.setAttribute("role", "alert");
    err.textContent = `${model}: ${resp.status} ${await detail(resp)}`;
    return err;
  }
  return renderSamples(model, await resp.json());
}

function bindPlayground() {
  const form = $("#playground");
  if (!form) return;
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const out = $("#samples");
    out.textContent = "Sampling…";
    const image = await readImage(form.image);
    const models = [form.model_a.value];
    if (form.compare.checked) models.push(form.model_b.value);
    const columns = await Promise.all(models.map((m) => sample(form, m, image)));
    out.replaceChildren(...columns);
    out.className = columns.length > 1 ? "side-by-side" : "";
  });
}

// ---------------------------------------------------------------- start
document.addEventListener("DOMContentLoaded", () => {
  $("#login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("#api-key").value.trim());
    $("#api-key").value = "";
    loadView();
  });
  $("#forget").addEventListener("click", () => showLogin());
  $("#view").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (button) act(button);
  });
  loadView();
});
