// pagestream dashboard: one EventSource (/dashboard/api/events, the key rides in the dashboard cookie);
// "hello" resets everything, "ev" adds one event of the firehose, "state" refreshes queues, workers, bulks.
"use strict";
(function () {
  const FINAL = new Set(["finished", "failed", "cancelled", "dead_lettered"]);
  const FAILURE = new Set(["failed", "dead_lettered"]);
  const ROWS = 25;
  let bucketS = 10, windowS = 900, clockSkew = 0;
  let buckets = new Map();      // bucket start (s) -> {jobs, tokens, ttft: [sum, n], queue: [sum, n], e2e: [sum, n]}
  let jobs = [], failures = [];
  let charts = {};

  const $ = (sel) => document.querySelector(sel);
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k.startsWith("data-")) e.setAttribute(k, v); else e[k] = v;
    }
    for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(k == null ? "" : String(k)));
    return e;
  }
  const now = () => Date.now() / 1000 + clockSkew;
  function age(s) {
    if (s == null) return "-";
    if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
    return (s / 3600).toFixed(1) + " h";
  }
  const clock = (ts) => new Date(ts * 1000).toLocaleTimeString();

  // ---- charts ----
  function bucket(ts) {
    const b = Math.floor(ts / bucketS) * bucketS;
    let v = buckets.get(b);
    if (!v) { v = {jobs: 0, tokens: 0, ttft: [0, 0], queue: [0, 0], e2e: [0, 0]}; buckets.set(b, v); }
    return v;
  }
  function addToCharts(ev) {
    if (ev.ts < now() - windowS - bucketS) return;
    const b = bucket(ev.ts);
    if (ev.type === "finished") {
      b.jobs += 1;
      b.tokens += ev.tokens || 0;
      if (ev.queue_s != null) { b.queue[0] += ev.queue_s; b.queue[1] += 1; }
      if (ev.queue_s != null && ev.run_s != null) { b.e2e[0] += ev.queue_s + ev.run_s; b.e2e[1] += 1; }
    }
    if (ev.ttft_s != null) { b.ttft[0] += ev.ttft_s; b.ttft[1] += 1; }
  }
  function series() {
    const end = Math.floor(now() / bucketS) * bucketS, start = end - windowS;
    const xs = [], jobsS = [], tokS = [], ttft = [], queue = [], e2e = [];
    const mean = (p) => (p[1] ? p[0] / p[1] : null);
    for (const k of buckets.keys()) if (k < start) buckets.delete(k);
    for (let t = start; t <= end; t += bucketS) {
      const b = buckets.get(t);
      xs.push(t);
      jobsS.push(b ? b.jobs / bucketS : 0);
      tokS.push(b ? b.tokens / bucketS : 0);
      ttft.push(b ? mean(b.ttft) : null);
      queue.push(b ? mean(b.queue) : null);
      e2e.push(b ? mean(b.e2e) : null);
    }
    return {throughput: [xs, jobsS, tokS], latency: [xs, ttft, queue, e2e]};
  }
  function chartWidth(id) { return Math.max(240, $(id).clientWidth); }
  function makeCharts() {
    if (typeof uPlot === "undefined") return;
    const s = series(), h = 180;
    charts.throughput = new uPlot({
      width: chartWidth("#chart-throughput"), height: h, legend: {live: false},
      scales: {x: {time: true}, tok: {}},
      series: [{}, {label: "jobs/s", stroke: "#2f7ed8", width: 2, scale: "y"},
               {label: "tokens/s", stroke: "#8bbc21", width: 2, scale: "tok"}],
      axes: [{}, {scale: "y", label: "jobs/s"}, {scale: "tok", side: 1, label: "tokens/s", grid: {show: false}}],
    }, s.throughput, $("#chart-throughput"));
    charts.latency = new uPlot({
      width: chartWidth("#chart-latency"), height: h, legend: {live: false},
      scales: {x: {time: true}},
      series: [{}, {label: "first token", stroke: "#c42525", width: 2, spanGaps: true, points: {show: true, size: 5}},
               {label: "queue wait", stroke: "#f28f43", width: 2, spanGaps: true, points: {show: true, size: 5}},
               {label: "end to end", stroke: "#77a1e5", width: 2, spanGaps: true, points: {show: true, size: 5}}],
      axes: [{}, {label: "s"}],
    }, s.latency, $("#chart-latency"));
  }
  function redraw() {
    const s = series();
    // how many buckets of the window have a first-token latency (what the chart's red line is drawn through)
    $("#chart-latency").dataset.ttftPoints = s.latency[1].filter((v) => v != null).length;
    if (!charts.throughput) { makeCharts(); return; }
    charts.throughput.setData(s.throughput);
    charts.latency.setData(s.latency);
  }
  window.addEventListener("resize", () => {
    if (!charts.throughput) return;
    charts.throughput.setSize({width: chartWidth("#chart-throughput"), height: 180});
    charts.latency.setSize({width: chartWidth("#chart-latency"), height: 180});
  });

  // ---- tables and lists ----
  function renderQueues(rows) {
    const body = $("#queues tbody");
    body.replaceChildren(...rows.map((q) => el("tr", {"data-model": q.model, "data-lane": q.lane, class: q.depth ? "busy" : ""},
      el("td", {class: "model"}, q.model), el("td", {}, q.lane), el("td", {class: "n depth"}, q.depth),
      el("td", {class: "n pending"}, q.pending), el("td", {class: "n oldest"}, q.depth ? age(q.oldest_age_s) : "-"))));
    if (!rows.length) body.append(el("tr", {}, el("td", {colSpan: 5, class: "empty"}, "no model announced yet")));
  }
  function renderWorkers(rows) {
    const body = $("#workers tbody");
    body.replaceChildren(...rows.map((w) => {
      const kv = Math.round((w.kv_usage || 0) * 100);
      const bar = el("div", {class: "bar"}, el("span", {}));
      bar.firstChild.style.width = kv + "%";
      return el("tr", {"data-worker": w.name},
        el("td", {class: "name"}, w.name), el("td", {class: "model"}, w.model || "-"),
        el("td", {class: "n running"}, w.running), el("td", {class: "n waiting"}, w.waiting),
        el("td", {class: "kv"}, bar, el("span", {class: "kv-pct"}, kv + "%")),
        el("td", {class: "n tps"}, w.tokens_per_s == null ? "-" : w.tokens_per_s.toFixed(1)),
        el("td", {class: "n beat"}, age(w.heartbeat_age_s) + " ago"));
    }));
    if (!rows.length) body.append(el("tr", {}, el("td", {colSpan: 7, class: "empty"}, "no live worker")));
  }
  function renderBulks(rows) {
    const list = $("#bulks");
    list.replaceChildren(...rows.map((b) => {
      const pct = b.total ? Math.round((100 * b.done) / b.total) : 0;
      const bar = el("div", {class: "bar wide"}, el("span", {}));
      bar.firstChild.style.width = pct + "%";
      return el("li", {"data-bulk": b.id, class: "status-" + b.status},
        el("div", {class: "bulk-head"}, el("span", {class: "bulk-id"}, b.id), el("span", {class: "bulk-status"}, b.status)),
        bar,
        el("div", {class: "bulk-counts"}, el("span", {class: "done"}, b.done), " / ", el("span", {class: "total"}, b.total),
          b.input_done ? "" : "+", " lines · ", el("span", {class: "completed"}, b.completed), " completed · ",
          el("span", {class: "failed"}, b.failed + b.invalid), " failed", b.model ? " · " + b.model : ""));
    }));
    if (!rows.length) list.append(el("li", {class: "empty"}, "no bulk or batch"));
  }
  function renderJobs() {
    const body = $("#jobs tbody");
    body.replaceChildren(...jobs.map((j) => el("tr", {"data-job": j.job, class: "t-" + j.type},
      el("td", {class: "job"}, j.job), el("td", {}, j.model || "-"),
      el("td", {class: "outcome"}, j.type === "finished" ? (j.finish_reason || "finished") : j.type),
      el("td", {class: "n"}, j.tokens == null ? "-" : j.tokens),
      el("td", {class: "n"}, j.run_s == null ? "-" : age((j.queue_s || 0) + j.run_s)),
      el("td", {}, clock(j.ts)))));
    if (!jobs.length) body.append(el("tr", {}, el("td", {colSpan: 6, class: "empty"}, "none of your jobs finished in the last 15 minutes")));
  }
  function renderFailures() {
    const list = $("#failures");
    list.replaceChildren(...failures.map((f) => el("li", {"data-job": f.job},
      el("span", {class: "when"}, clock(f.ts)), " ", el("span", {class: "job"}, f.job || "(no job id)"), " ",
      el("span", {class: "kind"}, f.type === "dead_lettered" ? "dead-lettered" : "failed"), ": ",
      el("span", {class: "reason"}, f.error || "-"))));
    if (!failures.length) list.append(el("li", {class: "empty"}, "no failure in the last 15 minutes"));
  }
  function renderDeadLetters(total, rows) {
    $("#dlq-total").textContent = total;
    const list = $("#dead-letters");
    list.replaceChildren(...rows.map((d) => el("li", {"data-job": d.job || ""},
      el("span", {class: "when"}, clock(d.at)), " ", el("span", {class: "job"}, d.job || "(unreadable entry)"),
      " after ", d.deliveries, " deliveries: ", el("span", {class: "reason"}, d.reason))));
    if (!rows.length) list.append(el("li", {class: "empty"}, total ? "none of them yours" : "none"));
  }
  function renderState(s) {
    clockSkew = s.now - Date.now() / 1000;
    $("#tenant").textContent = s.tenant.name + (s.tenant.admin ? " (admin)" : "");
    renderQueues(s.queues);
    renderWorkers(s.workers);
    renderBulks(s.bulks);
    renderDeadLetters(s.dead_letters_total, s.dead_letters);
  }
  function addEvent(ev, live) {
    addToCharts(ev);
    if (!ev.job || !FINAL.has(ev.type)) return;  // only events shown in full (yours) carry a job id
    if (ev.type !== "dead_lettered") {
      jobs = [ev, ...jobs.filter((j) => j.job !== ev.job)].slice(0, ROWS);
      if (live) renderJobs();
    }
    if (FAILURE.has(ev.type)) {
      failures = [ev, ...failures].slice(0, ROWS);
      if (live) renderFailures();
    }
  }

  // ---- the feed ----
  function setConn(text, cls) { const c = $("#conn"); c.textContent = text; c.className = "conn " + cls; }
  function connect() {
    const es = new EventSource("/dashboard/api/events");
    es.addEventListener("hello", (m) => {
      const s = JSON.parse(m.data);
      bucketS = s.bucket_s; windowS = s.window_s;
      buckets = new Map(); jobs = []; failures = [];
      renderState(s);
      for (const ev of s.events) addEvent(ev, false);
      renderJobs(); renderFailures(); redraw();
      setConn("live", "ok");
    });
    es.addEventListener("ev", (m) => addEvent(JSON.parse(m.data), true));
    es.addEventListener("state", (m) => { renderState(JSON.parse(m.data)); redraw(); });
    es.onerror = () => {
      setConn("reconnecting", "bad");
      if (es.readyState === EventSource.CLOSED) {  // refused (401 after a key change): back to the login form
        setTimeout(() => { window.location.href = "/dashboard"; }, 2000);
      }
    };
  }
  connect();
})();
