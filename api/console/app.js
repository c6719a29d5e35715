// The DSS web console: a static page over the public REST API (docs/api.md, docs/console.md).
// Every data call is `fetch` with the signed-in key; API data is only ever rendered with
// textContent or SVG attributes (never parsed as HTML), so a message cannot inject markup.

const store = window.sessionStorage;
const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const TIERS = ["host", "disk", "remote"];

// ------------------------------------------------------------------------------------ API
function credentials() {
  return { key: store.getItem("dss.key") || "", user: store.getItem("dss.user") || "" };
}

function headers(extra = {}) {
  const { key, user } = credentials();
  const h = { ...extra };
  if (key) h.Authorization = `Bearer ${key}`;
  else if (user) h["X-DSS-User"] = user;
  return h;
}

class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function failure(r) {
  let message = `${r.status} ${r.statusText}`;
  let code = null;
  try {
    const body = await r.json();
    if (body && body.error) {
      message = `${r.status}: ${body.error.message}`;
      code = body.error.code;
    }
  } catch (_) {
    /* not JSON: keep the status line */
  }
  return new ApiError(r.status, message, code);
}

async function api(method, path, body) {
  const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  let r;
  try {
    r = await fetch(path, init);
  } catch (exc) {
    throw new ApiError(0, `the server does not answer (${exc.message})`, "network");
  }
  if (!r.ok) throw await failure(r);
  const type = r.headers.get("Content-Type") || "";
  return type.includes("json") ? r.json() : r.text();
}

// Streams a stateful turn; calls onDelta(text) per content chunk, returns the final chunk's fields.
async function streamTurn(sid, body, onDelta) {
  const r = await fetch(`/v1/sessions/${encodeURIComponent(sid)}/messages`, {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify({ ...body, stream: true }),
  });
  if (!r.ok) throw await failure(r);
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let final = {};
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, nl).trim();
      buffer = buffer.slice(nl + 1);
      if (!line.startsWith("data: ")) continue;
      const payload = line.slice(6);
      if (payload === "[DONE]") return final;
      const event = JSON.parse(payload);
      if (event.error) throw new ApiError(0, event.error.message, event.error.code);
      for (const choice of event.choices || []) {
        if (choice.delta && choice.delta.content) onDelta(choice.delta.content);
      }
      if (event.state_version !== undefined) final = event;
    }
  }
  return final;
}

// ------------------------------------------------------------------------------ helpers
function showError(exc) {
  const box = $("error");
  box.textContent = exc instanceof Error ? exc.message : String(exc);
  box.hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function mount(templateId) {
  const view = $("view");
  view.replaceChildren($(templateId).content.cloneNode(true));
  return view;
}

function when(iso) {
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? String(iso) : d.toLocaleString();
}

function bytes(n) {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n / 1024;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v.toFixed(1)} ${units[i]}`;
}

// Tokens whose KV a continuation would load from DSS: each tier counts what it holds, so the
// largest count is what is certainly cached (a page on two tiers counts in both).
function cachedTokens(v) {
  return Math.max(0, ...TIERS.map((t) => (v.resident && v.resident[t]) || 0));
}

function fastestTier(v) {
  for (const t of TIERS) if (v.resident && v.resident[t] > 0) return t;
  return "none";
}

async function guarded(fn) {
  clearError();
  try {
    await fn();
  } catch (exc) {
    showError(exc);
  }
}

// --------------------------------------------------------------------------------- router
let stopPolling = null;

async function route() {
  if (stopPolling) {
    stopPolling();
    stopPolling = null;
  }
  clearError();
  const { key, user } = credentials();
  const signedIn = Boolean(key || user);
  $("nav").hidden = !signedIn;
  if (!signedIn) return signIn();
  $("whoami").textContent = key ? "signed in with a key" : `dev user ${user}`;
  const hash = window.location.hash || "#/sessions";
  const m = hash.match(/^#\/s\/(.+)$/);
  try {
    if (m) await sessionView(decodeURIComponent(m[1]));
    else if (hash === "#/admin") await adminView();
    else await sessionsView();
  } catch (exc) {
    showError(exc);
  }
}

function signIn() {
  mount("tpl-signin");
  $("signin-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("signin-key").value.trim();
    const user = $("signin-user").value.trim();
    if (!key && !user) return showError("enter an API key, or a user name in development mode");
    store.setItem("dss.key", key);
    store.setItem("dss.user", key ? "" : user);
    clearError();
    api("GET", "/v1/sessions?limit=1").then(
      () => {
        if (window.location.hash === "#/sessions") route();
        else window.location.hash = "#/sessions"; // hashchange routes
      },
      (exc) => {
        store.removeItem("dss.key");
        store.removeItem("dss.user");
        showError(exc);
      },
    );
  });
}

// ------------------------------------------------------------------------------ sessions
async function sessionsView() {
  mount("tpl-sessions");
  $("new-session-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    guarded(async () => {
      const body = {};
      const id = $("new-session-id").value.trim();
      const system = $("new-session-system").value.trim();
      if (id) body.session_id = id;
      if (system) body.system_prompt = system;
      const s = await api("POST", "/v1/sessions", body);
      window.location.hash = `#/s/${encodeURIComponent(s.id)}`;
    });
  });
  const sessions = [];
  let after = null;
  do {
    const q = after ? `&after=${encodeURIComponent(after)}` : "";
    const page = await api("GET", `/v1/sessions?limit=100${q}`);
    sessions.push(...page.data);
    after = page.has_more ? page.last_id : null;
  } while (after && sessions.length < 500);
  sessions.sort((a, b) => (a.updated_at < b.updated_at ? 1 : -1));
  const tbody = $("sessions-table").querySelector("tbody");
  $("sessions-empty").hidden = sessions.length > 0;
  for (const s of sessions) {
    const tr = document.createElement("tr");
    tr.dataset.session = s.id;
    const link = el("a", s.id);
    link.href = `#/s/${encodeURIComponent(s.id)}`;
    const name = el("td");
    name.append(link);
    const tokens = el("td", "…");
    const tier = el("td", "…");
    const stored = el("td", bytes(s.stored_bytes));
    stored.className = "stored";
    tr.append(name, el("td", s.version_count), el("td", s.branches.length), el("td", when(s.updated_at)), stored, tokens, tier);
    tbody.append(tr);
    const main = s.branches.find((b) => b.name === "main");
    if (!main || main.head_version === 0) {
      tokens.textContent = "0";
      tier.textContent = "–";
      continue;
    }
    api("GET", `/v1/sessions/${encodeURIComponent(s.id)}/versions/${main.head_version}`).then(
      (v) => {
        tokens.textContent = String(v.n_tokens);
        tier.textContent = `${cachedTokens(v)} cached (${fastestTier(v)})`;
      },
      () => {
        tokens.textContent = "?";
        tier.textContent = "?";
      },
    );
  }
}

// ------------------------------------------------------------------------- version tree
// Lays the versions out git-log style: one row per version (newest on top), one lane per
// branch a version was committed on, edges from each parent to its children.
function layout(versions) {
  const lanes = new Map();
  for (const v of versions) if (!lanes.has(v.branch)) lanes.set(v.branch, lanes.size);
  const rows = [...versions].sort((a, b) => b.number - a.number);
  const pos = new Map();
  rows.forEach((v, i) => pos.set(v.number, { x: lanes.get(v.branch), y: i }));
  return { lanes, rows, pos };
}

function drawTree(container, versions, branches, selected, onSelect) {
  const { lanes, rows, pos } = layout(versions);
  const dx = 26;
  const dy = 34;
  const left = 16;
  const top = 18;
  const labelX = left + Math.max(1, lanes.size) * dx + 8;
  const heads = new Map();
  for (const b of branches) {
    if (b.head_version === 0) continue;
    if (!heads.has(b.head_version)) heads.set(b.head_version, []);
    heads.get(b.head_version).push(b.name);
  }
  const width = labelX + 360;
  const height = top + Math.max(1, rows.length) * dy;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, id: "tree-svg", role: "img" });
  root.append(svg("title", {}, "version tree"));
  const cx = (v) => left + pos.get(v.number).x * dx;
  const cy = (v) => top + pos.get(v.number).y * dy;
  for (const v of rows) {
    if (v.parent === null || !pos.has(v.parent)) continue;
    const p = versions.find((w) => w.number === v.parent);
    const [x1, y1, x2, y2] = [cx(p), cy(p), cx(v), cy(v)];
    const d = x1 === x2 ? `M${x1},${y1} L${x2},${y2}` : `M${x1},${y1} C${x1},${y1 - dy / 2} ${x2},${y2 + dy / 2} ${x2},${y2}`;
    root.append(svg("path", { d, class: `edge lane-${pos.get(v.number).x % 6}` }));
  }
  for (const v of rows) {
    const g = svg("g", { class: `node${v.number === selected ? " selected" : ""}`, "data-version": v.number, tabindex: 0 });
    g.append(svg("circle", { cx: cx(v), cy: cy(v), r: 7, class: `dot lane-${pos.get(v.number).x % 6}` }));
    const tier = fastestTier(v);
    const text = svg("text", { x: labelX, y: cy(v) + 4, class: "label" });
    text.append(svg("tspan", { class: "vnum" }, `v${v.number}`));
    text.append(svg("tspan", { dx: 8, class: "meta" }, `${v.n_tokens} tok · ${cachedTokens(v)} cached · ${tier}`));
    for (const name of heads.get(v.number) || []) {
      text.append(svg("tspan", { dx: 8, class: "head", "data-branch": name }, `[${name}]`));
    }
    g.append(text);
    g.addEventListener("click", () => onSelect(v.number));
    g.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter") onSelect(v.number);
    });
    root.append(g);
  }
  container.replaceChildren(root);
}

// Every version of the session, a page at a time (the server lists `limits.max_list_limit` at most
// per request): the tree needs them all.
async function allVersions(path) {
  const versions = [];
  let after = null;
  do {
    const q = after ? `?after=${encodeURIComponent(after)}` : "";
    const page = await api("GET", `${path}/versions${q}`);
    versions.push(...page.data);
    after = page.has_more ? page.last_id : null;
  } while (after);
  return versions;
}

async function sessionView(sid) {
  mount("tpl-session");
  const path = `/v1/sessions/${encodeURIComponent(sid)}`;
  $("session-title").textContent = sid;
  let session;
  let versions;
  let selected = null;

  async function reload(select) {
    [session, versions] = await Promise.all([api("GET", path), allVersions(path)]);
    const heads = session.branches.map((b) => `${b.name} → v${b.head_version}`).join(", ");
    $("session-summary").textContent =
      `${session.version_count} versions · branches: ${heads || "none"} · last activity ${when(session.updated_at)}`;
    const sel = $("rollback-branch");
    sel.replaceChildren(...session.branches.map((b) => el("option", b.name)));
    if (select !== undefined) selected = select;
    if (selected === null || !versions.some((v) => v.number === selected)) {
      const main = session.branches.find((b) => b.name === "main");
      selected = main && main.head_version ? main.head_version : versions.length ? versions[versions.length - 1].number : null;
    }
    drawTree($("tree"), versions, session.branches, selected, (n) => guarded(() => choose(n)));
    await choose(selected);
  }

  let choosing = 0; // only the latest selection renders (an older fetch may answer later)
  async function choose(n) {
    selected = n;
    const ticket = ++choosing;
    for (const g of $("tree").querySelectorAll(".node")) {
      g.classList.toggle("selected", Number(g.dataset.version) === n);
    }
    const list = $("sel-messages");
    const kv = $("sel-kv");
    if (n === null) {
      $("sel-number").textContent = "– (empty session)";
      kv.replaceChildren(el("p", "No version yet: the first message starts the dialogue.", "hint"));
      list.replaceChildren();
      return;
    }
    const v = await api("GET", `${path}/versions/${n}`);
    if (ticket !== choosing) return;
    $("sel-number").textContent = `${v.number} (on ${v.branch}, parent ${v.parent === null ? "none" : `v${v.parent}`})`;
    const dl = el("dl");
    const add = (k, val) => dl.append(el("dt", k), el("dd", val));
    add("tokens", v.n_tokens);
    for (const t of TIERS) add(t, `${v.resident[t] || 0} tokens`);
    add("served from cache if continued", `${cachedTokens(v)} of ${v.n_tokens} tokens`);
    add("created", when(v.created_at));
    kv.replaceChildren(dl);
    list.replaceChildren(
      ...v.messages.map((m) => {
        const li = el("li", null, `msg ${m.role}`);
        const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
        li.append(el("span", m.role, "role"), el("span", content, "content"));
        return li;
      }),
    );
    const head = session.branches.find((b) => b.head_version === n);
    $("chat-send").textContent = head ? `Send on ${head.name}` : `Send (forks from v${n})`;
  }

  $("chat-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const content = $("chat-input").value.trim();
    if (!content) return showError("type a message first");
    const out = $("chat-stream");
    out.textContent = "";
    out.dataset.state = "streaming";
    $("chat-send").disabled = true;
    guarded(async () => {
      const body = { content, max_tokens: Number($("chat-max").value) || 24, temperature: 0 };
      const head = selected === null ? null : session.branches.find((b) => b.head_version === selected);
      if (selected === null) body.branch = "main";
      else if (head) body.branch = head.name;
      else body.version = selected;
      const final = await streamTurn(sid, body, (t) => {
        out.textContent += t;
      });
      $("chat-input").value = "";
      out.dataset.state = "done";
      out.dataset.version = String(final.state_version);
      await reload(final.state_version);
    }).finally(() => {
      $("chat-send").disabled = false;
      if (out.dataset.state === "streaming") out.dataset.state = "failed";
    });
  });

  $("rollback-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    guarded(async () => {
      if (selected === null) throw new Error("select a version first");
      const branch = $("rollback-branch").value;
      await api("POST", `${path}/rollback`, { to_version: selected, branch });
      await reload(selected);
    });
  });

  $("branch-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    guarded(async () => {
      if (selected === null) throw new Error("select a version first");
      const name = $("branch-name").value.trim();
      if (!name) throw new Error("name the branch");
      await api("POST", `${path}/branches`, { from_version: selected, name });
      $("branch-name").value = "";
      await reload(selected);
    });
  });

  $("delete-session").addEventListener("click", () => {
    if (!window.confirm(`Delete session ${sid} with all its versions?`)) return;
    guarded(async () => {
      await api("DELETE", path);
      window.location.hash = "#/sessions";
    });
  });

  await reload();
}

// --------------------------------------------------------------------------------- admin
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const pair of (m[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
    samples.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return samples;
}

function byTier(samples, name) {
  const out = {};
  for (const s of samples) if (s.name === name && s.labels.tier) out[s.labels.tier] = s.value;
  return out;
}

function total(samples, name) {
  return samples.filter((s) => s.name === name).reduce((a, s) => a + s.value, 0);
}

const HISTORY = 40;
const history = []; // {hit, fill: {tier: fraction}} per poll, kept across visits of the view
let previous = null;

function lineChart(container, series, id) {
  const width = 360;
  const height = 120;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, id, class: "chart" });
  for (const f of [0, 0.5, 1]) {
    const y = height - 14 - f * (height - 24);
    root.append(svg("line", { x1: 30, x2: width - 4, y1: y, y2: y, class: "grid" }));
    root.append(svg("text", { x: 2, y: y + 4, class: "axis" }, `${Math.round(f * 100)}%`));
  }
  let legendX = 34;
  series.forEach((s, i) => {
    const pts = s.values
      .map((v, j) => (v === null ? null : `${30 + (j * (width - 34)) / (HISTORY - 1)},${height - 14 - v * (height - 24)}`))
      .filter((p) => p !== null);
    if (pts.length) root.append(svg("polyline", { points: pts.join(" "), class: `series s${i}` }));
    root.append(svg("text", { x: legendX, y: height - 2, class: `legend s${i}` }, s.name));
    legendX += 12 + s.name.length * 7;
  });
  container.replaceChildren(root);
}

async function pollMetrics() {
  const text = await api("GET", "/metrics");
  const samples = parseMetrics(text);
  const used = byTier(samples, "dss_tier_used_bytes");
  const cap = byTier(samples, "dss_tier_capacity_bytes");
  const pages = byTier(samples, "dss_pages");
  const hits = byTier(samples, "dss_tokens_hit_total");
  const looked = total(samples, "dss_tokens_looked_up_total");
  const hitSum = Object.values(hits).reduce((a, b) => a + b, 0);
  let rate = null;
  if (previous && looked > previous.looked) rate = Math.min(1, (hitSum - previous.hitSum) / (looked - previous.looked));
  else if (!previous && looked > 0) rate = Math.min(1, hitSum / looked);
  previous = { looked, hitSum };
  const fill = {};
  for (const t of Object.keys(cap)) fill[t] = cap[t] > 0 ? (used[t] || 0) / cap[t] : null;
  history.push({ rate, fill });
  while (history.length > HISTORY) history.shift();

  const tbody = $("tiers-table").querySelector("tbody");
  const tiers = [...new Set([...Object.keys(pages), ...Object.keys(used), ...Object.keys(hits)])];
  tbody.replaceChildren(
    ...tiers.map((t) => {
      const tr = el("tr");
      tr.append(
        el("td", t),
        el("td", pages[t] ?? "–"),
        el("td", used[t] !== undefined ? bytes(used[t]) : "–"),
        el("td", cap[t] !== undefined ? bytes(cap[t]) : "–"),
        el("td", hits[t] ?? 0),
      );
      return tr;
    }),
  );
  lineChart($("chart-hits"), [{ name: "hit rate", values: history.map((h) => h.rate) }], "chart-hits-svg");
  const fillTiers = Object.keys(cap);
  lineChart(
    $("chart-fill"),
    fillTiers.map((t) => ({ name: t, values: history.map((h) => (h.fill[t] === undefined ? null : h.fill[t])) })),
    "chart-fill-svg",
  );
}

function receiptIds() {
  try {
    return JSON.parse(window.localStorage.getItem("dss.receipts") || "[]");
  } catch (_) {
    return [];
  }
}

function rememberReceipt(id) {
  const ids = receiptIds().filter((x) => x !== id);
  ids.unshift(id);
  window.localStorage.setItem("dss.receipts", JSON.stringify(ids.slice(0, 50)));
}

function verificationText(v) {
  return `${v.remnants} remnants · chain ${v.chain_ok ? "ok" : "BROKEN"} · checked ${when(v.checked_at)}`;
}

function receiptRow(r) {
  const tr = el("tr");
  tr.dataset.receipt = r.id;
  const c = r.counts || {};
  const counts = `${c.sessions ?? 0} sessions, ${c.versions ?? 0} versions, ${c.page_rows ?? 0} page rows`;
  // A listed receipt carries no verification until "Verify again" asks for one.
  const verification = r.verification
    ? el("td", verificationText(r.verification), r.verification.remnants === 0 ? "ok" : "bad")
    : el("td", "not checked in this view");
  verification.classList.add("verification");
  const button = el("button", "Verify again", "verify");
  button.type = "button";
  button.addEventListener("click", () =>
    guarded(async () => {
      verification.textContent = "verifying…";
      const fresh = await api("GET", `/v1/erasures/${encodeURIComponent(r.id)}`);
      verification.textContent = verificationText(fresh.verification);
      verification.className = `verification ${fresh.verification.remnants === 0 && fresh.verification.chain_ok ? "ok" : "bad"}`;
      verification.dataset.checked = fresh.verification.checked_at;
    }),
  );
  const action = el("td");
  action.append(button);
  tr.append(el("td", r.id, "mono"), el("td", when(r.erased_at)), el("td", counts), verification, action);
  return tr;
}

async function adminView() {
  mount("tpl-admin");
  const receipts = $("receipts-table").querySelector("tbody");
  $("erase-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const user = $("erase-user").value.trim();
    if (!user) return showError("name the user to erase");
    if (!window.confirm(`Erase everything of user ${user}?`)) return;
    guarded(async () => {
      const r = await api("DELETE", `/v1/users/${encodeURIComponent(user)}`);
      // Nothing of the user was stored: the server wrote no receipt (receipts are permanent).
      if (r.held_nothing) return showError(`nothing of user ${user} was stored: nothing to erase, no receipt`);
      rememberReceipt(r.id);
      receipts.prepend(receiptRow(r));
      $("erase-user").value = "";
    });
  });
  $("receipt-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    guarded(async () => {
      const id = $("receipt-id").value.trim();
      const r = await api("GET", `/v1/erasures/${encodeURIComponent(id)}`);
      rememberReceipt(r.id);
      receipts.prepend(receiptRow(r));
      $("receipt-id").value = "";
    });
  });
  // Each part reports its own error: a user key still sees its own receipts and the prefixes.
  const prefixes = api("GET", "/v1/prefixes").then((page) => {
    const tbody = $("prefixes-table").querySelector("tbody");
    $("prefixes-empty").hidden = page.data.length > 0;
    tbody.replaceChildren(
      ...page.data.map((p) => {
        const tr = el("tr");
        tr.append(el("td", p.id, "mono"), el("td", p.n_tokens), el("td", p.pinned ? "yes" : "no"), el("td", (p.text || "").slice(0, 160)));
        return tr;
      }),
    );
  });
  // Admins: the server's list. Users (403 there): the receipts this browser erased or looked up.
  api("GET", "/v1/erasures?limit=50").then(
    (page) => {
      const shown = new Set([...receipts.querySelectorAll("tr")].map((tr) => tr.dataset.receipt));
      receipts.append(...page.data.filter((r) => !shown.has(r.id)).map(receiptRow));
    },
    () => {
      for (const id of receiptIds()) {
        api("GET", `/v1/erasures/${encodeURIComponent(id)}`).then(
          (r) => receipts.append(receiptRow(r)),
          () => {},
        );
      }
    },
  );
  await prefixes.catch(showError);
  await pollMetrics().catch(showError);
  const timer = window.setInterval(() => pollMetrics().catch(showError), 3000);
  stopPolling = () => window.clearInterval(timer);
}

// ---------------------------------------------------------------------------------- start
$("sign-out").addEventListener("click", () => {
  store.removeItem("dss.key");
  store.removeItem("dss.user");
  window.location.hash = "";
  route();
});
window.addEventListener("hashchange", route);
window.addEventListener("unhandledrejection", (ev) => showError(ev.reason));
route();
