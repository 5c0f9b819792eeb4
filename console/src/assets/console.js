// waybill console: refreshes the overview from /console/api/overview and its charts (images the
// server draws), runs the operator's actions, and adds keyboard shortcuts. No libraries; every value
// from the server is written with textContent, never as HTML.
"use strict";
(function () {
  function at(root, path) {
    let here = root;
    for (const key of path.split(".")) {
      if (here === null || here === undefined) return null;
      if (Array.isArray(here) && key === "length") return here.length;
      here = here[key];
    }
    return here === undefined ? null : here;
  }

  function group(n) {
    return Math.trunc(n).toString().replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  }

  function age(s) {
    if (s < 60) return s.toFixed(1) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let u = 0;
    while (n >= 1024 && u < units.length - 1) { n /= 1024; u++; }
    return u === 0 ? n.toFixed(0) + " B" : n.toFixed(1) + " " + units[u];
  }

  function show(format, v) {
    if (v === null) return "—";
    switch (format) {
      case "count": return typeof v === "number" ? group(v) : String(v);
      case "rate": return Number(v).toFixed(1) + "/s";
      case "age": return age(Number(v));
      case "bytes": return bytes(Number(v));
      case "time": return typeof v === "string" && v.length >= 19 ? v.substring(11, 19) + " UTC" : String(v);
      default: return typeof v === "string" ? v : JSON.stringify(v);
    }
  }

  function truthy(v) {
    return !(v === null || v === false || v === 0 || v === "");
  }

  function render(data) {
    for (const el of document.querySelectorAll("[data-k]")) {
      el.textContent = show(el.dataset.f, at(data, el.dataset.k));
    }
    for (const el of document.querySelectorAll("[data-when]")) el.hidden = !truthy(at(data, el.dataset.when));
    for (const el of document.querySelectorAll("[data-unless]")) el.hidden = truthy(at(data, el.dataset.unless));
    // The charts are drawn by the server (overview/chart.rs): ask for fresh copies.
    for (const img of document.querySelectorAll("img[data-chart]")) {
      img.src = "/console/charts/" + encodeURIComponent(img.dataset.chart) + ".svg?at=" + Date.now();
    }
  }

  // The next refresh is scheduled only once the previous one has answered, so a slow server is never
  // sent overlapping requests; a hidden tab does not poll at all and refreshes when shown again.
  const REFRESH_MS = 2000;
  let timer = null;
  let inflight = false;

  function schedule() {
    clearTimeout(timer);
    timer = document.hidden ? null : setTimeout(refresh, REFRESH_MS);
  }

  async function refresh() {
    timer = null;
    if (inflight) return;
    inflight = true;
    try {
      const response = await fetch("/console/api/overview", { headers: { Accept: "application/json" } });
      if (response.ok) {
        render(await response.json());
        document.body.classList.remove("stale");
      } else {
        // An error answer is as stale as no answer: the numbers shown are no longer current.
        document.body.classList.add("stale");
      }
    } catch (_) {
      document.body.classList.add("stale");
    }
    inflight = false;
    schedule();
  }

  function actions() {
    const input = document.querySelector("[data-token]");
    const result = document.querySelector("[data-result]");
    if (!input) return;
    const by = document.querySelector("[data-by]");
    const reason = document.querySelector("[data-reason]");
    input.value = sessionStorage.getItem("waybill-operator-token") || "";
    input.addEventListener("change", () => sessionStorage.setItem("waybill-operator-token", input.value));
    if (by) {
      by.value = sessionStorage.getItem("waybill-operator") || "";
      by.addEventListener("change", () => sessionStorage.setItem("waybill-operator", by.value));
    }
    async function post(url, body) {
      const response = await fetch(url, {
        method: "POST",
        headers: { "Content-Type": "application/json", Authorization: "Bearer " + input.value },
        body: body === undefined ? undefined : JSON.stringify(body),
      });
      return { response, answer: await response.json().catch(() => ({})) };
    }
    function refused(response, answer) {
      result.textContent = "Refused (" + response.status + "): " + (answer.detail || "");
    }
    for (const button of document.querySelectorAll("[data-replay]")) {
      button.addEventListener("click", async () => {
        const target = button.dataset.replay;
        if (target === "all" && !confirm("Replay every dead row?")) return;
        const { response, answer } = await post("/console/api/outbox/dead/replay", { target: target });
        if (!response.ok) return refused(response, answer);
        result.textContent = "Replayed " + answer.replayed + " row(s); reload to see the list.";
      });
    }
    // Redrive, discard and release in a projection (its operator API, through this service).
    for (const button of document.querySelectorAll("[data-action]")) {
      button.addEventListener("click", async () => {
        if (button.dataset.confirm && !confirm(button.dataset.confirm)) return;
        let body;
        if ("needsReason" in button.dataset) {
          if (!reason.value.trim() || !by.value.trim()) {
            result.textContent = "Say who is acting and why first (both are kept in the operator log).";
            (by.value.trim() ? reason : by).focus();
            return;
          }
          body = { by: by.value.trim(), reason: reason.value.trim() };
        }
        button.disabled = true;
        const { response, answer } = await post(button.dataset.action, body);
        button.disabled = false;
        if (!response.ok) return refused(response, answer);
        if (Array.isArray(answer.redriven)) {
          const parked = answer.redriven.filter((r) => r.outcome === "parked").length;
          result.textContent = "Redrove " + answer.redriven.length + " message(s), " + parked +
            " failed again; " + answer.open + " still open" +
            (answer.open > parked ? " (a call takes a batch: redrive again)" : "") + ". Reload to see the list.";
        } else {
          result.textContent = "Done; reload to see the list.";
        }
      });
    }
  }

  function keys() {
    let pending = null;
    document.addEventListener("keydown", (event) => {
      const typing = /^(INPUT|TEXTAREA|SELECT)$/.test(event.target.tagName);
      if (typing || event.ctrlKey || event.metaKey || event.altKey) return;
      if (event.key === "/") {
        event.preventDefault();
        document.getElementById("find-order").focus();
      } else if (pending === "g") {
        const to = { p: "/console", c: "/console/catalog", d: "/console/outbox/dead" }[event.key];
        pending = null;
        if (to) location.href = to;
      } else if (event.key === "g") {
        pending = "g";
        setTimeout(() => { pending = null; }, 1500);
      }
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    keys();
    actions();
    if (document.querySelector("[data-k]")) {
      refresh();
      document.addEventListener("visibilitychange", () => {
        if (document.hidden) {
          clearTimeout(timer);
          timer = null;
        } else if (timer === null) {
          refresh();
        }
      });
    }
  });
})();
