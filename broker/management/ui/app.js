// warren's web UI. Polls /api/warren/cluster once a second (the nodes, the first queues that
// match the filter with their placement, counts, rates and sync progress, and the timeline's
// new events) and redraws in place; actions use the management API (policies, sync, cancel,
// purge, delete). Charts are small SVG polylines drawn here; nothing is fetched from anywhere
// but this node.
"use strict";

const POLL_MS = 1000;
const HISTORY_POINTS = 300; // five minutes of rate samples per queue, at one per poll
const SHOWN_QUEUES = 50;
const EVENTS_KEPT = 500;

let credentials = sessionStorage.getItem("warren-auth") || btoa("guest:guest");
let lastEvent = 0;
let events = [];
const history = {}; // queue key -> [[time, publish, deliver, ack], ...]
const cards = {}; // queue key -> its card's elements
// a queue's key: its name in the default vhost, vhost NUL name in another (the same queue name
// in two vhosts is two queues, two cards)
const queueKey = (x) => x.vhost === "/" ? x.name : x.vhost + "\u0000" + x.name;
let view = null;
let timer = null;
let polling = false; // a request is on its way
let pollAgain = false; // asked for a poll meanwhile (an action, the filter): one more at once

const $ = (id) => document.getElementById(id);

function esc(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

async function api(method, path, body) {
  const init = {method, headers: {"Authorization": "Basic " + credentials, "X-Warren-UI": "1"}};
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (response.status === 401) {
    showLogin("the node refused these credentials");
    throw new Error("not authorised");
  }
  const text = await response.text();
  const value = text ? JSON.parse(text) : null;
  if (!response.ok) {
    throw new Error((value && value.reason) || response.statusText);
  }
  return value;
}

const q = (name) => encodeURIComponent(name);

// --- login --------------------------------------------------------------------------------------
function showLogin(why) {
  $("login").hidden = false;
  $("main").hidden = true;
  $("login-error").textContent = why || "";
  if (timer) { clearTimeout(timer); timer = null; }
}

$("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  credentials = btoa($("login-user").value + ":" + $("login-password").value);
  sessionStorage.setItem("warren-auth", credentials);
  $("login").hidden = true;
  poll();
});

// --- polling ---------------------------------------------------------------------------------------
async function poll() {
  if (polling) { pollAgain = true; return; }
  if (timer) { clearTimeout(timer); timer = null; }
  polling = true;
  try {
    const filter = encodeURIComponent($("queue-filter").value.trim());
    view = await api("GET", `/api/warren/cluster?after=${lastEvent}&limit=${SHOWN_QUEUES}&filter=${filter}`);
    $("main").hidden = false;
    $("login").hidden = true;
    render(view);
    $("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    if (err.message === "not authorised") { polling = false; return; }
    $("status").textContent = "no answer from this node: " + err.message;
  }
  polling = false;
  timer = setTimeout(poll, pollAgain ? 0 : POLL_MS);
  pollAgain = false;
}

function render(v) {
  $("cluster-name").textContent = v.cluster_name;
  $("asked-node").textContent = "asking node " + v.node;
  for (const e of v.events) {
    events.push(e);
    lastEvent = Math.max(lastEvent, e.id);
  }
  if (events.length > EVENTS_KEPT) events = events.slice(-EVENTS_KEPT);
  renderNodes(v.nodes);
  renderPolicies(v.policies);
  renderQueues(v, true);
  renderEvents($("cluster-events"), events.filter((e) => !e.queue).slice(-40));
}

function renderNodes(nodes) {
  $("nodes").innerHTML = nodes.map((n) => {
    const state = n.paused ? "paused" : (n.running ? "running" : "down");
    const why = state === "down" && n.down_reason ? " (" + esc(n.down_reason) + ")" : "";
    const extra = n.metadata_leader ? " · metadata leader" : "";
    return `<div class="node ${state}" data-node="${esc(n.name)}" data-state="${state}">
      <b>${esc(n.name)}</b><div class="state">${state}${why}${extra}</div></div>`;
  }).join("");
}

function renderPolicies(policies) {
  if (!policies.length) {
    $("policies").innerHTML = "<tr><td class='muted'>no policy</td></tr>";
    return;
  }
  $("policies").innerHTML = "<tr><th>name</th><th>pattern</th><th>definition</th><th>priority</th><th></th></tr>" +
    policies.map((p) => `<tr data-policy="${esc(p.name)}"><td>${esc(p.name)}</td><td><code>${esc(p.pattern)}</code></td>
      <td><code>${esc(JSON.stringify(p.definition))}</code></td><td>${p.priority}</td>
      <td><button class="policy-clear" data-name="${esc(p.name)}">Clear</button></td></tr>`).join("");
}

$("policies").addEventListener("click", async (ev) => {
  const button = ev.target.closest(".policy-clear");
  if (!button) return;
  const name = button.dataset.name;
  if (!(await confirmStep(`Clear policy ${name}? Its queues lose their mirrors.`))) return;
  try {
    await api("DELETE", "/api/policies/%2F/" + q(name));
    $("policy-error").textContent = "";
  } catch (err) {
    $("policy-error").textContent = err.message;
  }
  poll();
});

$("policy-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  let definition;
  try {
    definition = JSON.parse($("policy-definition").value);
  } catch (err) {
    $("policy-error").textContent = "the definition is not JSON: " + err.message;
    return;
  }
  const priority = Number($("policy-priority").value || 0);
  try {
    await api("PUT", "/api/policies/%2F/" + q($("policy-name").value),
              {pattern: $("policy-pattern").value, definition, priority: Number.isInteger(priority) ? priority : $("policy-priority").value,
               "apply-to": $("policy-apply-to").value});
    $("policy-error").textContent = "";
  } catch (err) {
    $("policy-error").textContent = err.message;
  }
  poll();
});

// --- queues -------------------------------------------------------------------------------------------
function renderQueues(v, sampled) {
  const filter = $("queue-filter").value.trim();
  const shown = v.queues.filter((x) => !filter || x.name.includes(filter));
  $("queue-count").textContent = `${v.queue_count} queues` + (filter ? `, ${v.matching} matching` : "") +
    (v.matching > shown.length ? `; the first ${shown.length} shown (filter to see others)` : "");
  const now = Date.now() / 1000;
  const keys = new Set(shown.map(queueKey));
  for (const key of Object.keys(cards)) {
    if (!keys.has(key)) { cards[key].root.remove(); delete cards[key]; }
  }
  const running = new Set(v.nodes.filter((n) => n.running).map((n) => n.name));
  const members = v.nodes.map((n) => n.name);
  let previous = null;
  for (const x of shown) {
    const key = queueKey(x);
    const card = cards[key] || makeCard(x.vhost, x.name);
    const where = previous ? previous.nextSibling : $("queues").firstChild;
    if (card.root !== where) $("queues").insertBefore(card.root, where);
    previous = card.root;
    const ms = x.message_stats;
    const h = history[key] || (history[key] = []);
    if (sampled) {
      h.push([now, ms.publish_details.rate, ms.deliver_get_details.rate, ms.ack_details.rate]);
      if (h.length > HISTORY_POINTS) h.splice(0, h.length - HISTORY_POINTS);
    }
    updateCard(card, x, members, running, h);
  }
  for (const key of Object.keys(history)) {
    if (!keys.has(key)) delete history[key];
  }
}

function makeCard(vhost, name) {
  const root = document.createElement("div");
  root.className = "queue";
  root.dataset.queue = name;
  root.dataset.vhost = vhost;
  const where = vhost === "/" ? "" : ` <span class="vhost muted">vhost ${esc(vhost)}</span>`;
  const path = `/api/queues/${q(vhost)}/${q(name)}`;
  const called = vhost === "/" ? name : `${name} (vhost ${vhost})`;
  root.innerHTML = `
    <div class="queue-head"><h3>${esc(name)}${where}</h3><span class="policy muted"></span><span class="state"></span></div>
    <div class="queue-body">
      <div>
        <div class="placement"></div>
        <div class="stats"></div>
        <div class="sync" hidden>
          <div class="sync-track"><div class="sync-bar" style="width:0%"></div></div>
          <div class="sync-text"></div>
        </div>
        <div class="actions">
          <button class="act-sync">Sync</button>
          <button class="act-cancel-sync">Cancel sync</button>
          <button class="act-purge danger">Purge</button>
          <button class="act-delete danger">Delete</button>
        </div>
        <div class="action-error error"></div>
      </div>
      <div>
        <svg class="chart" viewBox="0 0 320 80" preserveAspectRatio="none"></svg>
        <div class="chart-legend"><span class="pub">■ publish</span> <span class="del">■ deliver/get</span>
          <span class="ack">■ ack</span> <span class="muted chart-max"></span></div>
      </div>
      <ol class="timeline queue-events"></ol>
    </div>`;
  const card = {root};
  for (const key of ["placement", "stats", "sync", "sync-bar", "sync-text", "policy", "state", "chart", "chart-max", "queue-events", "action-error"]) {
    card[key] = root.querySelector("." + key);
  }
  const act = async (what, run) => {
    card["action-error"].textContent = "";
    try { await run(); } catch (err) { card["action-error"].textContent = what + ": " + err.message; }
    poll();
  };
  root.querySelector(".act-sync").onclick = () => act("sync", () =>
    api("POST", `${path}/actions`, {action: "sync"}));
  root.querySelector(".act-cancel-sync").onclick = () => act("cancel sync", () =>
    api("POST", `${path}/actions`, {action: "cancel_sync"}));
  root.querySelector(".act-purge").onclick = async () => {
    if (await confirmStep(`Purge queue ${called}? Its ready messages are dropped.`)) {
      act("purge", () => api("DELETE", `${path}/contents`));
    }
  };
  root.querySelector(".act-delete").onclick = async () => {
    if (await confirmStep(`Delete queue ${called} and every message in it?`)) {
      act("delete", () => api("DELETE", path));
    }
  };
  cards[queueKey({vhost, name})] = card;
  return card;
}

function updateCard(card, x, members, running, h) {
  card.root.dataset.leader = x.node;
  card.root.dataset.state = x.state;
  card.policy.textContent = x.policy ? "policy " + x.policy + " " + JSON.stringify(x.effective_policy_definition) : "no policy";
  card.state.textContent = x.state;
  card.state.className = "state " + x.state;
  const synced = new Set(x.synchronised_slave_nodes);
  card.placement.innerHTML = members.map((n) => {
    let role = "none", label = "·", cls = "replica none";
    if (n === x.node) { role = "leader"; label = "L"; cls = "replica leader"; }
    else if (x.slave_nodes.includes(n)) {
      role = "mirror"; label = "M"; cls = "replica mirror " + (synced.has(n) ? "synced" : "unsynced");
    }
    if (!running.has(n)) cls += " on-down";
    const syncedAttr = role === "mirror" ? ` data-synced="${synced.has(n)}"` : "";
    return `<div class="slot"><span class="${cls}" data-replica="${esc(n)}" data-role="${role}"${syncedAttr}
      title="${esc(n)}: ${role}">${label}</span><div>${esc(n)}</div></div>`;
  }).join("");
  const ms = x.message_stats;
  card.stats.innerHTML = `<b class="depth">${x.messages}</b> messages (<b>${x.messages_ready}</b> ready,
    <b>${x.messages_unacknowledged}</b> unacked), <b>${x.consumers}</b> consumers<br>
    publish <b class="rate-publish">${ms.publish_details.rate}</b>/s ·
    deliver <b class="rate-deliver">${ms.deliver_get_details.rate}</b>/s ·
    ack <b class="rate-ack">${ms.ack_details.rate}</b>/s`;
  const p = x.sync_progress;
  card.sync.hidden = !p;
  if (!p) {  // no sync now: the bar forgets the last one's progress (the next starts from 0)
    card["sync-bar"].style.width = "0%";
    card["sync-bar"].dataset.progress = "0";
  } else {
    const pct = p.total_messages ? Math.min(100, 100 * p.messages / p.total_messages) : 100;
    card["sync-bar"].style.width = pct.toFixed(1) + "%";
    card["sync-bar"].dataset.progress = pct.toFixed(1);
    card["sync-text"].textContent = `syncing ${p.messages.toLocaleString()} / ${p.total_messages.toLocaleString()} messages · ` +
      `${(p.rate_bytes / 1e6).toFixed(2)} MB/s · ${Math.round(p.rate_msgs)} msg/s · ETA ${p.eta.toFixed(1)} s`;
  }
  drawChart(card.chart, card["chart-max"], h);
  renderEvents(card["queue-events"], events.filter((e) => e.queue === x.name && e.vhost === x.vhost).slice(-30));
}

function drawChart(svg, label, h) {
  const top = Math.max(1, ...h.map((s) => Math.max(s[1], s[2], s[3])));
  const t1 = h.length ? h[h.length - 1][0] : 0;
  // seconds across the chart: the history kept, from one minute up to five
  const span = Math.min(300, Math.max(60, h.length ? t1 - h[0][0] : 0));
  const line = (i, color, dash) => {
    const points = h.map((s) => [320 - (t1 - s[0]) * 320 / span, 78 - 74 * s[i] / top])
      .filter((pt) => pt[0] >= 0).map((pt) => pt[0].toFixed(1) + "," + pt[1].toFixed(1)).join(" ");
    return `<polyline fill="none" stroke="${color}" stroke-width="2" stroke-dasharray="${dash}" points="${points}"/>`;
  };
  // equal rates (every message delivered and acked) overlap: the later lines are dashed
  svg.innerHTML = line(1, "#1565c0", "") + line(2, "#2e7d32", "6 4") + line(3, "#ef6c00", "2 5");
  label.textContent = `(top ${top.toFixed(1)}/s, last ${Math.round(span / 60)} min)`;
}

function renderEvents(list, items) {
  list.innerHTML = items.slice().reverse().map((e) => {
    const t = new Date(e.at * 1000);
    const ms = String(t.getMilliseconds()).padStart(3, "0");
    return `<li class="event ${esc(e.kind)}" data-kind="${esc(e.kind)}"><time>${t.toLocaleTimeString()}.${ms}</time>${esc(e.text)}</li>`;
  }).join("");
}

// --- the confirmation step --------------------------------------------------------------------------------
function confirmStep(text) {
  return new Promise((resolve) => {
    $("confirm-text").textContent = text;
    $("confirm").hidden = false;
    const done = (answer) => {
      $("confirm").hidden = true;
      $("confirm-yes").onclick = $("confirm-no").onclick = null;
      resolve(answer);
    };
    $("confirm-yes").onclick = () => done(true);
    $("confirm-no").onclick = () => done(false);
  });
}

$("queue-filter").addEventListener("input", () => { if (view) renderQueues(view, false); poll(); });
poll();
