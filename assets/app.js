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
