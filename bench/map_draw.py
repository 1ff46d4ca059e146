"""How long the Map tab takes to draw N points in a real browser (Debian's Chromium, headless, software rendering).

    python bench/map_draw.py --sizes 10000,100000 --json bench/results/map_draw.json
    python bench/map_draw.py --sizes 500 --repeats 2                                    # tiny

The page's own component (app/page/map_view.py: its markup, style and script, unchanged) on a static page, fed the
payload the server sends (app/page/overview.py ``map_payload``) for a synthetic map of N points: 32 themes as
Gaussian blobs of different sizes, 12 folders; no index is built (a real 100,000-photo index takes hours to embed
here, and the drawing only sees the payload). Gradio's gr.HTML runs the script with ``element``, ``props``,
``trigger`` and ``watch``; the static page gives it the same four.

For each size and screen (a desktop 1280x800 at 1 device pixel per CSS pixel, a phone 390x844 at 3: the pixels
of a phone's screen, on this machine's CPU, not a phone's): the payload's size, the server's time to encode it, and
in the browser, the first draw (JSON parse, base64 decode, the spatial grid, the pixels) and a redraw (colour by
folder: the pixels and the grid again), medians of ``--repeats``; the selection of half the points (a box, as the
page counts it). Figures go to BENCHMARKS.md ("Drawing the Map tab").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.page.map_view import MAP_CSS, MAP_HTML, MAP_JS  # noqa: E402
from app.page.overview import map_payload  # noqa: E402
from tests.live import ARGS, CHROMIUM  # noqa: E402

SCREENS = {"desktop": ({"width": 1280, "height": 800}, 1), "phone": ({"width": 390, "height": 844}, 3)}
THEMES, FOLDERS = 32, 12

# The component as Gradio mounts it: `element` holds the template; `props.value` the payload; `watch` callbacks run
# when the value changes; `trigger` records the events the page would send.
PAGE = """<!doctype html><html><head><meta charset="utf-8"><style>body { margin: 16px; font-family: sans-serif; }
%(css)s</style></head><body><div id="collection-map"><div id="root">%(html)s</div></div><script>
const element = document.getElementById('root'), props = {value: null}, watchers = [];
window.events = [];
const watch = (key, cb) => watchers.push(cb), trigger = (name, data) => window.events.push([name, data]);
window.setValue = v => { props.value = v; watchers.forEach(cb => cb()); };
new Function('element', 'trigger', 'props', 'server', 'upload', 'watch', %(js)s)(element, trigger, props, {},
  null, watch);
</script></body></html>"""


def synthetic_map(n: int, seed: int = 0) -> dict[str, Any]:
    """A map of ``n`` points: THEMES Gaussian blobs of uneven sizes in [0, 1]^2, FOLDERS folders; the payload."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.ones(THEMES))  # THEMES
    theme = rng.choice(THEMES, n, p=weights)  # N
    centres = rng.random((THEMES, 2)) * 0.8 + 0.1  # THEMES x 2
    xy = np.clip(centres[theme] + rng.normal(0, 0.04, (n, 2)), 0, 1).astype(np.float32)  # N x 2
    folder = rng.integers(0, FOLDERS, n)  # N
    sizes = np.bincount(theme, minlength=THEMES)
    themes = [{"id": t, "size": int(sizes[t]), "label": f"theme {t + 1} ({sizes[t]})"} for t in range(THEMES)]
    t0 = time.perf_counter()
    payload = map_payload(np.arange(1, n + 1), xy, theme, folder, themes, [f"folder{f}" for f in range(FOLDERS)],
                          "thumbs/")
    return {"payload": payload, "encode_ms": (time.perf_counter() - t0) * 1000}


def measure(page: Any, text: str, repeats: int) -> dict[str, float]:
    """In the page: the first draw from the payload's JSON text, a redraw by folder, a box over half the points."""
    first, redraw = [], []
    for _ in range(repeats):
        first.append(page.evaluate("""text => { const t0 = performance.now();
            window.setValue(JSON.parse(text));
            return performance.now() - t0; }""", text))
        page.click("#root button[data-colour=folder]")
        redraw.append(float(page.locator("#root canvas.cmap-points").get_attribute("data-draw-ms")))
        page.click("#root button[data-colour=theme]")
    drawn = int(page.locator("#root canvas.cmap-points").get_attribute("data-points"))
    box = page.locator("#root canvas.cmap-over").bounding_box()
    page.mouse.move(box["x"] + 2, box["y"] + 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] - 2, steps=4)
    t0 = time.perf_counter()
    page.mouse.up()
    selected = page.evaluate("window.events.length ? Number(document.querySelector('#root canvas.cmap-over')"
                             ".dataset.selected) : -1")
    select_ms = (time.perf_counter() - t0) * 1000
    return {"first_draw_ms": statistics.median(first), "redraw_ms": statistics.median(redraw), "drawn": drawn,
            "selected": selected, "select_ms_with_round_trip": select_ms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000", help="points per map, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="draws per size and screen (the median is kept)")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    from playwright.sync_api import sync_playwright

    html = PAGE % {"css": MAP_CSS, "html": MAP_HTML, "js": json.dumps(MAP_JS)}
    rows = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for n in [int(s) for s in args.sizes.split(",")]:
            data = synthetic_map(n)
            text = json.dumps(data["payload"])
            for screen, (viewport, dpr) in SCREENS.items():
                context = browser.new_context(viewport=viewport, device_scale_factor=dpr, is_mobile=dpr > 1,
                                              has_touch=dpr > 1)
                page = context.new_page()
                page.set_content(html)
                row = {"points": n, "screen": screen, "viewport": viewport, "device_pixel_ratio": dpr,
                       "payload_bytes": len(text), "encode_ms": data["encode_ms"], **measure(page, text, args.repeats)}
                context.close()
                rows.append(row)
                print(f"{n:>7} points · {screen:<7} · payload {len(text) / 1e6:.2f} MB (encoded in "
                      f"{data['encode_ms']:.0f} ms) · first draw {row['first_draw_ms']:.0f} ms · redraw "
                      f"{row['redraw_ms']:.0f} ms · drawn {row['drawn']} · box: {row['selected']} selected")
        version = browser.version
        browser.close()
    from bench._machine import cpu_model

    command = "python bench/map_draw.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command, "browser": f"Chromium {version} (headless, software rendering)",
              "cpu": cpu_model(), "repeats": args.repeats, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
