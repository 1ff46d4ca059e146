"""bench/dedup_copies.py at a tiny size: the collection it plants, its scores against a brute-force count, and a run
of the whole script (Fashion-MNIST from Debian's dataset-fashion-mnist; skipped without it)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench._datasets import FASHION_DIR
from bench.dedup_copies import EDITS, main, score, write_collection
from index.duplicates.groups import Group, Member


def _group(*paths: str) -> Group:
    """A group of photos ``paths`` (all the scores read)."""
    return Group(id="near-0-000000", kind="near", size=len(paths), representative=None, tightest=None, loosest=None,
                 keep=None, keep_id=None, reason="", members=tuple(Member(n, p) for n, p in enumerate(paths)))


def test_the_planted_copies_and_the_scores(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (24, 32, 32, 3), np.uint8)
    copies = write_collection(tmp_path, images, 0.5, seed=0)
    assert len(copies) == 12 and sorted({Path(c).stem.split("_", 1)[1] for c in copies}) == sorted(EDITS)
    for copy, photo in copies.items():
        same = hashlib.sha256((tmp_path / copy).read_bytes()).digest() == hashlib.sha256(
            (tmp_path / photo).read_bytes()).digest()
        assert same == copy.endswith("_exact.png")
    (c1, p1), (c2, p2), (c3, _) = list(copies.items())[:3]
    others = sorted(p for p in (f"photos/{i:05d}.png" for i in range(24)) if p not in copies.values())
    groups = [_group(p1, c1, others[0]),  # a copy, its photo and another
              _group(c2, others[1])]  # a copy without its photo
    s = score(groups, copies)
    # by hand: pairs (p1, c1) real, (p1, o0) and (c1, o0) not, (c2, o1) not
    assert (s["pairs"], s["real_pairs"], s["pair_precision"], s["largest_distinct"]) == (4, 1, 0.25, 2)
    edit1, edit2 = (Path(c).stem.split("_", 1)[1] for c in (c1, c2))
    assert s["recall"][edit1] == pytest.approx(1 / s["copies"][edit1], abs=1e-4)
    assert s["recall_all"] == pytest.approx(1 / 12, abs=1e-4)
    assert s["recall"][edit2] == 0.0 or edit2 == edit1


@pytest.mark.skipif(not FASHION_DIR.exists(), reason="apt-get install dataset-fashion-mnist")
def test_the_bench_runs_at_a_tiny_size(tmp_path, capsys):
    out = tmp_path / "dedup_copies.json"
    assert main(["--dataset", "fashion", "--sizes", "60", "--size", "32", "--copies", "0.2", "--work",
                 str(tmp_path / "work"), "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    r = report["sizes"][0]
    assert r["photos"] == 60 and r["copies_planted"] == 12 and r["recall"]["exact"] == 1.0  # the same bytes: always
    assert r["rule"] in ("calibrated", "crowd") and 0 <= r["pair_precision"] <= 1 and r["largest_distinct"] >= 1
    assert "aim (recall >= 0.98" in capsys.readouterr().out


@pytest.mark.skipif(not FASHION_DIR.exists(), reason="apt-get install dataset-fashion-mnist")
def test_the_scale_bench_plants_each_edit_and_scores_by_hand(tmp_path):
    """bench/dedup_scale.py: every small edit planted once in turn (each copy other bytes than its photo but the
    exact one's), each large photo's four copies at their sizes, and its scores (recall per edit, small and large
    apart; pair precision; the largest group of distinct photos) against a count by hand."""
    from PIL import Image

    from bench._datasets import BACKGROUNDS_DIR
    from bench.dedup_scale import LARGE_EDITS, SMALL_EDITS, _score, write_collection

    large = 1 if (BACKGROUNDS_DIR / "gnome").exists() else 0
    copies = write_collection(tmp_path, 30, 0.3, large, seed=0)
    small = {c: p for c, p in copies.items() if not Path(c).name.startswith("L")}
    assert sorted(Path(c).stem.split("_", 1)[1] for c in small) == sorted(SMALL_EDITS)
    for copy, photo in small.items():
        same = (tmp_path / copy).read_bytes() == (tmp_path / photo).read_bytes()
        assert same == copy.endswith("_exact.png"), copy
        assert Image.open(tmp_path / copy).size == (32, 32) or "crop2px" in copy
    if large:
        sizes = {Path(c).stem.split("_", 1)[1]: Image.open(tmp_path / c).size for c in copies if "/L000_" in c}
        w, h = Image.open(tmp_path / "large" / "L000.jpg").size
        assert sorted(sizes) == sorted(LARGE_EDITS) and max(w, h) == 1024
        assert sizes["crop70"] == (round(0.7 * w), round(0.7 * h)) and sizes["half"] == (w // 2, h // 2)
    (c1, p1), (c2, _) = list(small.items())[:2]
    other = "photos/0000/0000029.png"
    groups = [{"members": [{"path": p1}, {"path": c1}, {"path": other}]}, {"members": [{"path": c2}]}]
    s = _score(groups, copies)
    assert (s["pairs"], s["pair_precision"], s["largest_distinct"]) == (3, round(1 / 3, 4), 2)
    assert s["recall"][Path(c1).stem.split("_", 1)[1]] == 1.0 and s["recall"][Path(c2).stem.split("_", 1)[1]] == 0.0


@pytest.mark.skipif(not FASHION_DIR.exists(), reason="apt-get install dataset-fashion-mnist")
def test_the_scale_bench_writes_photos_as_cameras_do_with_exif(tmp_path):
    """bench/dedup_scale.py --exif: every photo with its own date taken and a camera, as the catalog reads them; a
    copy an editor made keeps its photo's, a re-encode for the web has none; the pixels are those without --exif."""
    from bench._datasets import BACKGROUNDS_DIR
    from bench.dedup_scale import KEEPS_EXIF, write_collection
    from moco.data.photos import photo_info

    large = 1 if (BACKGROUNDS_DIR / "gnome").exists() else 0
    copies = write_collection(tmp_path / "exif", 30, 0.3, large, seed=0, exif=True)
    assert copies == write_collection(tmp_path / "plain", 30, 0.3, large, seed=0)
    photos = sorted({p for p in copies.values()} | {f"photos/0000/{i:07d}.png" for i in range(30)})
    info = {p: photo_info(tmp_path / "exif" / p) for p in [*photos, *copies]}
    taken = [info[p].taken for p in photos]
    assert None not in taken and len(set(taken)) == len(taken) and all(info[p].camera for p in photos)
    for copy, photo in copies.items():
        edit = Path(copy).stem.split("_", 1)[1]
        kept = (info[copy].taken, info[copy].camera) == (info[photo].taken, info[photo].camera)
        assert kept == (edit in KEEPS_EXIF) and (info[copy].taken is None) == (edit not in KEEPS_EXIF), copy
        plain = Image.open(tmp_path / "plain" / copy).convert("RGB")
        assert np.array_equal(np.asarray(Image.open(tmp_path / "exif" / copy).convert("RGB")), np.asarray(plain))


@pytest.mark.skipif(not FASHION_DIR.exists(), reason="apt-get install dataset-fashion-mnist")
def test_the_scale_bench_runs_tiny_and_measures_a_search_after_adding_photos(tmp_path, capfd):
    """bench/dedup_scale.py end to end at 40 photos: the full search cold (nothing kept from an earlier one), its
    stages shown as they go (``--progress``), then 10 photos added with their copies (and copies of photos from
    before), the index updated and searched again checking only the new pairs: every copy found."""
    from bench.dedup_scale import OLD_EDITS, SMALL_EDITS
    from bench.dedup_scale import main as scale

    out = tmp_path / "scale.json"
    assert scale(["--sizes", "40", "--large", "0", "--copies", "0.25", "--add", "0.25", "--progress",
                  "--work", str(tmp_path / "work"), "--json", str(out)]) == 0
    r = json.loads(out.read_text())["sizes"][0]
    assert r["photos"] == 40 and r["reused"] == 0 and r["checked"] == r["proposed"] > 0
    a = r["added"]
    assert a["photos_added"] == 10 + len(SMALL_EDITS) + len(OLD_EDITS)  # 10 photos, each edit planted once at least,
    assert {f"old-{e}" for e in OLD_EDITS} <= set(a["recall"])  # and copies of photos from before, made since
    assert all(a["recall"][f"old-{e}"] == 1.0 for e in OLD_EDITS), a["recall"]
    assert 0 < a["checked"] < a["proposed"] and a["reused"] > 0
    printed = capfd.readouterr()
    assert a["recall"]["exact"] == 1.0 and f"after adding {a['photos_added']} photos" in printed.out
    assert all(stage in printed.err for stage in ("model links", "proposals", "pixel check")), printed.err[-2000:]
