"""bench/map_draw.py at a tiny size: its synthetic map and a run of the whole script in Chromium."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from bench.map_draw import SCREENS, THEMES, main, synthetic_map


def test_the_synthetic_map_is_a_payload_of_every_point_once():
    p = synthetic_map(1000)["payload"]
    ids = np.frombuffer(base64.b64decode(p["ids"]), "<u4")
    assert p["n"] == 1000 and sorted(ids.tolist()) == list(range(1, 1001)) and len(p["themes"]) == THEMES
    assert sum(t["size"] for t in p["themes"]) == 1000


@pytest.mark.slow
def test_the_bench_draws_every_point_on_both_screens(tmp_path, capsys):
    assert main(["--sizes", "300", "--repeats", "1", "--json", str(tmp_path / "out.json")]) == 0
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [r["screen"] for r in rows] == list(SCREENS)
    assert all(r["drawn"] == 300 and 0 < r["selected"] < 300 and r["first_draw_ms"] > 0 for r in rows)
    assert "300 points · desktop" in capsys.readouterr().out
