// aelastic pages: draws the views the server streams (server-sent events); no build step.
"use strict";

// Set once per page load: a page that updates itself keeps it (tests check it).
window.aelasticLoadedAt = Date.now();

(function () {
  const body = document.body;
  const main = document.getElementById("main");
  const connection = document.getElementById("connection");
  const view = body.dataset.view;
  let latest = null;       // the newest view
  let skewMs = 0;          // this browser's clock minus the backend's
  let source = null;

  // -- small helpers ------------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined) node.setAttribute(key, value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  const SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function seconds(ms) {
    const s = Math.max(ms, 0) / 1000;
    if (s < 10) return s.toFixed(1) + " s";
    if (s < 120) return Math.round(s) + " s";
    if (s < 7200) return Math.round(s / 60) + " min";
    return (s / 3600).toFixed(1) + " h";
  }

  function backendNow() {
    return Date.now() - skewMs;
  }

  function clockTime(backendMs) {
    return new Date(backendMs + skewMs).toLocaleTimeString([], { hour12: false });
  }

  function badge(state) {
    return el("span", { class: "badge " + state, "data-state": state }, state);
  }

  function tile(label, value, sub, id) {
    return el("div", { class: "tile", id: id },
      el("div", { class: "label" }, label),
      el("div", { class: "value", id: id === "tile-deadline" ? "deadline" : null }, value),
      sub ? el("div", { class: "sub" }, sub) : null);
  }

  function runHref(runId) {
    return body.dataset.root + "runs/" + encodeURIComponent(runId);
  }

  // -- the list of runs ---------------------------------------------------------------------

  function renderRuns(data) {
    const parts = [el("div", { class: "title" }, el("h1", {}, "Runs"),
      el("span", { class: "muted" }, data.runs.length + (data.more ? "+" : "") + " run(s)"))];
    if (data.error) parts.push(el("p", { class: "notice bad" }, "Cannot list the runs: " + data.error));
    const card = el("section", { class: "card" });
    if (!data.runs.length) {
      card.append(el("p", { class: "empty", id: "no-runs" },
        "No runs yet. Nodes appear here once they join a rendezvous."));
    } else {
      const rows = data.runs.map((run) => el("tr", { "data-run": run.run_id },
        el("td", {}, el("a", { href: runHref(run.run_id), class: "mono" }, run.run_id)),
        el("td", { class: "num" }, run.round),
        el("td", {}, badge(run.state)),
        el("td", { class: "num members" }, run.participants +
          (run.world && run.state !== "forming" ? " of " + run.world : "")),
        el("td", { class: "num" }, run.waiting),
        el("td", { class: "num" }, run.redundant),
        el("td", { class: "num" }, run.lost)));
      card.append(el("table", { id: "runs" },
        el("thead", {}, el("tr", {}, el("th", {}, "Run"), el("th", { class: "num" }, "Round"),
          el("th", {}, "State"), el("th", { class: "num" }, "Members"),
          el("th", { class: "num" }, "Waiting"), el("th", { class: "num" }, "Redundant"),
          el("th", { class: "num" }, "Lost"))),
        el("tbody", {}, rows)));
      if (data.more) card.append(el("p", { class: "muted" }, "More runs exist than are listed."));
    }
    parts.push(card);
    main.replaceChildren(...parts);
  }

  // -- one run ------------------------------------------------------------------------------

  function ageCell(member) {
    return el("td", { class: "age-cell" }, el("div", { class: "age" },
      el("span", { class: "age-text", "data-beat": member.beat_ms }),
      el("span", { class: "bar", "data-beat": member.beat_ms })));
  }

  function memberTable(id, members, ranked) {
    if (!members.length) return el("p", { class: "empty", id: id + "-none" }, "none");
    const head = el("tr", {}, ranked ? el("th", { class: "num" }, "Rank") : null,
      el("th", {}, "Node"), el("th", {}, "Address"), el("th", { class: "num" }, "PID"),
      el("th", {}, "Last heartbeat"));
    const rows = members.map((m) => el("tr", { "data-node": m.node },
      ranked ? el("td", { class: "num rank" }, m.rank === null ? "–" : m.rank) : null,
      el("td", { class: "mono node" }, m.node),
      el("td", {}, m.addr),
      el("td", { class: "num" }, m.pid),
      ageCell(m)));
    return el("table", { id: id }, el("thead", {}, head), el("tbody", {}, rows));
  }

  // Heartbeat ages and the last call's countdown move every second, between events.
  function tick() {
    const now = backendNow();
    const beats = [...main.querySelectorAll(".age-text")].map((n) => now - Number(n.dataset.beat));
    const sorted = beats.slice().sort((a, b) => a - b);
    const typical = Math.max(sorted.length ? sorted[Math.floor(sorted.length / 2)] : 0, 1000);
    const oldest = Math.max(...beats, typical);
    for (const node of main.querySelectorAll("[data-beat]")) {
      const age = now - Number(node.dataset.beat);
      if (node.classList.contains("bar")) {
        node.style.width = Math.max(2, Math.round((80 * age) / oldest)) + "px";
        node.classList.toggle("old", age > 3 * typical && age > 3000);
      } else {
        node.textContent = seconds(age) + " ago";
      }
    }
    const deadline = document.getElementById("deadline");
    if (deadline && latest) deadline.textContent = deadlineText(latest, now);
    const chart = document.getElementById("timeline");
    if (chart && latest) chart.replaceWith(drawTimeline(latest, now));
  }

  function deadlineText(data, now) {
    if (data.deadline_ms === null || data.deadline_ms === undefined) return "—";
    return "in " + seconds(data.deadline_ms - now);
  }

  function deadlineNote(data) {
    if (data.deadline_ms === null || data.deadline_ms === undefined) return "none pending";
    return "then the round closes for joining";
  }

  function renderRun(data) {
    const now = backendNow();
    const title = el("div", { class: "title" },
      el("a", { class: "back", href: body.dataset.root }, "← runs"),
      el("h1", { class: "run-id", id: "run-id" }, data.run_id),
      data.exists ? badge(data.state) : badge("gone"),
      data.master ? el("span", { class: "muted" }, "rank 0 bootstraps at " + data.master) : null);
    const parts = [title];
    if (data.error) parts.push(el("p", { class: "notice bad" }, "Cannot read the run: " + data.error));
    if (!data.exists) {
      parts.push(el("p", { class: "notice", id: "gone" },
        "This run has no rendezvous state (it finished, was deleted, or expired)."));
    } else {
      const complete = data.state !== "forming";
      const members = data.participants + (data.world && complete ? " of " + data.world : "");
      parts.push(el("div", { class: "tiles" },
        tile("Round", data.round, "round " + data.state, "tile-round"),
        tile("Members", members, complete ? "world size " + data.world : "joined so far",
          "tile-members"),
        tile("Waiting", data.waiting, "for the next round", "tile-waiting"),
        tile("Redundant", data.redundant, "beyond max nodes", "tile-redundant"),
        tile("Lost / finished", data.lost + " / " + data.finished, "since completion", "tile-lost"),
        tile("Last call", deadlineText(data, now), deadlineNote(data), "tile-deadline")));
    }
    if (data.health) parts.push(renderHealth(data.health));
    parts.push(el("section", { class: "card timeline" }, el("h2", {}, "Timeline"),
      drawTimeline(data, now),
      el("div", { class: "legend" }, el("span", { class: "l-complete" }, "complete"),
        el("span", { class: "l-forming" }, "forming"), el("span", { class: "l-members" }, "members"),
        el("span", { class: "l-waiting" }, "waiting"), el("span", { class: "l-lost" }, "lost"))));
    if (data.exists) {
      parts.push(el("section", { class: "card" },
        el("h2", {}, "Participants (" + data.participants + ")"),
        memberTable("participants", data.participant_list, true)));
      parts.push(el("div", { class: "grid" },
        el("section", { class: "card" }, el("h2", {}, "Waiting (" + data.waiting + ")"),
          memberTable("waiting", data.waiting_list, false)),
        el("section", { class: "card" }, el("h2", {}, "Redundant (" + data.redundant + ")"),
          memberTable("redundant", data.redundant_list, false))));
    }
    parts.push(renderEvents(data.events));
    const scrolled = document.getElementById("events");
    const scrollTop = scrolled ? scrolled.scrollTop : 0;
    main.replaceChildren(...parts);
    document.getElementById("events").scrollTop = scrollTop;
    tick();
  }

  // The job's failures (from the rendezvous store: the same on every node), quarantined hosts.
  function renderHealth(health) {
    const items = [];
    const root = health.root;
    if (root) {
      items.push(el("p", { id: "root-cause" },
        el("strong", {}, "Root cause of failure " + health.failures + ": "), root.summary));
      let note = health.failed_nodes + " node(s) failed in round " + root.round;
      if (root.streak > 1) note += "; host " + root.host + " was the root cause " + root.streak +
        " times in a row";
      items.push(el("p", { class: "muted" }, note));
      items.push(el("pre", { class: "message", id: "root-message" }, root.message));
    }
    if (health.quarantined.length) {
      items.push(el("p", { id: "quarantined" }, el("strong", {}, "Quarantined: "),
        health.quarantined.map((q) => q.host + " (" + q.reason + ")").join(", ")));
    }
    if (health.lost.length) {
      items.push(el("p", { class: "muted", id: "lost-hosts" }, "Lost: " +
        health.lost.map((l) => l.host + " ×" + l.count).join(", ")));
    }
    return el("section", { class: "card", id: "health" }, el("h2", {}, "Failures"), ...items);
  }

  function renderEvents(events) {
    const list = el("ul", { class: "events", id: "events" });
    for (const event of events.slice().reverse().slice(0, 60)) {
      list.append(el("li", { "data-kind": event.kind },
        el("span", { class: "dot " + event.kind }),
        el("time", {}, clockTime(event.time_ms)),
        el("span", {}, event.text)));
    }
    if (!events.length) list.append(el("li", { class: "empty" }, "nothing yet"));
    return el("section", { class: "card" }, el("h2", {}, "Recent changes"), list);
  }

  // -- the timeline: rounds as bands, members as a step line, changes as marks ---------------

  function drawTimeline(data, now) {
    const points = data.timeline || [];
    const width = Math.max(main.clientWidth - 40, 320);
    const height = 170, left = 34, right = 10, top = 10, bottom = 24;
    const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img",
      "aria-label": "rounds and membership over time", id: "timeline" });
    if (!points.length) return chart;
    const start = Math.min(points[0].time_ms - 500, now - 10000);
    const span = Math.max(now - start, 1000);
    const x = (t) => left + ((t - start) / span) * (width - left - right);
    const most = Math.max(1, ...points.map((p) => (p.participants || 0) + (p.waiting || 0)));
    const y = (n) => top + (1 - n / most) * (height - top - bottom);
    const ends = points.map((p, i) => (i + 1 < points.length ? points[i + 1].time_ms : now));
    points.forEach((p, i) => {
      chart.append(svg("rect", { class: "band-" + p.state, x: x(p.time_ms), y: top,
        width: Math.max(x(ends[i]) - x(p.time_ms), 1), height: height - top - bottom }));
    });
    for (const event of data.events || []) {
      if (!["lost", "gone"].includes(event.kind) || event.time_ms < start) continue;
      chart.append(svg("line", { class: "mark-line", x1: x(event.time_ms), x2: x(event.time_ms),
        y1: top, y2: height - bottom }));
    }
    let labelEnd = -Infinity;
    points.forEach((p, i) => {
      if (i > 0 && points[i - 1].round === p.round) return;
      if (x(p.time_ms) < labelEnd) return;  // too close to the last label
      chart.append(svg("text", { class: "round-label", x: x(p.time_ms) + 3, y: top + 12 },
        "round " + p.round));
      labelEnd = x(p.time_ms) + 52;
    });
    for (const [key, cls] of [["waiting", "waiting"], ["participants", "members"]]) {
      let path = "";
      points.forEach((p, i) => {
        const value = y(p[key] || 0);
        path += (i ? "L" : "M") + x(p.time_ms).toFixed(1) + " " + value.toFixed(1);
        path += "L" + x(ends[i]).toFixed(1) + " " + value.toFixed(1);
      });
      chart.append(svg("path", { class: cls, d: path }));
    }
    const order = { joined: 0, left: 1, lost: 2, gone: 2 };
    const marks = (data.events || []).filter((e) => e.kind in order && e.time_ms >= start);
    marks.sort((a, b) => order[a.kind] - order[b.kind]);
    for (const event of marks) {
      const mark = svg("circle", { class: "mark-" + event.kind, cx: x(event.time_ms),
        cy: height - bottom, r: event.kind === "lost" || event.kind === "gone" ? 4.5 : 3.5 });
      mark.append(svg("title", {}, clockTime(event.time_ms) + " " + event.text));
      chart.append(mark);
    }
    chart.append(svg("line", { class: "axis", x1: left, x2: width - right,
      y1: height - bottom, y2: height - bottom }));
    chart.append(svg("text", { x: 4, y: y(most) + 4 }, String(most)));
    chart.append(svg("text", { x: 4, y: y(0) + 4 }, "0"));
    for (let i = 0; i <= 4; i++) {
      const t = start + (span * i) / 4;
      chart.append(svg("text", { x: x(t) - (i === 4 ? 22 : i ? 14 : 0), y: height - 6 },
        i === 4 ? "now" : "-" + seconds(now - t)));
    }
    return chart;
  }

  // -- the stream ---------------------------------------------------------------------------

  function render() {
    if (!latest) return;
    if (view === "runs") renderRuns(latest);
    else renderRun(latest);
  }

  function setConnection(state, text) {
    connection.dataset.state = state;
    connection.textContent = text;
  }

  function connect() {
    source = new EventSource(body.dataset.stream);
    source.onopen = () => setConnection("live", "live");
    source.onmessage = (event) => {
      latest = JSON.parse(event.data);
      if (latest.now_ms !== undefined) skewMs = Date.now() - latest.now_ms;
      setConnection("live", "live");
      render();
    };
    source.onerror = () => {
      if (source.readyState === EventSource.CLOSED) {
        // Refused (logged out, server restarted without the run): try again, never reload.
        setConnection("lost", "disconnected, retrying");
        setTimeout(connect, 3000);
      } else {
        setConnection("lost", "reconnecting");
      }
    };
  }

  connect();
  setInterval(() => { if (view === "run" && latest) tick(); }, 1000);
  window.addEventListener("resize", render);
})();
