/* hookscope report: draws the charts from the JSON in #hs-data with uPlot (vendored).
   Every chart of the page shares one step cursor (uPlot's cursor sync) and one x zoom:
   drag across a chart to zoom, double-click to zoom out. Heatmaps are drawn on canvases. */
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("hs-data").textContent);
  const RUNS = D.runs;
  const DOMAIN = D.steps; // [first, last]: the steps every chart on the shared axis spans
  const COLORS = ["#1f6fb4", "#d6402b", "#2a9d4b", "#8a55c0", "#e08a10", "#148f8f"];
  const SYNC = "hs-steps";
  const charts = [];
  const heatCursors = [];
  window.hsCharts = {}; // by id, for tests and for the curious in the console

  // -- numbers ------------------------------------------------------------------------------
  const SUP = { "-": "\u207b", 0: "\u2070", 1: "\u00b9", 2: "\u00b2", 3: "\u00b3", 4: "\u2074",
    5: "\u2075", 6: "\u2076", 7: "\u2077", 8: "\u2078", 9: "\u2079" };
  function fmt(v) {
    if (v == null) return "\u2013";
    if (!isFinite(v)) return String(v);
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1e-3 && a < 1e5) return String(+v.toPrecision(4));
    return v.toExponential(3).replace(/\.?0+e/, "e").replace("e+", "e");
  }
  function pow10(e) {
    return "10" + String(e).split("").map((c) => SUP[c]).join("");
  }
  // Linear ticks: as many decimals as the tick spacing needs, never an offset.
  function linTicks(u, splits, ax, space, incr) {
    const big = Math.max(...splits.map((v) => Math.abs(v)));
    if (big >= 1e5 || (big > 0 && big < 1e-3)) {
      const digits = Math.max(0, Math.min(4, Math.floor(Math.log10(big)) - Math.floor(Math.log10(incr))));
      return splits.map((v) => (v === 0 ? "0" : v.toExponential(digits).replace("e+", "e")));
    }
    const dec = Math.max(0, Math.min(8, -Math.floor(Math.log10(incr) + 1e-9)));
    return splits.map((v) => v.toFixed(dec));
  }
  // Log ticks: powers of ten as 10ⁿ; within a decade or two, 1-2-5 steps too.
  function logTicks(u, splits) {
    const finite = splits.filter((v) => v > 0);
    const span = finite.length ? Math.log10(Math.max(...finite) / Math.min(...finite)) : 0;
    return splits.map((v) => {
      if (!(v > 0)) return "";
      const e = Math.floor(Math.log10(v) + 1e-9);
      const m = Math.round(v / Math.pow(10, e));
      if (m === 1) return pow10(e);
      if (span < 2.5 && (m === 2 || m === 5)) return m + "\u00b7" + pow10(e);
      return "";
    });
  }
  // A linear range that never magnifies noise: values within 1 % of their magnitude are
  // drawn flat, in the middle of a range from 0 to twice their value (a constant learning
  // rate of 3e-3 on 0 ... 6e-3, not a 0.00299 ... 0.00301 axis).
  function linRange(u, min, max) {
    if (min == null || max == null) return [0, 1];
    const mid = (min + max) / 2;
    if (max - min <= Math.abs(mid) * 0.01 || max - min < 1e-12) {
      if (Math.abs(mid) < 1e-12) return [-1, 1];
      return mid > 0 ? [0, 2 * mid] : [2 * mid, 0];
    }
    const pad = (max - min) * 0.05;
    return [min - pad, max + pad];
  }
  // A fraction: from 0, so that 0.48 -> 0.54 reads as the 6 % it is, not as a full swing.
  function fracRange(u, min, max) {
    if (max == null || !(max > 0)) return [0, 1];
    return [0, Math.min(1, max * 1.1)];
  }
  const ZERO_TO_ONE = () => [0, 1];

  // Every chart on the shared step axis spans the same steps (DOMAIN): its x values are
  // padded with the domain's ends (no value there), so that an evaluation logged after the
  // last training step, or a run shorter than another, sits where it belongs on every chart,
  // and a double-click zooms every chart out to the same range.
  function padToDomain(data) {
    const xs = data[0];
    if (!xs.length) return data;
    const head = xs[0] > DOMAIN[0], tail = xs[xs.length - 1] < DOMAIN[1];
    if (!head && !tail) return data;
    return data.map((col, k) => {
      const out = Array.from(col);
      if (head) out.unshift(k === 0 ? DOMAIN[0] : null);
      if (tail) out.push(k === 0 ? DOMAIN[1] : null);
      return out;
    });
  }

  // -- shared zoom --------------------------------------------------------------------------
  let zooming = false;
  function shareZoom(u, key) {
    if (key !== "x" || zooming) return;
    zooming = true;
    const { min, max } = u.scales.x;
    for (const other of charts) if (other !== u && other.data[0].length) other.setScale("x", { min, max });
    zooming = false;
  }
  function shareCursor(u) {
    const left = u.cursor.left;
    const step = left == null || left < 0 ? null : u.posToVal(left, "x");
    for (const h of heatCursors) h(step);
  }

  // Vertical marks (NaN step, findings) and a horizontal guide, drawn over the series.
  function marksPlugin(marks, guide) {
    return {
      hooks: {
        draw: (u) => {
          const ctx = u.ctx;
          ctx.save();
          for (const m of marks) {
            const x = Math.round(u.valToPos(m.step, "x", true));
            if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
            ctx.strokeStyle = m.color;
            ctx.lineWidth = m.width || 1.5;
            ctx.setLineDash(m.dash || []);
            ctx.beginPath();
            ctx.moveTo(x, u.bbox.top);
            ctx.lineTo(x, u.bbox.top + u.bbox.height);
            ctx.stroke();
          }
          if (guide != null) {
            const y = Math.round(u.valToPos(guide, "y", true));
            if (y >= u.bbox.top && y <= u.bbox.top + u.bbox.height) {
              ctx.strokeStyle = "#c0392b";
              ctx.setLineDash([5, 4]);
              ctx.lineWidth = 1;
              ctx.beginPath();
              ctx.moveTo(u.bbox.left, y);
              ctx.lineTo(u.bbox.left + u.bbox.width, y);
              ctx.stroke();
            }
          }
          ctx.restore();
        },
      },
    };
  }

  // -- line charts --------------------------------------------------------------------------
  // spec: {id, title, width, height, log, guide, marks, series: [{label, x, y, band}]}
  function lineChart(el, spec) {
    const tables = spec.series.map((s) => {
      const cols = [s.x, s.y];
      if (s.band) {
        cols.push(s.y.map((v, i) => (v == null || s.band[i] == null ? null : v + s.band[i])));
        cols.push(s.y.map((v, i) => (v == null || s.band[i] == null ? null : v - s.band[i])));
      }
      return cols;
    });
    const joined = tables.length === 1 ? tables[0] : uPlot.join(tables);
    const data = spec.own ? joined : padToDomain(joined);
    const series = [{ label: "step", value: (u, v) => (v == null ? "\u2013" : String(Math.round(v))) }];
    const bands = [];
    spec.series.forEach((s, i) => {
      const color = s.color || COLORS[i % COLORS.length];
      series.push({ label: s.label, stroke: color, width: 1.4, value: (u, v) => fmt(v), spanGaps: false,
        points: { show: (u, si, i0, i1) => i1 - i0 < 40 } });
      if (s.band) {
        const hi = series.length;
        series.push({ label: s.label + " +std", stroke: "transparent", width: 0, value: (u, v) => fmt(v), points: { show: false } });
        series.push({ label: s.label + " \u2212std", stroke: "transparent", width: 0, value: (u, v) => fmt(v), points: { show: false } });
        bands.push({ series: [hi, hi + 1], fill: color + "2e" });
      }
    });
    const opts = {
      title: spec.title,
      width: spec.width,
      height: spec.height || 170,
      series,
      bands,
      legend: { live: true },
      cursor: { sync: { key: SYNC, setSeries: false }, drag: { x: true, y: false, setScale: true } },
      scales: { x: { time: false }, y: spec.log ? { distr: 3, log: 10 } : { range: spec.range || linRange } },
      axes: [
        { size: 34, font: "11px system-ui", values: (u, s, a, sp, incr) => linTicks(u, s, a, sp, Math.max(1, incr)) },
        { size: 62, font: "11px system-ui", values: spec.log ? logTicks : linTicks },
      ],
      hooks: spec.own ? {} : { setScale: [shareZoom], setCursor: [shareCursor] },
      plugins: [marksPlugin(spec.marks || [], spec.guide)],
    };
    if (spec.own) opts.cursor.sync = { key: spec.own, setSeries: false };
    const u = new uPlot(opts, data, el);
    // the band's edges are drawn, not listed: hide their legend rows
    series.forEach((s, i) => {
      if (s.stroke === "transparent") u.root.querySelectorAll(".u-legend .u-series")[i].style.display = "none";
    });
    if (!spec.own) charts.push(u);
    window.hsCharts[spec.id] = u;
    return u;
  }

  function runMarks(run, module) {
    const marks = [];
    for (const f of run.findings) {
      if (module !== undefined && f.module !== module) continue;
      if (f.kind === "nonfinite") continue;
      marks.push({ step: f.step, color: f.cleared_at == null ? "#e08a10" : "#9aa3ad", dash: [3, 3], width: 1 });
    }
    if (run.nan && (module === undefined || module === run.nan.module)) {
      marks.push({ step: run.nan.step, color: "#d6402b", width: 2 });
    } else if (run.nan) {
      marks.push({ step: run.nan.step, color: "#d6402b99", width: 1 });
    }
    return marks;
  }

  function panel(parent, cls) {
    const d = document.createElement("div");
    d.className = cls || "panel";
    parent.appendChild(d);
    return d;
  }

  function width(el, columns) {
    const w = el.clientWidth || 1200;
    return Math.max(260, Math.floor(w / columns) - 14);
  }

  // -- training curves ----------------------------------------------------------------------
  function drawCurves() {
    const el = document.getElementById("hs-curves");
    if (!el) return;
    const names = [];
    for (const r of RUNS) for (const n of Object.keys(r.curves.series)) if (!names.includes(n)) names.push(n);
    const cols = Math.min(3, names.length);
    for (const name of names) {
      const series = [];
      RUNS.forEach((r, i) => {
        if (r.curves.series[name]) series.push({ label: RUNS.length > 1 ? r.label : name, x: r.curves.x, y: r.curves.series[name], color: COLORS[i % COLORS.length] });
      });
      const ys = series.flatMap((s) => s.y.filter((v) => v != null));
      const positive = ys.length && ys.every((v) => v > 0);
      const spread = positive ? Math.max(...ys) / Math.min(...ys) : 0;
      const log = positive && (name.startsWith("lr") || name === "grad_norm" ? spread > 20 : spread > 1e3);
      lineChart(panel(el), { id: "curve:" + name, title: name + (log ? " (log)" : ""), width: width(el, cols), height: 200,
        log, series, marks: runMarks(RUNS[0]) });
    }
  }

  // -- per module small multiples -----------------------------------------------------------
  const TITLES = {
    "act.mean": "activation mean \u00b1 std",
    "act.zero_frac": "fraction of zeros in the output",
    "grad.norm": "gradient norm of the output (log)",
    "act.kurtosis": "kurtosis of the output (log; 3 for normal values)",
    "act.absmax_over_rms": "largest |value| over RMS of the output (log; dashed: 100, massive activations)",
    "attn.logit_max": "largest pre-softmax attention logit (dashed: 50)",
  };
  const LOG = { "grad.norm": true, "act.kurtosis": true, "act.absmax_over_rms": true };
  const GUIDE = { "act.kurtosis": 3, "act.absmax_over_rms": 100, "attn.logit_max": 50 };
  const RANGE = { "act.zero_frac": ZERO_TO_ONE };
  // A heading and its grid of small charts, made when the first chart is: a statistic no
  // module has (attention logits on a CNN) leaves no empty heading.
  function group(el, title) {
    let grid = null;
    return () => {
      if (grid) return grid;
      const h = document.createElement("h3");
      h.textContent = title;
      el.appendChild(h);
      return (grid = panel(el, "grid"));
    };
  }
  // A module's chart title: its name and type ("features.4 · Conv2d").
  function moduleTitle(m) {
    const type = RUNS.map((r) => r.types && r.types[m]).find((t) => t);
    return type ? m + " · " + type : m;
  }
  function drawModules() {
    const el = document.getElementById("hs-modules");
    if (!el) return;
    const modules = [];
    for (const r of RUNS) for (const m of r.modules) if (!modules.includes(m)) modules.push(m);
    for (const stat of Object.keys(TITLES)) {
      if (!RUNS.some((r) => r.lines[stat])) continue;
      const grid = group(el, TITLES[stat]);
      const w = width(el, 4);
      for (const m of modules) {
        const series = [];
        RUNS.forEach((r, i) => {
          const row = r.modules.indexOf(m);
          const y = r.lines[stat] && r.lines[stat][row];
          if (row < 0 || !y || !y.some((v) => v != null)) return;
          const band = stat === "act.mean" && r.lines["act.std"] ? r.lines["act.std"][row] : null;
          series.push({ label: RUNS.length > 1 ? r.label : stat.split(".")[1], x: r.x, y, band, color: COLORS[i % COLORS.length] });
        });
        if (!series.length) continue;
        lineChart(panel(grid()), { id: stat + ":" + m, title: moduleTitle(m), width: w, height: 150, log: !!LOG[stat],
          guide: GUIDE[stat], range: RANGE[stat], series, marks: runMarks(RUNS[0], m) });
      }
    }
    if (RUNS.some((r) => r.ratio.names.length)) {
      const grid = group(el, "update ratio \u2016\u0394W\u2016/\u2016W\u2016 per weight (log; dashed: 1e-3)");
      const names = [];
      for (const r of RUNS) for (const n of r.ratio.names) if (!names.includes(n)) names.push(n);
      for (const n of names) {
        const series = [];
        RUNS.forEach((r, i) => {
          const row = r.ratio.names.indexOf(n);
          if (row >= 0 && r.ratio.y[row].some((v) => v != null)) series.push({ label: RUNS.length > 1 ? r.label : "ratio", x: r.x, y: r.ratio.y[row], color: COLORS[i % COLORS.length] });
        });
        if (series.length) lineChart(panel(grid()), { id: "ratio:" + n, title: n, width: width(el, 4), height: 150, log: true, guide: 1e-3, series });
      }
    }
    drawPrecision(el, modules);
  }

  // Monitor(precision=...): per module, the share of values each dtype would lose.
  const SIDES = { act: "output", grad: "output gradient (as backpropagated, scaled under a GradScaler)" };
  function drawPrecision(el, modules) {
    for (const side of Object.keys(SIDES)) {
      if (!RUNS.some((r) => r.precision && r.precision[side] && Object.keys(r.precision[side]).length)) continue;
      const grid = group(el, "fraction of the " + SIDES[side] + " values that would underflow to 0 or overflow in each dtype");
      for (const m of modules) {
        const series = [];
        RUNS.forEach((r, ri) => {
          const row = r.modules.indexOf(m);
          Object.entries((r.precision && r.precision[side]) || {}).forEach(([key, rows], k) => {
            const y = row >= 0 && rows[row];
            if (y && y.some((v) => v != null && v > 0))
              series.push({ label: (RUNS.length > 1 ? r.label + " " : "") + key, x: r.x, y, color: COLORS[(ri * 4 + k) % COLORS.length] });
          });
        });
        if (series.length) lineChart(panel(grid()), { id: "precision." + side + ":" + m, title: moduleTitle(m), width: width(el, 4), height: 150,
          range: fracRange, series });
      }
    }
  }

  // -- findings timeline --------------------------------------------------------------------
  function drawTimeline() {
    const el = document.getElementById("hs-timeline");
    if (!el) return;
    const rows = [];
    RUNS.forEach((r, ri) => r.findings.forEach((f) => rows.push({ ...f, run: ri })));
    const first = DOMAIN[0];
    const last = Math.max(DOMAIN[1], first + 1);
    const n = Math.max(rows.length, 1);
    const draw = (u) => {
      const ctx = u.ctx;
      ctx.save();
      ctx.font = Math.round(11 * devicePixelRatio) + "px system-ui";
      ctx.textBaseline = "middle";
      rows.forEach((f, i) => {
        const y0 = u.valToPos(n - i, "y", true), y1 = u.valToPos(n - i - 1, "y", true);
        const x0 = u.valToPos(f.step, "x", true);
        // an event (a NaN appearing, a loss spike) is a tick at its step, not a bar
        const end = f.event ? f.step : f.cleared_at == null ? RUNS[f.run].last : f.cleared_at;
        const x1 = Math.max(u.valToPos(end, "x", true), x0 + 3 * devicePixelRatio);
        const nan = f.kind === "nonfinite";
        ctx.fillStyle = f.event ? "#d6402b" : f.cleared_at == null ? (nan ? "#d6402b" : "#e08a10") : "#b8c0c8";
        ctx.fillRect(x0, y0 + 2, x1 - x0, y1 - y0 - 4);
        const label = (RUNS.length > 1 ? RUNS[f.run].label + ": " : "") + f.kind + " \u00b7 " + (f.module || "(model)") +
          (f.event ? " \u00b7 at step " + f.step : " \u00b7 step " + f.step + (f.cleared_at == null ? " (current)" : " \u2192 cleared at " + f.cleared_at));
        // The label: left of the bar if it fits there, else inside it (white) if the bar is
        // long enough, else right of the bar (a short bar near the left edge).
        const pad = 6 * devicePixelRatio, w = ctx.measureText(label).width;
        const left = w <= x0 - u.bbox.left - 2 * pad, inside = w + 2 * pad <= x1 - x0;
        ctx.fillStyle = !left && inside ? "#ffffff" : "#1d2430";
        ctx.textAlign = left ? "right" : "left";
        ctx.fillText(label, left ? x0 - pad : inside ? x0 + pad : x1 + pad, (y0 + y1) / 2);
      });
      ctx.restore();
    };
    const u = new uPlot({
      width: width(el, 1), height: 34 + 22 * n,
      series: [{ label: "step" }, { label: "findings", show: false }],
      legend: { show: false },
      cursor: { sync: { key: SYNC, setSeries: false }, drag: { x: true, y: false }, points: { show: false } },
      scales: { x: { time: false, range: (u, lo, hi) => [lo, hi] }, y: { range: [0, n] } },
      axes: [{ size: 30, font: "11px system-ui", values: (u, s, a, sp, incr) => linTicks(u, s, a, sp, Math.max(1, incr)) }, { show: false }],
      hooks: { draw: [draw], setScale: [shareZoom], setCursor: [shareCursor] },
      plugins: [marksPlugin(RUNS[0].nan ? [{ step: RUNS[0].nan.step, color: "#d6402b", width: 2 }] : [])],
    }, [[first, last], [null, null]], el);
    charts.push(u);
    window.hsCharts.timeline = u;
  }

  // -- heatmaps on canvas ---------------------------------------------------------------------
  const STOPS = [[0, [13, 8, 135]], [0.25, [126, 3, 168]], [0.5, [204, 71, 120]], [0.75, [248, 149, 64]], [1, [240, 249, 33]]];
  const LUT = (() => {
    const out = [];
    for (let i = 0; i < 255; i++) {
      const t = i / 254;
      let k = 0;
      while (k < STOPS.length - 2 && t > STOPS[k + 1][0]) k++;
      const [t0, c0] = STOPS[k], [t1, c1] = STOPS[k + 1];
      const f = (t - t0) / (t1 - t0);
      out.push(c0.map((c, j) => Math.round(c + f * (c1[j] - c))));
    }
    return out;
  })();
  function bytes(b64) {
    const s = atob(b64);
    const out = new Uint8Array(s.length);
    for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
    return out;
  }
  function image(cells, rows, cols, flip) {
    const c = document.createElement("canvas");
    c.width = cols;
    c.height = rows;
    const ctx = c.getContext("2d");
    const img = ctx.createImageData(cols, rows);
    for (let r = 0; r < rows; r++) {
      for (let k = 0; k < cols; k++) {
        const q = cells[r * cols + k];
        const o = ((flip ? rows - 1 - r : r) * cols + k) * 4;
        const rgb = q === 255 ? [235, 238, 242] : LUT[q];
        img.data[o] = rgb[0]; img.data[o + 1] = rgb[1]; img.data[o + 2] = rgb[2]; img.data[o + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
    return c;
  }
  // A canvas heatmap with a tooltip and the shared step cursor drawn over it.
  function heatmap(parent, spec) {
    const box = panel(parent, "heat");
    const title = document.createElement("div");
    title.className = "heat-title";
    title.textContent = spec.title;
    box.appendChild(title);
    const canvas = document.createElement("canvas");
    const dpr = window.devicePixelRatio || 1;
    canvas.width = spec.width * dpr;
    canvas.height = spec.height * dpr;
    canvas.style.width = spec.width + "px";
    canvas.style.height = spec.height + "px";
    canvas.dataset.id = spec.id;
    box.appendChild(canvas);
    const tip = document.createElement("div");
    tip.className = "tip";
    box.appendChild(tip);
    const src = image(spec.cells, spec.rows, spec.cols, spec.flip);
    const L = spec.left * dpr, W = (spec.width - spec.left) * dpr, H = (spec.height - 16) * dpr;
    const colOf = (step) => {
      let k = 0;
      while (k < spec.steps.length - 1 && spec.steps[k + 1] <= step) k++;
      return k;
    };
    const paint = (step) => {
      const ctx = canvas.getContext("2d");
      ctx.clearRect(0, 0, canvas.width, canvas.height);
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(src, L, 0, W, H);
      ctx.fillStyle = "#1d2430";
      ctx.font = Math.round(10 * dpr) + "px system-ui";
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      spec.labels.forEach((label, r) => {
        if (label !== null) ctx.fillText(label, L - 4 * dpr, (r + 0.5) * (H / spec.labels.length));
      });
      ctx.textAlign = "left";
      ctx.textBaseline = "top";
      ctx.fillText("step " + spec.steps[0], L, H + 3 * dpr);
      ctx.textAlign = "right";
      ctx.fillText(String(spec.end), L + W, H + 3 * dpr);
      for (const m of spec.marks || []) {
        const x = L + (colOf(m.step) + 0.5) * (W / spec.cols);
        ctx.strokeStyle = m.color;
        ctx.lineWidth = 2 * dpr;
        ctx.beginPath(); ctx.moveTo(x, 0); ctx.lineTo(x, H); ctx.stroke();
      }
      if (step != null && step >= spec.steps[0] && step <= spec.end) {
        const x = L + (colOf(step) + 0.5) * (W / spec.cols);
        ctx.strokeStyle = "#ffffffcc";
        ctx.lineWidth = 1 * dpr;
        ctx.setLineDash([3 * dpr, 3 * dpr]);
        ctx.beginPath(); ctx.moveTo(x, 0); ctx.lineTo(x, H); ctx.stroke();
        ctx.setLineDash([]);
      }
    };
    paint(null);
    heatCursors.push(paint);
    canvas.addEventListener("mousemove", (e) => {
      const r = canvas.getBoundingClientRect();
      const x = e.clientX - r.left - spec.left, y = e.clientY - r.top;
      const k = Math.floor((x / (spec.width - spec.left)) * spec.cols);
      const row = Math.floor((y / (spec.height - 16)) * spec.rows);
      if (k < 0 || k >= spec.cols || row < 0 || row >= spec.rows) { tip.style.display = "none"; return; }
      const q = spec.cells[(spec.flip ? spec.rows - 1 - row : row) * spec.cols + k];
      tip.textContent = spec.tip(row, k, q);
      tip.style.display = "block";
      tip.style.left = Math.min(e.clientX - r.left + 12, spec.width - 200) + "px";
      tip.style.top = e.clientY - r.top + 12 + "px";
      paint(spec.steps[k]);
    });
    canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; paint(null); });
  }

  function drawHeatmaps() {
    const el = document.getElementById("hs-heat");
    if (!el) return;
    RUNS.forEach((r) => {
      const h = r.heat;
      if (!h) return;
      const cols = h.steps.length, rows = h.modules.length;
      const left = Math.min(220, 12 + 6.2 * Math.max(...h.modules.map((m) => m.length)));
      heatmap(el, {
        id: "heat:" + r.label,
        title: (RUNS.length > 1 ? r.label + ": " : "") + "log\u2081\u2080 \u2016grad\u2016 of each module's output, in the order the modules ran (top: first); colour from " + fmt(h.lo) + " to " + fmt(h.hi),
        width: width(el, 1), height: Math.min(16, Math.max(8, 420 / rows)) * rows + 16, left,
        cells: bytes(h.cells), rows, cols, steps: h.steps, end: h.end,
        labels: h.modules.map((m, i) => (rows <= 60 || i % Math.ceil(rows / 60) === 0 ? m : null)),
        marks: r.nan ? [{ step: r.nan.step, color: "#ffffff" }] : [],
        tip: (row, k, q) => h.modules[row] + " \u00b7 step " + h.steps[k] + (k + 1 < cols && h.steps[k + 1] - h.steps[k] > 1 ? "\u2013" + (h.steps[k + 1] - 1) : "") +
          ": " + (q === 255 ? "no value" : "\u2016grad\u2016 \u2248 " + fmt(Math.pow(10, h.lo + (q / 254) * (h.hi - h.lo)))),
      });
    });
  }

  function drawHists() {
    const el = document.getElementById("hs-hists");
    if (!el) return;
    RUNS.forEach((r) => {
      if (!r.hists.length) return;
      if (RUNS.length > 1) {
        const h = document.createElement("h3");
        h.textContent = r.label;
        el.appendChild(h);
      }
      const grid = panel(el, "grid");
      const w = width(el, 4);
      for (const v of r.hists) {
        const cols = v.steps.length;
        heatmap(grid, {
          id: "hist:" + r.label + ":" + v.module, title: v.module + " (value " + fmt(v.lo) + " \u2026 " + fmt(v.hi) + ")",
          width: w, height: 136, left: 4, cells: bytes(v.cells), rows: v.bins, cols, steps: v.steps, end: v.end,
          labels: [], flip: true,
          tip: (row, k, q) => {
            const bin = v.bins - 1 - row, size = (v.hi - v.lo) / v.bins;
            return "step " + v.steps[k] + " \u00b7 values " + fmt(v.lo + bin * size) + " \u2026 " + fmt(v.lo + (bin + 1) * size) +
              (q === 255 ? "" : ": " + (100 * Math.pow(q / 254, 2)).toFixed(1) + " % of the largest bin's share");
          },
        });
      }
    });
  }

  function drawFeatureMaps() {
    const el = document.getElementById("hs-maps");
    if (!el) return;
    RUNS.forEach((r) => r.maps.forEach((m) => {
      if (!m.shape.length) return;
      const box = panel(el, "maps");
      const title = document.createElement("div");
      title.className = "heat-title";
      const [c, hh, ww] = m.shape;
      title.textContent = m.module + " at step " + m.step + " (" + (c > m.channels.length ? "first " + m.channels.length + " of " : "") + c + " channels, " + hh + "\u00d7" + ww + ")";
      box.appendChild(title);
      const scale = Math.max(2, Math.floor(72 / Math.max(hh, ww)));
      m.channels.forEach((b64, i) => {
        const src = image(bytes(b64), hh, ww, false);
        const cv = document.createElement("canvas");
        cv.width = ww * scale; cv.height = hh * scale;
        cv.title = "channel " + i;
        const ctx = cv.getContext("2d");
        ctx.imageSmoothingEnabled = false;
        ctx.drawImage(src, 0, 0, cv.width, cv.height);
        box.appendChild(cv);
      });
    }));
  }

  // -- explanations: a probe's heatmaps over training (Monitor(explain=hs.Probe(...))) -------
  // Per module, one row per probe image: the image, then at each explained step its map
  // upsampled (bilinear) to the picture's size, coloured (jet, as hs.explain's overlays)
  // and blended half and half on the image.
  function jet(t) {
    const c = (k) => Math.round(255 * Math.min(1, Math.max(0, 1.5 - Math.abs(4 * t - k))));
    return [c(3), c(2), c(1)];
  }
  function bilinear(cells, rows, cols, H, W) {
    const out = new Float32Array(H * W);
    for (let y = 0; y < H; y++) {
      const sy = Math.min(rows - 1, Math.max(0, ((y + 0.5) * rows) / H - 0.5));
      const y0 = Math.floor(sy), y1 = Math.min(rows - 1, y0 + 1), fy = sy - y0;
      for (let x = 0; x < W; x++) {
        const sx = Math.min(cols - 1, Math.max(0, ((x + 0.5) * cols) / W - 0.5));
        const x0 = Math.floor(sx), x1 = Math.min(cols - 1, x0 + 1), fx = sx - x0;
        const top = cells[y0 * cols + x0] * (1 - fx) + cells[y0 * cols + x1] * fx;
        const bottom = cells[y1 * cols + x0] * (1 - fx) + cells[y1 * cols + x1] * fx;
        out[y * W + x] = (top * (1 - fy) + bottom * fy) / 255;
      }
    }
    return out;
  }
  function picture(W, H, title, pixel) {
    const c = document.createElement("canvas");
    c.width = W; c.height = H; c.title = title;
    const ctx = c.getContext("2d");
    const img = ctx.createImageData(W, H);
    for (let i = 0; i < W * H; i++) {
      const rgb = pixel(i);
      img.data[4 * i] = rgb[0]; img.data[4 * i + 1] = rgb[1]; img.data[4 * i + 2] = rgb[2]; img.data[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
    return c;
  }
  function drawExplanations() {
    const el = document.getElementById("hs-explain");
    if (!el) return;
    RUNS.forEach((r) => {
      const e = r.explanations;
      if (!e) return;
      const im = e.image;
      const W = 72, H = im ? Math.max(8, Math.round((72 * im.h) / im.w)) : 72;
      // The probe images at the picture's size (bilinear), as RGB in 0..1.
      const images = [];
      if (im) {
        const px = bytes(im.data);
        for (let n = 0; n < im.n; n++) {
          const chans = [0, 1, 2].map((k) => {
            const plane = new Uint8Array(im.h * im.w);
            for (let i = 0; i < im.h * im.w; i++) plane[i] = px[(n * im.h * im.w + i) * im.c + (im.c === 3 ? k : 0)];
            return bilinear(plane, im.h, im.w, H, W);
          });
          images.push(chans);
        }
      }
      for (const m of e.modules) {
        const head = document.createElement("h3");
        head.textContent = (RUNS.length > 1 ? r.label + ": " : "") + m.module + " \u00b7 " + m.method + " \u00b7 " + m.steps.length + " steps";
        el.appendChild(head);
        const tbl = document.createElement("table");
        tbl.className = "explain-strip";
        const top = tbl.insertRow();
        const corner = document.createElement("th");
        corner.textContent = im ? "image" : "";
        top.appendChild(corner);
        for (const s of m.steps) {
          const th = document.createElement("th");
          th.textContent = "step " + s;
          top.appendChild(th);
        }
        const [rows, cols] = m.grid;
        const maps = m.maps.map(bytes);
        const n = maps.length ? maps[0].length / (rows * cols) : 0;
        for (let i = 0; i < n; i++) {
          const tr = tbl.insertRow();
          const first = tr.insertCell();
          if (im && images[i]) {
            const [R, G, B] = images[i];
            first.appendChild(picture(W, H, "probe image " + i, (p) => [R[p] * 255, G[p] * 255, B[p] * 255]));
          } else {
            first.textContent = "#" + i;
          }
          m.steps.forEach((s, k) => {
            const heat = bilinear(maps[k].subarray(i * rows * cols, (i + 1) * rows * cols), rows, cols, H, W);
            const t = m.target[k], sc = m.score[k];
            const title = "image " + i + " at step " + s + (t ? ": class " + t[i] : "") + (sc ? " (score " + fmt(sc[i]) + ")" : "");
            const img = im && images[i];
            const cell = tr.insertCell();
            cell.appendChild(picture(W, H, title, (p) => {
              const j = jet(heat[p]);
              if (!img) return j;
              return [0.5 * img[0][p] * 255 + 0.5 * j[0], 0.5 * img[1][p] * 255 + 0.5 * j[1], 0.5 * img[2][p] * 255 + 0.5 * j[2]];
            }));
            if (t) {
              const label = document.createElement("div");
              label.className = "explain-class";
              label.textContent = "class " + t[i];
              cell.appendChild(label);
            }
          });
        }
        el.appendChild(tbl);
      }
    });
  }

  // -- around each loss spike: its own step range, so its own zoom and cursor ---------------
  function drawWindows() {
    const el = document.getElementById("hs-windows");
    if (!el) return;
    RUNS.forEach((r) => r.windows.forEach((w, k) => {
      const own = "hs-window-" + r.label + "-" + k;
      const name = (RUNS.length > 1 ? r.label + ": " : "") + w.kind + " at step " + w.step;
      const grid = panel(el, "grid");
      const marks = [{ step: w.step, color: "#d6402b", width: 2 }];
      const scalars = Object.entries(w.scalars).filter(([n, y]) => y.some((v) => v != null));
      const loss = scalars.filter(([n]) => n === "loss");
      const shown = loss.length ? loss : scalars.slice(0, 1);
      if (shown.length) {
        lineChart(panel(grid), { id: "window:" + r.label + ":" + w.step + ":scalars", own, title: name + ": " + shown[0][0],
          width: width(el, 2), height: 190, marks, series: shown.map(([n, y], i) => ({ label: n, x: w.x, y, color: COLORS[i % COLORS.length] })) });
      }
      const perGroup = (key, what) => {
        const groups = Object.entries(w[key] || {}).filter(([n, y]) => y.some((v) => v != null && v > 0));
        if (!groups.length) return;
        lineChart(panel(grid), { id: "window:" + r.label + ":" + w.step + ":" + key, own, title: name + ": " + what + " per group (log)",
          width: width(el, 2), height: 190, log: true, marks,
          series: groups.map(([n, y], i) => ({ label: n, x: w.x, y: y.map((v) => (v > 0 ? v : null)), color: COLORS[i % COLORS.length] })) });
      };
      perGroup("groups", "gradient L2 norm");
      perGroup("weights", "weight-sample L1 norm");
    }));
  }

  // -- evaluation passes: their own steps, on the shared step axis ----------------------------
  function drawEvals() {
    const el = document.getElementById("hs-evals");
    if (!el) return;
    RUNS.forEach((r) => {
      const e = r.evals;
      if (!e || !e.x.length) return;
      const series = e.modules.map((m, i) => ({ label: m, x: e.x, y: e.rms[i], color: COLORS[i % COLORS.length] }))
        .filter((s) => s.y.some((v) => v != null));
      if (!series.length) return;
      lineChart(panel(el), { id: "eval:" + r.label, title: (RUNS.length > 1 ? r.label + ": " : "") + "evaluation: output RMS per module (log)",
        width: width(el, 1), height: 220, log: true, series, marks: runMarks(r) });
    });
  }

  // What draws each section's charts, by the section's id (the report's SECTIONS, in
  // _report/_sections.py): a new section adds its drawer here, reading its own key of each
  // run's data. Drawn in page order; a section not on the page is skipped.
  const DRAWERS = {
    findings: [drawTimeline],
    curves: [drawCurves],
    windows: [drawWindows],
    modules: [drawModules],
    evals: [drawEvals],
    explanations: [drawExplanations],
    heatmaps: [drawHeatmaps, drawHists],
    "feature-maps": [drawFeatureMaps],
  };
  for (const [id, draws] of Object.entries(DRAWERS)) {
    if (!document.querySelector('section[id="' + id + '"], section[id^="' + id + '-"]')) continue;
    for (const draw of draws) {
      try {
        draw();
      } catch (err) {
        console.error("hookscope report: " + draw.name + " failed: " + err);
        throw err;
      }
    }
  }
  document.documentElement.dataset.hsReady = String(charts.length);
})();
