"""The Map tab's drawing, in the browser: every photo a point of a 2-D canvas (one ``ImageData`` written per draw:
100,000 points in tens of milliseconds, BENCHMARKS.md), coloured by theme or by folder; and the Themes tab's cards.

The server sends the map once, as :func:`app.page.overview.map_payload` encodes it (base64 typed arrays in the
component's value); this module holds the component that draws it: its markup (``MAP_HTML``), its style
(``MAP_CSS``) and its script (``MAP_JS``). Hovering a point shows its thumbnail; a click sends the event ``pick``
``{id}``; a drag draws a box, or a lasso, and sends ``region`` ``{shape, points, version}``, its corners in the
payload's steps (1/65535 of the map, never clamped), which the server turns into the photos inside
(:func:`app.page.overview.region_mask`), counting them as the script does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["map_component", "MAP_HTML", "MAP_CSS", "MAP_JS", "MAP_EVENTS", "THEME_CARDS_JS", "THEME_CARDS_CSS"]

MAP_EVENTS = ("pick", "region")  # what the map sends to the server

MAP_HTML = """<div class="cmap">
<div class="cmap-bar">
 <span class="cmap-group">Colour by <button type="button" data-colour="theme">theme</button><button type="button"
  data-colour="folder">folder</button></span>
 <span class="cmap-group">Select with <button type="button" data-tool="box">box</button><button type="button"
  data-tool="lasso">lasso</button></span>
 <span class="cmap-count" aria-live="polite"></span>
</div>
<div class="cmap-stage"><canvas class="cmap-points"></canvas><canvas class="cmap-over"></canvas>
<div class="cmap-tip" hidden><img alt=""><span></span></div></div>
<div class="cmap-legend"></div>
</div>"""

MAP_CSS = """
.cmap-bar { display: flex; flex-wrap: wrap; gap: 6px 16px; align-items: center; margin: 0 0 6px 0; font-size: 14px; }
.cmap-bar button { margin-left: 4px; padding: 2px 10px; font-size: 13px; border: 1px solid var(--border-color-primary);
  border-radius: 6px; background: var(--background-fill-primary); color: var(--body-text-color); cursor: pointer; }
.cmap-bar button.on { background: var(--color-accent); color: white; border-color: var(--color-accent); }
.cmap-count { color: var(--body-text-color-subdued); }
.cmap-stage { position: relative; width: 100%; height: min(72vh, 100vw - 32px, 760px); min-height: 240px;
  background: var(--background-fill-secondary); overflow: hidden; }  /* square corners: a drag may start in one */
.cmap-stage canvas { position: absolute; inset: 0; width: 100%; height: 100%; touch-action: none; }
.cmap-over { cursor: crosshair; }
.cmap-tip { position: absolute; pointer-events: none; background: var(--background-fill-primary);
  border: 1px solid var(--border-color-primary); border-radius: 6px; padding: 4px; font-size: 12px;
  max-width: 160px; box-shadow: 0 2px 8px rgba(0, 0, 0, 0.25); }
.cmap-tip img { display: block; width: 150px; height: 150px; object-fit: cover; border-radius: 4px; }
.cmap-tip span { display: block; overflow-wrap: anywhere; margin-top: 2px; }
.cmap-legend { display: flex; flex-wrap: wrap; gap: 2px 12px; margin-top: 6px; font-size: 12px; }
.cmap-legend span { white-space: nowrap; }
.cmap-legend i { display: inline-block; width: 10px; height: 10px; border-radius: 50%; margin-right: 4px; }
"""

# `element`, `trigger`, `props` and `watch` come from Gradio's gr.HTML (js_on_load). The template is rendered again
# whenever the value changes, so the script keeps its state here and finds its canvases again on every draw.
MAP_JS = r"""
const PALETTE = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#17becf',
  '#bcbd22', '#7f7f7f', '#393b79', '#ad494a', '#637939', '#8c6d31', '#7b4173', '#3182bd', '#e6550d', '#31a354',
  '#756bb1', '#636363', '#f7b6d2', '#9edae5', '#c49c94', '#dbdb8d'];
const OTHER = '#b0b0b0';
const st = {colour: 'theme', tool: 'box', data: null, n: 0, px: null, py: null, cells: null, cellStart: null,
  cell: 16, cols: 0, rows: 0, w: 0, h: 0, drag: null, selected: null, lastId: null, hover: -1, paths: new Map()};

function decode(b64, Type) {
  const bin = atob(b64 || ''), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return new Type(bytes.buffer);
}
function rgba(hex) {  // '#rrggbb' -> the little-endian ABGR word of ImageData's Uint32 view
  const v = parseInt(hex.slice(1), 16);
  return (0xff << 24 | (v & 0xff) << 16 | (v >> 8 & 0xff) << 8 | v >> 16) >>> 0;
}
function colourOf(k, count) {
  if (k < 0 || k >= count) return OTHER;
  return k < PALETTE.length ? PALETTE[k] : `hsl(${(k * 137.508) % 360}, 55%, 50%)`;
}
function hexOf(css) {  // any CSS colour as '#rrggbb' (the hsl() ones past the palette)
  if (css[0] === '#') return css;
  const c = document.createElement('canvas').getContext('2d');
  c.fillStyle = css;
  return c.fillStyle;
}

function load(value) {
  st.data = null; st.selected = null; st.hover = -1;
  if (!value || !value.n) { st.n = 0; return; }
  const d = {...value};
  d.ids = d.ids_type === 'f64' ? decode(value.ids, Float64Array) : decode(value.ids, Uint32Array);
  d.xy = decode(value.xy, Uint16Array);
  d.theme = decode(value.theme, Uint16Array);
  d.folder = decode(value.folder, Uint16Array);
  d.index = new Map();
  let [x0, y0, x1, y1] = [65535, 65535, 0, 0];  // the points' bounds: drawn as large as they fit, undistorted
  for (let i = 0; i < value.n; i++) {
    d.index.set(d.ids[i], i);
    const x = d.xy[2 * i], y = d.xy[2 * i + 1];
    if (x < x0) x0 = x; if (x > x1) x1 = x; if (y < y0) y0 = y; if (y > y1) y1 = y;
  }
  d.bounds = [x0, y0, Math.max(1, x1 - x0), Math.max(1, y1 - y0)];
  st.data = d; st.n = value.n;
}

function parts() {
  return {bar: element.querySelector('.cmap-bar'), stage: element.querySelector('.cmap-stage'),
    points: element.querySelector('.cmap-points'), over: element.querySelector('.cmap-over'),
    tip: element.querySelector('.cmap-tip'), legend: element.querySelector('.cmap-legend'),
    count: element.querySelector('.cmap-count')};
}

function draw() {
  const p = parts();
  if (!p.points) return;
  p.bar.querySelectorAll('[data-colour]').forEach(b => b.classList.toggle('on', b.dataset.colour === st.colour));
  p.bar.querySelectorAll('[data-tool]').forEach(b => b.classList.toggle('on', b.dataset.tool === st.tool));
  const t0 = performance.now();
  const dpr = window.devicePixelRatio || 1, w = p.stage.clientWidth, h = p.stage.clientHeight;
  if (!w || !h) return;  // a hidden tab: drawn when it shows (the ResizeObserver)
  const W = Math.round(w * dpr), H = Math.round(h * dpr);
  for (const c of [p.points, p.over]) { c.width = W; c.height = H; }
  st.w = w; st.h = h;
  const d = st.data, n = st.n;
  p.points.dataset.points = '0';
  if (!d) { p.legend.textContent = ''; p.count.textContent = ''; return; }
  // the points' places in CSS pixels (hover, clicks, selections): one scale for both axes, centred
  const pad = 12, [bx, by, bw, bh] = d.bounds, sc = Math.min((w - 2 * pad) / bw, (h - 2 * pad) / bh);
  st.t = {sc, ox: (w - bw * sc) / 2 - bx * sc, oy: (h - bh * sc) / 2 - by * sc};
  const xs = new Float32Array(n), ys = new Float32Array(n);
  const byTheme = st.colour === 'theme', keys = byTheme ? d.theme : d.folder;
  const names = byTheme ? d.themes.map(t => t.label) : d.folders;
  const words = names.map((_, k) => rgba(hexOf(colourOf(k, names.length))));
  const other = rgba(OTHER);
  const img = new ImageData(W, H), px = new Uint32Array(img.data.buffer);
  const s = Math.max(1, Math.round((n > 50000 ? 1.5 : n > 5000 ? 2.5 : n > 1000 ? 4 : 6) * dpr)), half = s >> 1;
  const disc = [];  // a point's pixels: a disc of diameter s (a square below 4 px)
  for (let dy = 0; dy < s; dy++) for (let dx = 0; dx < s; dx++)
    if (s < 4 || (dx + 0.5 - s / 2) ** 2 + (dy + 0.5 - s / 2) ** 2 <= (s / 2) ** 2) disc.push(dx, dy);
  for (let i = 0; i < n; i++) {
    const x = st.t.ox + d.xy[2 * i] * sc, y = st.t.oy + d.xy[2 * i + 1] * sc;
    xs[i] = x; ys[i] = y;
    const k = keys[i], word = k < words.length ? words[k] : other;
    const X = Math.round(x * dpr) - half, Y = Math.round(y * dpr) - half;
    for (let j = 0; j < disc.length; j += 2) {
      const cx = X + disc[j], cy = Y + disc[j + 1];
      if (cx >= 0 && cx < W && cy >= 0 && cy < H) px[cy * W + cx] = word;
    }
  }
  p.points.getContext('2d').putImageData(img, 0, 0);
  st.px = xs; st.py = ys;
  grid();
  const ms = performance.now() - t0;
  p.points.dataset.points = String(n);
  p.points.dataset.drawMs = ms.toFixed(1);
  p.legend.innerHTML = '';
  names.forEach((name, k) => {
    const span = document.createElement('span'), dot = document.createElement('i');
    dot.style.background = colourOf(k, names.length);
    span.append(dot, name);
    p.legend.append(span);
  });
  if (!byTheme && d.other_folders) {
    const span = document.createElement('span'), dot = document.createElement('i');
    dot.style.background = OTHER;
    span.append(dot, `${d.other_folders} other folders`);
    p.legend.append(span);
  }
  p.count.textContent = `${n.toLocaleString()} photos · drawn in ${ms.toFixed(0)} ms`;
  overlay();
}

function grid() {  // the points by cell of st.cell CSS px (a counting sort): the nearest point in O(1)
  const c = st.cell, cols = Math.ceil(st.w / c) + 1, rows = Math.ceil(st.h / c) + 1, n = st.n;
  const cellOf = new Int32Array(n), start = new Int32Array(cols * rows + 1), order = new Int32Array(n);
  for (let i = 0; i < n; i++) {
    const cx = Math.min(cols - 1, Math.max(0, Math.floor(st.px[i] / c)));
    const cy = Math.min(rows - 1, Math.max(0, Math.floor(st.py[i] / c)));
    cellOf[i] = cy * cols + cx; start[cellOf[i] + 1]++;
  }
  for (let k = 0; k < cols * rows; k++) start[k + 1] += start[k];
  const fill = start.slice(0, cols * rows);
  for (let i = 0; i < n; i++) order[fill[cellOf[i]]++] = i;
  st.cells = order; st.cellStart = start; st.cols = cols; st.rows = rows;
}

function nearest(x, y, radius) {  // the point nearest (x, y) in CSS px within `radius`, or -1
  if (!st.cells) return -1;
  const c = st.cell, r = Math.ceil(radius / c), cx = Math.floor(x / c), cy = Math.floor(y / c);
  let best = -1, bestD = radius * radius;
  for (let gy = Math.max(0, cy - r); gy <= Math.min(st.rows - 1, cy + r); gy++)
    for (let gx = Math.max(0, cx - r); gx <= Math.min(st.cols - 1, cx + r); gx++) {
      const k = gy * st.cols + gx;
      for (let j = st.cellStart[k]; j < st.cellStart[k + 1]; j++) {
        const i = st.cells[j], dx = st.px[i] - x, dy = st.py[i] - y, dd = dx * dx + dy * dy;
        if (dd <= bestD) { bestD = dd; best = i; }
      }
    }
  return best;
}

// CSS px -> the map's coordinates in the payload's steps. The points lie in 0..65535, a selection may reach past
// them: never clamped, or an edge drawn beyond the points would pass through the outermost ones.
function toMap(x, y) {
  const q = v => Math.round(v);
  return [q((x - st.t.ox) / st.t.sc), q((y - st.t.oy) / st.t.sc)];
}

function inside(shape, pts) {  // the indices of the points inside a box or a polygon (quantised coordinates)
  const d = st.data, out = [];
  if (shape === 'box') {
    const [x0, x1] = [Math.min(pts[0][0], pts[1][0]), Math.max(pts[0][0], pts[1][0])];
    const [y0, y1] = [Math.min(pts[0][1], pts[1][1]), Math.max(pts[0][1], pts[1][1])];
    for (let i = 0; i < st.n; i++) {
      const x = d.xy[2 * i], y = d.xy[2 * i + 1];
      if (x >= x0 && x <= x1 && y >= y0 && y <= y1) out.push(i);
    }
    return out;
  }
  for (let i = 0; i < st.n; i++) {  // even-odd rule, as the server's
    const x = d.xy[2 * i], y = d.xy[2 * i + 1];
    let odd = false;
    for (let a = 0, b = pts.length - 1; a < pts.length; b = a++) {
      const [xa, ya] = pts[a], [xb, yb] = pts[b];
      if ((ya > y) !== (yb > y) && x < (xb - xa) * (y - ya) / (yb - ya) + xa) odd = !odd;
    }
    if (odd) out.push(i);
  }
  return out;
}

function overlay() {  // the selection's shape and its points, over the points (never redrawing them)
  const p = parts();
  if (!p.over || !st.w) return;
  const dpr = window.devicePixelRatio || 1, g = p.over.getContext('2d');
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, st.w, st.h);
  const path = st.drag ? st.drag.path : st.selected ? st.selected.path : null;
  if (st.selected && !st.drag) {
    g.fillStyle = 'rgba(0, 0, 0, 0.9)';
    for (const i of st.selected.points) g.fillRect(st.px[i] - 1.5, st.py[i] - 1.5, 3, 3);
  }
  if (st.hover >= 0 && st.px && !st.drag) {  // the point under the pointer
    g.strokeStyle = '#111'; g.lineWidth = 2; g.setLineDash([]);
    g.beginPath(); g.arc(st.px[st.hover], st.py[st.hover], 6, 0, 2 * Math.PI); g.stroke();
  }
  if (path && path.length > 1) {
    g.strokeStyle = '#111'; g.lineWidth = 1.5; g.setLineDash([5, 4]); g.fillStyle = 'rgba(255, 200, 0, 0.15)';
    g.beginPath();
    if ((st.drag || st.selected).tool === 'box') {
      const [a, b] = [path[0], path[path.length - 1]];
      g.rect(Math.min(a[0], b[0]), Math.min(a[1], b[1]), Math.abs(b[0] - a[0]), Math.abs(b[1] - a[1]));
    } else {
      g.moveTo(path[0][0], path[0][1]);
      for (const [x, y] of path.slice(1)) g.lineTo(x, y);
      g.closePath();
    }
    g.fill(); g.stroke();
  }
}

function at(e) {
  const r = parts().over.getBoundingClientRect();
  return [e.clientX - r.left, e.clientY - r.top];
}

function tip(i, x, y) {
  const p = parts();
  if (!p.tip) return;
  if (i !== st.hover) { st.hover = i; overlay(); }
  if (i < 0) { p.tip.hidden = true; st.lastId = null; return; }
  const d = st.data, id = d.ids[i];
  if (st.lastId !== id) {
    p.tip.querySelector('img').src = d.thumbs + id + '.jpg';
    const theme = d.themes[d.theme[i]], folder = d.folders[d.folder[i]], span = p.tip.querySelector('span');
    const show = path => { span.textContent = [theme ? theme.label : '', path].filter(Boolean).join(' · '); };
    show(st.paths.get(id) || (folder !== undefined ? folder + '/' : ''));
    if (!st.paths.has(id)) {  // the file's name: asked once per photo, from the API the page's login opens
      fetch('api/v1/photos/' + String(id), {credentials: 'same-origin'}).then(r => r.ok ? r.json() : null)
        .then(j => { if (j && j.path) { st.paths.set(id, j.path); if (st.lastId === id) show(j.path); } })
        .catch(() => {});
    }
    p.tip.dataset.id = String(id);
    st.lastId = id;
  }
  p.tip.hidden = false;
  const tw = p.tip.offsetWidth, th = p.tip.offsetHeight;
  p.tip.style.left = `${x + 14 + tw > st.w ? Math.max(0, x - 14 - tw) : x + 14}px`;
  p.tip.style.top = `${y + 14 + th > st.h ? Math.max(0, y - 14 - th) : y + 14}px`;
}

element.addEventListener('click', e => {
  const b = e.target.closest('button');
  if (!b) return;
  if (b.dataset.colour) { st.colour = b.dataset.colour; draw(); }
  if (b.dataset.tool) { st.tool = b.dataset.tool; draw(); }
});
element.addEventListener('pointerdown', e => {
  if (!e.target.closest('.cmap-stage') || !st.data || e.button > 0) return;
  parts().over.setPointerCapture(e.pointerId);
  st.drag = {tool: st.tool, path: [at(e)]};
  e.preventDefault();
});
element.addEventListener('pointermove', e => {
  if (!e.target.closest('.cmap-stage') || !st.data) return;
  const [x, y] = at(e);
  if (st.drag) {
    const path = st.drag.path, last = path[path.length - 1];
    if (st.drag.tool === 'box') path[1] = [x, y];
    else if (Math.abs(x - last[0]) + Math.abs(y - last[1]) >= 3) path.push([x, y]);
    tip(-1);
    overlay();
  } else tip(nearest(x, y, 10), x, y);
});
element.addEventListener('pointerup', e => {
  if (!st.drag) return;
  const drag = st.drag, [x, y] = at(e), [x0, y0] = drag.path[0];
  st.drag = null;
  if (Math.abs(x - x0) + Math.abs(y - y0) < 5 && drag.path.length < 3) {  // a click: the photo under it
    const i = nearest(x, y, 12);
    overlay();
    if (i >= 0) trigger('pick', {id: Number(st.data.ids[i])});
    return;
  }
  if (drag.tool === 'box') drag.path = [drag.path[0], [x, y]];
  else drag.path.push([x, y]);
  let pts = drag.path.map(([a, b]) => toMap(a, b));
  if (drag.tool === 'lasso' && pts.length > 200) pts = pts.filter((_, k) => k % Math.ceil(pts.length / 200) === 0);
  if (drag.tool === 'lasso' && pts.length < 3) { overlay(); return; }
  const chosen = inside(drag.tool, pts);
  st.selected = {tool: drag.tool, path: drag.path, points: chosen};
  overlay();
  parts().count.textContent = `${chosen.length.toLocaleString()} of ${st.n.toLocaleString()} photos selected`;
  parts().over.dataset.selected = String(chosen.length);
  trigger('region', {shape: drag.tool, points: pts, version: st.data.version});
});
element.addEventListener('pointerleave', () => { if (!st.drag) tip(-1); });

// what tests and the bench read: where a photo is drawn (CSS px from the canvas's corner), and a redraw
element.cmap = {
  draw: () => { draw(); return Number(parts().points.dataset.drawMs); },
  place: id => { const i = st.data ? st.data.index.get(id) : undefined;
    return i === undefined ? null : [st.px[i], st.py[i]]; },
  load: value => { load(value); draw(); },
  ids: () => (st.data ? Array.from(st.data.ids) : []),
  selection: () => st.selected && {tool: st.selected.tool, path: st.selected.path, count: st.selected.points.length},
};
let queued = false;
new ResizeObserver(() => {
  if (queued) return;
  queued = true;
  requestAnimationFrame(() => { queued = false; if (parts().stage && parts().stage.clientWidth !== st.w) draw(); });
}).observe(element);
watch('value', () => { load(props.value); draw(); });
load(props.value);
draw();
"""


def map_component(**kwargs: Any) -> Any:
    """The Map tab's gr.HTML: ``MAP_HTML`` drawn by ``MAP_JS`` from a :func:`app.page.overview.map_payload` value;
    its events ``pick`` and ``region`` (``MAP_EVENTS``) carry their data in ``gr.EventData``."""
    import gradio as gr

    return gr.HTML(None, html_template=MAP_HTML, css_template=MAP_CSS, js_on_load=MAP_JS, **kwargs)


# The Themes tab's cards (:meth:`app.page.overview.CollectionOverview.themes`): a click (or Enter) on one sends
# ``theme`` ``{id}``, which browses it.
THEME_CARDS_JS = r"""
const send = e => {
  const card = e.target.closest('[data-theme]');
  if (card && (e.type === 'click' || e.key === 'Enter')) trigger('theme', {id: Number(card.dataset.theme)});
};
element.addEventListener('click', send);
element.addEventListener('keydown', send);
"""

THEME_CARDS_CSS = """
.theme-card { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 8px; margin: 8px 0;
  cursor: pointer; }
.theme-card:hover, .theme-card:focus { border-color: var(--color-accent); outline: none; }
.theme-card h4 { margin: 0 0 6px 0; }
.theme-thumbs { display: grid; grid-template-columns: repeat(auto-fill, minmax(88px, 1fr)); gap: 4px; }
.theme-thumbs img { width: 100%; aspect-ratio: 1 / 1; object-fit: cover; border-radius: 4px; }
.theme-folders { margin: 6px 0 0 0; font-size: 13px; overflow-wrap: anywhere; }
"""
