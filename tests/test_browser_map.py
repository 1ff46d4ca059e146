"""The whole collection in Debian's Chromium, against `moco serve`: the Map tab draws every photo (desktop and phone),
a hover shows a photo's thumbnail, a click searches with it, a box and a lasso show the photos inside (checked
against where the page drew each photo); the Themes tab's cards open the Browse grid of a theme; the Unusual tab
ranks as the index does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .live import chromium, moco_serve

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
VIEWPORTS = {"desktop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 844}}
POINTS = "#collection-map canvas.cmap-points"
OVER = "#collection-map canvas.cmap-over"
API = "[...document.querySelectorAll('#collection-map *')].find(e => e.cmap).cmap"
SELECTED = "#map-selection button.thumbnail-item"


@pytest.fixture(scope="module")
def served(backbone, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """`moco serve` over an index of 6 families x 8 generated photos."""
    from index.building.runner import build_index
    from moco.data.sample import make_sample_collection

    tmp = tmp_path_factory.mktemp("browser_map")
    make_sample_collection(tmp / "photos", per_family=8, size=48, seed=7)
    build_index(tmp / "photos", backbone, tmp / "idx", progress=False, device="cpu")
    log = tmp / "server.log"
    with moco_serve(tmp / "idx", log) as url:
        yield {"url": url, "idx": tmp / "idx", "photos": tmp / "photos", "log": log}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def catalog(served) -> dict[int, str]:
    """Every indexed photo: id -> path."""
    from index.search.image_index import ImageIndex

    index = ImageIndex.open(served["idx"])
    return {r.id: r.path for r in index.catalog.rows().values() if r.status == "ok"}


def _map_page(browser: Any, served: dict, viewport: str = "desktop") -> Any:
    """A page at ``viewport`` on the Map tab, drawn; collects uncaught page and console errors."""
    p = browser.new_context(viewport=VIEWPORTS[viewport], has_touch=viewport == "phone").new_page()
    p.errors = []
    p.on("pageerror", lambda e: p.errors.append(f"page error: {e}"))
    p.on("console", lambda m: p.errors.append(f"console {m.text}") if m.type == "error" else None)
    p.goto(served["url"])
    p.wait_for_selector("#title")
    p.get_by_role("tab", name="Map").click()
    p.wait_for_function(f"document.querySelector('{POINTS}') && document.querySelector('{POINTS}').dataset.points > 0",
                        timeout=60_000)
    return p


def _close(p: Any) -> None:
    errors = list(p.errors)
    p.context.close()
    assert not errors, errors


def _places(page: Any, ids: list[int]) -> dict[int, tuple[float, float]]:
    """Where the page drew each photo: CSS px from the canvas's top left corner."""
    return {int(k): tuple(v) for k, v in page.evaluate(f"ids => Object.fromEntries(ids.map(i => [i, {API}.place(i)]))",
                                                          ids).items()}


def _isolated(places: dict[int, tuple[float, float]], far: float = 14) -> int:
    """A photo with no other drawn within ``far`` px (a hover or click on it means it alone)."""
    ids = list(places)
    xy = np.array([places[i] for i in ids])  # N x 2
    d = np.hypot(*(xy[:, None, :] - xy[None, :, :]).transpose(2, 0, 1))  # N x N
    np.fill_diagonal(d, np.inf)
    return ids[int(np.argmax(d.min(1)))] if d.min(1).max() > far else pytest.fail("no isolated point")


def _reachable(page: Any, x: float, y: float) -> tuple[float, float]:
    """(x, y) in page px, once the map's canvas is what a pointer there reaches: while an event that updates the map
    runs (the Map tab's own, on being shown again), Gradio covers the component with its progress overlay, and a
    click or drag lands on that."""
    page.wait_for_function(f"([x, y]) => document.elementFromPoint(x, y) === document.querySelector('{OVER}')",
                           arg=[x, y], timeout=60_000)
    return x, y


def _selected_paths(page: Any, words: str) -> list[str]:
    try:
        page.wait_for_function(
            f"document.querySelector('#map-selection-info').innerText.includes({json.dumps(words)})", timeout=60_000)
    except Exception:  # what the page shows instead: its own count, the server's answer, a message
        seen = page.evaluate(f"""() => ({{count: document.querySelector('#collection-map .cmap-count').innerText,
            selected: document.querySelector('{OVER}').dataset.selected,
            info: document.querySelector('#map-selection-info').innerText,
            message: document.querySelector('#map-message').innerText, scroll: window.scrollY,
            over: document.querySelector('{OVER}').getBoundingClientRect().toJSON()}})""")
        pytest.fail(f"waited for {words!r}; the page shows {seen}")
    return page.evaluate(f"[...document.querySelectorAll('{SELECTED} .caption-label')].map(c => c.innerText)")


@pytest.mark.parametrize("viewport", list(VIEWPORTS))
def test_the_map_draws_every_photo_and_a_hover_shows_its_thumbnail(browser, served, catalog, viewport):
    page = _map_page(browser, served, viewport)
    n = len(catalog)
    assert int(page.locator(POINTS).get_attribute("data-points")) == n
    box = page.locator(POINTS).bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= VIEWPORTS[viewport]["width"] + 1 and box["height"] >= 240
    coloured = page.evaluate(f"""() => {{ const c = document.querySelector('{POINTS}');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let k = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) k++; return k; }}""")
    assert coloured >= n  # every point drew pixels (each at least a few, overlaps aside)
    places = _places(page, list(catalog))
    assert all(0 <= x <= box["width"] and 0 <= y <= box["height"] for x, y in places.values())
    one = _isolated(places)
    page.mouse.move(*_reachable(page, box["x"] + places[one][0], box["y"] + places[one][1]))
    page.wait_for_function(f"""() => {{ const t = document.querySelector('#collection-map .cmap-tip');
        return !t.hidden && t.dataset.id == '{one}' && t.querySelector('img').complete &&
               t.querySelector('img').naturalWidth > 0; }}""", timeout=30_000)
    page.wait_for_function(f"""() => document.querySelector('#collection-map .cmap-tip span').textContent
        .endsWith({json.dumps(catalog[one])})""", timeout=30_000)  # the file's name, from the API
    legend = page.locator("#collection-map .cmap-legend").inner_text()
    assert "theme 0 (" in legend
    page.locator("#collection-map button[data-colour=folder]").click()
    legend = page.locator("#collection-map .cmap-legend").inner_text()
    assert sorted(legend.split()) == sorted({p.split("/")[0] for p in catalog.values()})  # the folders, no themes
    _close(page)


def test_a_click_on_a_point_searches_with_its_photo_and_shows_it(browser, served, catalog):
    page = _map_page(browser, served)
    places = _places(page, list(catalog))
    one = _isolated(places)
    box = page.locator(OVER).bounding_box()
    page.mouse.click(*_reachable(page, box["x"] + places[one][0], box["y"] + places[one][1]))
    page.wait_for_function(f"document.querySelector('#search-info').innerText.includes({json.dumps(catalog[one])})",
                           timeout=60_000)
    assert page.get_by_role("tab", name="Search").get_attribute("aria-selected") == "true"
    captions = page.locator("#results button.thumbnail-item .caption-label").all_inner_texts()
    assert captions and captions[0].startswith("#1 · ")  # its neighbours; the photo itself is left out, as said
    assert not any(c.endswith(catalog[one]) for c in captions)
    assert "the photo itself is left out" in page.locator("#search-info").inner_text()
    assert page.locator("#detail-path input, #detail-path textarea").first.input_value().endswith(catalog[one])
    page.get_by_role("tab", name="Map").click()  # back on the map: still drawn, the same map, selections work
    # shown again (a hidden tab's stage has no size, and its canvas keeps the count it had), then drawn at that size
    shown = "document.querySelector('#collection-map .cmap-stage').clientWidth > 0"
    page.wait_for_function(f"{shown} && {API}.draw() >= 0 && document.querySelector('{POINTS}').dataset.points == "
                           f"{len(catalog)}", timeout=30_000)
    box = page.locator(OVER).bounding_box()
    _drag(page, [(1, 1), (box["width"] - 1, box["height"] - 1)])
    _selected_paths(page, f"{len(catalog)} photos selected")
    _close(page)


def test_a_tap_on_a_phone_searches_with_the_photo(browser, served, catalog):
    page = _map_page(browser, served, "phone")
    places = _places(page, list(catalog))
    one = _isolated(places)
    box = page.locator(OVER).bounding_box()
    page.touchscreen.tap(*_reachable(page, box["x"] + places[one][0], box["y"] + places[one][1]))
    page.wait_for_function(f"document.querySelector('#search-info').innerText.includes({json.dumps(catalog[one])})",
                           timeout=60_000)
    _close(page)


def _drag(page: Any, path: list[tuple[float, float]]) -> None:
    box = page.locator(OVER).bounding_box()
    page.mouse.move(*_reachable(page, box["x"] + path[0][0], box["y"] + path[0][1]))
    page.mouse.down()
    for x, y in path[1:]:
        page.mouse.move(box["x"] + x, box["y"] + y, steps=6)
    page.mouse.up()


def test_a_box_and_a_lasso_show_the_photos_inside(browser, served, catalog):
    page = _map_page(browser, served)
    places = _places(page, list(catalog))
    xy = np.array([places[i] for i in catalog])  # N x 2
    (x0, y0), (x1, y1) = xy.min(0), xy.max(0)
    # a box over the left half of the points: the photos drawn inside it (none on its edge)
    left, top, right, bottom = x0 - 5, y0 - 5, (x0 + x1) / 2, y1 + 5
    while np.any(np.abs(xy[:, 0] - right) < 1.5):
        right += 2
    _drag(page, [(left, top), (right, bottom)])
    inside = sorted(catalog[i] for i, (x, y) in places.items() if left < x < right and top < y < bottom)
    assert 0 < len(inside) < len(catalog)
    shown = _selected_paths(page, f"{len(inside)} photos selected")
    assert sorted(c.split(" · ")[-1] for c in shown) == inside
    assert page.locator(OVER).get_attribute("data-selected") == str(len(inside))  # the page counted the same
    page.locator("#collection-map button[data-tool=lasso]").click()
    def side(p: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:  # signed distance to the line a -> b
        return float((b[0] - a[0]) * (p[1] - a[1]) - (b[1] - a[1]) * (p[0] - a[0])) / float(np.hypot(*(b - a)))

    # a triangle over the right half, none of the points within 4 px of its edges (the page keeps a corner of the
    # path where the pointer moved 3 px on from the last one it kept)
    for shift in range(0, 200, 2):
        tri = np.array([[(x0 + x1) / 2 - 20 + shift, y0 - 10], [x1 + 10, y0 - 10], [x1 + 10, y1 + 10]])  # 3 x 2
        edge = [(a, b) for a, b in zip(tri, np.roll(tri, -1, axis=0))]
        dist = {i: [side(np.array(p), a, b) for a, b in edge] for i, p in places.items()}
        if all(min(abs(s) for s in d) > 4 for d in dist.values()):
            break
    else:
        pytest.fail("no triangle clear of the points")
    inside = sorted(catalog[i] for i, d in dist.items() if all(s > 0 for s in d) or all(s < 0 for s in d))
    assert 0 < len(inside) < len(catalog)
    path = [tuple(tri[0]), *[tuple(tri[0] + (tri[1] - tri[0]) * t) for t in (0.5, 1.0)],
            *[tuple(tri[1] + (tri[2] - tri[1]) * t) for t in (0.5, 1.0)], tuple(tri[2] + (tri[0] - tri[2]) * 0.5)]
    _drag(page, path)
    shown = _selected_paths(page, f"{len(inside)} photos selected")
    assert sorted(c.split(" · ")[-1] for c in shown) == inside
    first = shown[0].split(" · ")[-1]
    page.locator(SELECTED).first.click()  # a selected photo searches with it too
    page.wait_for_function(f"document.querySelector('#search-info').innerText.includes({json.dumps(first)})",
                           timeout=60_000)
    _close(page)


def test_a_theme_opens_its_grid_and_the_unusual_rank_as_the_index(browser, served, catalog):
    from index.overview.themes import collection_themes
    from index.overview.unusual import unusual_photos
    from index.search.image_index import ImageIndex

    index = ImageIndex.open(served["idx"])
    themes = collection_themes(index)
    page = _map_page(browser, served)
    page.get_by_role("tab", name="Themes").click()
    page.wait_for_function(f"document.querySelectorAll('#theme-cards .theme-card').length == {len(themes.themes)}",
                           timeout=60_000)
    second = themes.themes[1]
    page.locator("#theme-cards .theme-card").nth(1).click()
    page.wait_for_function(f"document.querySelector('#browse-where') && "
                           f"document.querySelector('#browse-where').innerText.includes('of theme 1') && "
                           f"document.querySelectorAll('#browse-grid button.thumbnail-item').length == {second.size}",
                           timeout=60_000)
    grid = page.evaluate("[...document.querySelectorAll('#browse-grid .caption-label')].map(c => c.innerText)")
    members = sorted(catalog[int(i)] for i in themes.members(second.id))
    assert [c.split(" · ")[-1] for c in grid] == members  # by name
    page.get_by_role("tab", name="Unusual").click()
    page.wait_for_function("document.querySelectorAll('#unusual-grid button.thumbnail-item').length > 0",
                           timeout=60_000)
    ranked, _ = unusual_photos(index, 0, 60)
    first = page.locator("#unusual-grid .caption-label").first.inner_text()
    assert first == f"#1 · closest other {ranked[0][1]:.3f} · {catalog[ranked[0][0]]}"
    _close(page)
