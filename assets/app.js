// dash-cytoscape always passes its default wheelSensitivity (1, cytoscape's own default), and
// cytoscape warns whenever the option is given at all: that one message, on every page load,
// says nothing about this app, so it is dropped; every other warning passes through.
(function () {
  const warn = console.warn.bind(console);
  console.warn = function (...args) {
    if (typeof args[0] === "string" && args[0].startsWith("You have set a custom wheel sensitivity")) {
      return;
    }
    warn(...args);
  };
})();

// Clientside callbacks (no round trip to the server).
window.dash_clientside = Object.assign({}, window.dash_clientside, {
  remat: {
    // A budget typed in the box (Enter or blur): set the slider, or say why not, with the
    // minimum. Returns [slider value, message, message hidden].
    typedBudget: function (typed, context) {
      const nu = window.dash_clientside.no_update;
      if (typed === undefined || typed === null || !context || !context.key) {
        return [nu, nu, nu];
      }
      const text = String(typed).trim().replace(/%$/, "").trim();
      const x = text === "" ? NaN : Number(text);
      const range = "Type a percentage of the store-all peak, from " + context.min_text +
        ", the smallest budget this method fits, to 100%.";
      if (!Number.isFinite(x)) {
        return [nu, "\u201c" + typed + "\u201d is not a budget. " + range, false];
      }
      if (x < context.min_pct) {
        return [nu, x + "% is below the smallest budget this method fits. " + range, false];
      }
      if (x > 100) {
        return [nu, x + "% is above the store-all peak (100%), which needs no recompute. " +
          range, false];
      }
      return [Math.round(x * 2) / 2, "", true];
    },
  },
});

// The page's freshness watcher. Every view carries the controls it was drawn for (a
// `data-for` attribute, or a plotly figure's layout.meta.for): "model|device|method|offload" (the
// step switches appended to offload: "off+optimizer+chunked"),
// plus "|budget%" for the views of one plan. Before every paint (each animation frame, and
// at once on any change to the page) it compares them with the controls as shown, and while
// any view differs it shows the one busy bar (body[data-busy]) and dims the views, so no
// frame shows content under controls it was not drawn for. A view of class "own-busy" (the
// trade-off curves, memory against batch: seconds of work that no budget move needs) is
// instead dimmed alone under its own busy sign (data-refreshing), so the page stays live.
(function () {
  const shown = (id) => {
    const e = document.querySelector("#" + id + "-value .dash-dropdown-value-item");
    return e ? e.textContent.trim() : "";
  };
  const checked = (sel) => { const e = document.querySelector(sel); return !!(e && e.checked); };
  function controls() {
    const box = document.querySelector(".controls");
    if (!box) { return null; }
    const labels = JSON.parse(box.dataset.methodLabels || "{}");
    const method = shown("method");
    const where = checked("#costs input[value=measured]") ? "here" : shown("device");
    const ctx = [shown("model"), where, labels[method] || method,
      (checked("#offload-switch input[value=on]") ? "on" : "off") +
      ["optimizer", "chunked"].filter((o) => checked("#step-switches input[value=" + o + "]"))
        .map((o) => "+" + o).join("")].join("|");
    const slider = document.querySelector("#budget [role=slider]");
    const now = slider && slider.getAttribute("aria-valuenow");
    const devices = document.querySelector("#devices-n input:checked");
    return {ctx: ctx, plan: ctx + "|" + (now === null || now === "" ? "" : String(Number(now))),
      devices: devices ? devices.value : null};
  }
  function drawnFor(view) {
    const gd = view.querySelector(".js-plotly-plot");
    if (view.classList.contains("plot")) {
      return gd && gd.layout && gd.layout.meta ? gd.layout.meta.for || "" : "";
    }
    return view.getAttribute("data-for") || "";
  }
  const NAMES = {intro: "the introduction", "graph-card": "the block graph",
    numbers: "the numbers", "step-why": "the step", tradeoff: "the trade-off curves",
    timeline: "the timeline", tensors: "the tensor view", arena: "the arena",
    transfers: "the transfer lane", fit: "the footprint", "batch-fig": "memory against batch",
    "compare-a": "plan A", "compare-b": "plan B", "parallel-card": "the layouts over devices"};
  function check() {
    const want = controls();
    if (!want) { return; }
    const error = document.getElementById("error");
    const failed = !!(error && !error.hidden && error.getAttribute("data-for") === want.ctx);
    const stale = [], staleIds = new Set();
    const near = DEFERRED.filter((id) => { const v = document.getElementById(id);
      return v && !v.closest("[hidden]") && nearSight(v); });
    document.querySelectorAll(".view").forEach((v) => {
      // What is not shown is not stale on screen: a hidden view (the transfer lane with
      // offloading off), and a view far out of sight (more than a quarter of a window away; the
      // server may leave such a view for later: DEFERRED below). Coming near, it is checked
      // again, and asked for; while it is stale in sight the page is busy.
      // (A view with its own busy sign keeps it wherever it is: it never dims the page.)
      if (v.closest("[hidden]") || (!v.classList.contains("own-busy") && !nearSight(v))) {
        return;
      }
      const got = drawnFor(v);
      const expect = got.split("|").length === 5 ? want.plan : want.ctx;
      // a view drawn for a number of devices (data-devices) also follows that control
      const devices = v.getAttribute("data-devices");
      const other = devices !== null && want.devices !== null && devices !== want.devices;
      const old = !failed && (got !== expect || got === "" || other);
      if (v.classList.contains("own-busy")) {
        // a view that does not follow the budget (the curves, memory against batch) and
        // takes seconds: its own busy sign, never the page's
        const sign = old ? "updating " + (NAMES[v.id] || v.id) + "\u2026" : null;
        if (v.getAttribute("data-refreshing") !== sign) {
          if (sign === null) { v.removeAttribute("data-refreshing"); }
          else { v.setAttribute("data-refreshing", sign); }
        }
      } else if (old) { stale.push(NAMES[v.id] || v.id); staleIds.add(v.id); }
    });
    lagBehind(want, staleIds, near);
    const body = document.body;
    const busy = stale.length > 0;
    if (busy !== body.hasAttribute("data-busy")) { body.toggleAttribute("data-busy", busy); }
    if (failed !== body.hasAttribute("data-failed")) { body.toggleAttribute("data-failed", failed); }
    const what = document.querySelector("#progress .busy-what");
    const text = busy ? "updating " + stale.join(", ") + " for " + want.plan.split("|").join(" · ") : "";
    if (what && what.textContent !== text) { what.textContent = text; }
  }
  // The views a budget move may leave for later (app/callbacks/budget.py's DEFERRED): the
  // server draws those in sight (within a quarter of a window) with the timeline, and lists the
  // others in the numbers card's data-skipped. One of those stale in sight is asked for
  // (data-lagging, "plan#ids"): until it comes the page is busy, as for any stale view.
  // data-skipped is "plan#ids" too: the plan the views' request was for.
  const DEFERRED = ["tensors", "arena", "compare-a"];
  let sentVisible = null, sentLagging = null, answered = null;
  function nearSight(v) {
    const margin = window.innerHeight / 4, r = v.getBoundingClientRect();
    return r.height > 0 && r.bottom > -margin && r.top < window.innerHeight + margin;
  }
  function lagBehind(want, staleIds, near) {
    const numbers = document.getElementById("numbers");
    const dc = window.dash_clientside;
    if (!numbers || !dc || !dc.set_props) { return; }
    const visible = near.join(" ");
    if (visible !== sentVisible) {
      sentVisible = visible;
      dc.set_props("numbers", {"data-visible": visible});
    }
    const planFor = numbers.getAttribute("data-for");
    if (planFor !== answered) { answered = planFor; sentLagging = null; }  // a new answer
    if (planFor !== want.plan) { return; }  // the slider's request is still out
    const [skippedFor, skippedIds] = (numbers.getAttribute("data-skipped") || "").split("#");
    if (skippedFor !== want.plan) { return; }  // the views' request is still out
    const skipped = (skippedIds || "").split(" ");
    const late = near.filter((id) => skipped.includes(id) &&
      (staleIds.has(id) || (id === "compare-a" && staleIds.has("compare-b"))));
    const lagging = late.length ? want.plan + "#" + late.join(" ") : "";
    if (lagging && lagging !== sentLagging) {
      sentLagging = lagging;
      dc.set_props("numbers", {"data-lagging": lagging});
    }
  }
  function frame() { check(); requestAnimationFrame(frame); }
  function start() {
    new MutationObserver(check).observe(document.body,
      {subtree: true, childList: true, attributes: true, characterData: true});
    requestAnimationFrame(frame);
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else { start(); }
})();
