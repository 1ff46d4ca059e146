"""Duplicates at the size of a real library (issue 52): `moco index dedup`'s wall time and peak memory at 10,000,
100,000 (and 1,000,000) photos, with recall per edit, pair precision and the largest group of distinct photos.

    OMP_NUM_THREADS=2 python bench/dedup_scale.py --sizes 10000,100000 --work .bench_runs/dedup_scale \\
        --json bench/results/dedup_scale.json [--peer WORKTREE_OF_AN_EARLIER_COMMIT]

A collection of N photos: small ones of 32 px (Fashion-MNIST's ``--split``, 28 px enlarged, then seeded smooth random
pictures for the rest: distinct, and as cheap to make as a library needs) and ``--large`` photos of 1024 px on their
long side (the gnome-backgrounds pictures that are not plain colours: 6 a split). A ``--copies`` share of the small
photos get one copy each, the edits in turn: ``exact``, ``jpeg50`` (JPEG quality 50), ``webp`` (quality 75),
``shrunk26`` (to 26 px and back), ``crop2px`` (2 px off each side), ``bright15`` (+15%), ``contrast`` (x1.3), ``gamma``
(0.8), ``mirrored`` and ``heic`` (HEIC quality 50, as a phone or a converter saves it: pillow-heif, the ``heic`` extra);
every large photo gets ``crop70`` (70% of each side, at a seeded off-centre place), ``crop80`` (its centre 80%),
``jpeg50``, ``half`` (half its size) and ``heic``. A collection is written and indexed once per work folder and settings
(its ``done`` file holds them: other settings, or other edits, write it anew). The index is built with a seeded random
ResNet-18 (the weakest model: the pixel check does the work), then `moco index dedup`'s search runs in a process of its
own (cold: what an earlier search kept in the index folder deleted first), whose wall time and peak resident memory
(VmHWM; and each stage's resident memory at its end, with the peak so far) are measured; "beyond the index" subtracts
the index's own files (vectors and thumbnails' catalog, which a search holds). ``--add 0.01``: then 1% new photos
(smooth pictures, with copies) are added, with copies of photos from before made since (:data:`OLD_EDITS` of a few
small ones, :data:`OLD_LARGE_EDITS` of each large one: their edits named ``old-...``), a copy of the index updated, and
the search run again with what the full one kept (only the new pairs checked). Aims (issue 52, 2 cores): 100,000
photos in at most 5 minutes, 1,000,000 in at most an hour, at most 2 GB beyond the index, recall >= 0.98 for every
edit, pair precision >= 0.98, no group of more than 10 distinct photos; after adding 1%, at most a tenth of the full
search's time.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import io  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image, ImageEnhance, ImageOps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL_EDITS = ("exact", "jpeg50", "webp", "shrunk26", "crop2px", "bright15", "contrast", "gamma", "mirrored", "heic")
LARGE_EDITS = ("crop70", "crop80", "jpeg50", "half", "heic")
OLD_EDITS = ("crop2px", "jpeg50", "bright15", "mirrored")  # --add: copies of photos from before, made since
OLD_LARGE_EDITS = ("crop70", "crop80")  # (of each large photo: found only by the old photos' search among the new)
AIM = {"seconds": {100_000: 300, 1_000_000: 3600}, "beyond_index_gb": 2.0, "recall": 0.98, "pair_precision": 0.98,
       "largest_distinct": 10}
SMALL, LARGE = 32, 1024
CACHE_FILES = ("dedup-frames.bin", "dedup-windows.bin", "dedup-flats.bin", "dedup-checked.bin", "dedup-neighbours.bin",
               "dedup-links.bin")  # a search keeps
FLAT_STD = 4.0  # grey levels: a wallpaper whose 48-px grey spreads less is a plain colour, left out


def _encoded(img: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _small_copy(img: Image.Image, edit: str) -> tuple[bytes, str]:
    """The bytes of ``edit`` of a small photo and their suffix."""
    if edit == "jpeg50":
        return _encoded(img, "JPEG", quality=50), "jpg"
    if edit == "webp":
        return _encoded(img, "WEBP", quality=75), "webp"
    if edit == "heic":
        return _encoded(img, "HEIF", quality=50), "heic"
    if edit == "shrunk26":
        out = img.resize((26, 26), Image.Resampling.BICUBIC).resize(img.size, Image.Resampling.BICUBIC)
    elif edit == "crop2px":
        out = img.crop((2, 2, img.width - 2, img.height - 2))
    elif edit == "bright15":
        out = ImageEnhance.Brightness(img).enhance(1.15)
    elif edit == "contrast":
        out = ImageEnhance.Contrast(img).enhance(1.3)
    elif edit == "gamma":
        out = img.point(lambda v: round(255 * (v / 255) ** 0.8))
    elif edit == "mirrored":
        out = ImageOps.mirror(img)
    else:
        raise ValueError(edit)
    return _encoded(out, "PNG"), "png"


def _large_copy(img: Image.Image, edit: str, rng: np.random.Generator) -> Image.Image:
    w, h = img.size
    if edit == "crop70":
        cw, ch = round(0.7 * w), round(0.7 * h)
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        return img.crop((x, y, x + cw, y + ch))
    if edit == "crop80":
        dx, dy = round(0.1 * w), round(0.1 * h)
        return img.crop((dx, dy, w - dx, h - dy))
    if edit == "half":
        return img.resize((w // 2, h // 2), Image.Resampling.LANCZOS)
    return img  # jpeg50: re-encoded below


def _smooth(rng: np.random.Generator, side: int) -> np.ndarray:
    """A smooth random picture (side x side x 3): noise of a few cells a side, enlarged."""
    cells = int(rng.integers(3, 8))
    noise = rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(noise).resize((side, side), Image.Resampling.BICUBIC))


def _small_photos(n: int, seed: int, split: str, fashion_too: bool = True) -> Any:
    """``n`` small photos (side SMALL, RGB arrays): Fashion-MNIST's ``split`` first (unless not ``fashion_too``),
    then smooth pictures."""
    from bench.dedup_copies import _distinct, _fashion_pool

    rng = np.random.default_rng(seed)
    pool = _fashion_pool(split)
    fashion = _distinct(pool[rng.permutation(len(pool))], min(n, 29000)) if fashion_too else pool[:0]
    for x in fashion:
        yield np.asarray(Image.fromarray(x).convert("RGB").resize((SMALL, SMALL), Image.Resampling.BICUBIC))
    for _ in range(n - len(fashion)):
        yield _smooth(rng, SMALL)


def _large_photos(count: int, split: str) -> list[Image.Image]:
    """``count`` gnome-backgrounds pictures, 1024 px on their long side: the first ones for ``report``, the last ones
    (taken from the end) for ``choose``. Plain colours and faint gradients (grey spread under :data:`FLAT_STD` at
    48 px) are left out: they have no content of their own, so a copy of one cannot be told from any other photo of
    that colour, and the pixel check leaves them alone by design."""
    from bench._datasets import BACKGROUNDS_DIR

    found = sorted(p for p in (BACKGROUNDS_DIR / "gnome").glob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png",
                                                                                             ".webp"))
    out = []
    for p in found if split == "report" else found[::-1]:
        if len(out) == count:
            break
        with Image.open(p) as im:
            img = im.convert("RGB")
        if np.asarray(img.convert("L").resize((48, 48), Image.Resampling.BILINEAR), np.float64).std() < FLAT_STD:
            continue
        img.thumbnail((LARGE, LARGE), Image.Resampling.LANCZOS)
        out.append(img)
    return out


CAMERAS = (("Canon", "EOS R6"), ("Apple", "iPhone 13"), ("FUJIFILM", "X-T4"))  # a household's, for --exif
KEEPS_EXIF = frozenset({"exact", "crop2px", "bright15", "contrast", "gamma", "mirrored", "crop70", "crop80"})  # editors
_EXIF_IFD, _DATE_TAKEN, _MAKE, _MODEL = 0x8769, 0x9003, 0x010F, 0x0110


def _camera_exif(rng: np.random.Generator, at: float) -> Image.Exif:
    """EXIF as a camera writes it: a date taken (``at``, seconds since the epoch) and one of :data:`CAMERAS`."""
    exif = Image.Exif()
    exif[_MAKE], exif[_MODEL] = CAMERAS[int(rng.integers(len(CAMERAS)))]
    exif.get_ifd(_EXIF_IFD)[_DATE_TAKEN] = time.strftime("%Y:%m:%d %H:%M:%S", time.gmtime(at))
    return exif


def write_collection(root: Path, n: int, share: float, large: int, seed: int, split: str = "report",
                     fashion_too: bool = True, exif: bool = False) -> dict[str, str]:
    """The photos under ``root/photos`` (folders of 1,000), the copies under ``root/copies``: copy -> photo paths.
    ``fashion_too``: False for smooth pictures alone (photos added to a collection that holds the Fashion ones).
    ``exif``: every photo as a camera wrote it (a date taken, each a few seconds to ten minutes after the last, and a
    camera); a copy keeps it where an editor made it (:data:`KEEPS_EXIF`) and not where a re-encode for the web did
    (jpeg50, webp, shrunk26, half)."""
    from moco.data.photos import enable_formats

    if not enable_formats():
        raise SystemExit("bench/dedup_scale.py plants HEIC copies: pip install 'pillow-heif>=1.0' (the heic extra)")
    rng = np.random.default_rng(seed + 1)
    clock = np.random.default_rng(seed + 2)  # the dates and cameras: the photos and copies stay those without --exif
    at = 1_600_000_000.0 + 86400.0 * seed
    (root / "copies").mkdir(parents=True)
    chosen = set(rng.choice(n, max(len(SMALL_EDITS), round(share * n)), replace=False).tolist())
    edits = itertools.cycle(SMALL_EDITS)
    copies = {}
    for i, x in enumerate(_small_photos(n, seed, split, fashion_too)):
        folder = root / "photos" / f"{i // 1000:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        src = folder / f"{i:07d}.png"
        img = Image.fromarray(x)
        tags = None
        if exif:
            at += float(clock.integers(2, 600))
            tags = _camera_exif(clock, at)
        src.write_bytes(_encoded(img, "PNG", **({"exif": tags} if tags else {})))
        if i in chosen:
            edit = next(edits)
            data, suffix = (src.read_bytes(), "png") if edit == "exact" else _small_copy(img, edit)
            if tags is not None and edit in KEEPS_EXIF and edit != "exact":
                data = _encoded(Image.open(io.BytesIO(data)), "PNG", exif=tags)
            dst = root / "copies" / f"{i:07d}_{edit}.{suffix}"
            dst.write_bytes(data)
            copies[dst.relative_to(root).as_posix()] = src.relative_to(root).as_posix()
    (root / "large").mkdir()
    for n_, img in enumerate(_large_photos(large, split)):
        src = root / "large" / f"L{n_:03d}.jpg"
        tags = None
        if exif:
            at += float(clock.integers(2, 600))
            tags = _camera_exif(clock, at)
        img.save(src, "JPEG", quality=92, **({"exif": tags} if tags else {}))
        for edit in LARGE_EDITS:
            heic = edit == "heic"
            dst = root / "copies" / f"L{n_:03d}_{edit}.{'heic' if heic else 'jpg'}"
            kept = {"exif": tags} if tags is not None and edit in KEEPS_EXIF else {}
            _large_copy(img, edit, rng).save(dst, "HEIF" if heic else "JPEG",
                                             quality=50 if edit in ("jpeg50", "heic") else 92, **kept)
            copies[dst.relative_to(root).as_posix()] = src.relative_to(root).as_posix()
    return copies


_SEARCH = """
import json, re, sys, time
t0 = time.perf_counter()
from index.duplicates.dedup import search_duplicates
from index.search.image_index import ImageIndex
found = search_duplicates(ImageIndex.open(sys.argv[1]), save=False, progress=sys.argv[3:] == ["progress"])
seconds = time.perf_counter() - t0
peak = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read())[1]) * 1024
groups = [g.to_json() if hasattr(g, "to_json") else g for g in found.groups]  # a checkout before typed groups: dicts
import index.duplicates.dedup as dedup
json.dump({"seconds": seconds, "peak_bytes": peak, "decision": found.decision,
           "stages": getattr(dedup, "STAGE_SECONDS", {}), "memory": getattr(dedup, "STAGE_MEMORY", {}),
           "groups": [{"members": [{"path": m["path"]} for m in g["members"]], "reason": g["reason"],
                       "keep": g["keep"]} for g in groups]}, open(sys.argv[2], "w"))
"""


def _score(groups: list[dict[str, Any]], copies: dict[str, str]) -> dict[str, Any]:
    """Recall per edit (small and large apart), pair precision, the largest group of distinct photos, and in the
    groups holding a planted copy's photo, the share whose suggested keeper is that photo (not an edited copy)."""
    source = lambda p: copies.get(p, p)  # noqa: E731 - a photo and its copy: one source
    group_of = {m["path"]: n for n, g in enumerate(groups) for m in g["members"]}
    recall: dict[str, list[bool]] = {}
    for copy, photo in copies.items():
        edit = ("large " if Path(copy).stem.startswith("L") else "") + Path(copy).stem.split("_", 1)[1]
        recall.setdefault(edit, []).append(copy in group_of and group_of.get(photo) == group_of[copy])
    originals = set(copies.values())
    kept = [g["keep"] in originals for g in groups if "keep" in g and any(m["path"] in originals for m in g["members"])]
    pairs = real = largest = 0
    for g in groups:
        paths = [m["path"] for m in g["members"]]
        for a, b in itertools.combinations(paths, 2):
            pairs += 1
            real += source(a) == source(b)
        largest = max(largest, len({source(p) for p in paths}))
    return {"recall": {e: round(float(np.mean(v)), 4) for e, v in recall.items()},
            "copies": {e: len(v) for e, v in recall.items()},
            "pair_precision": round(real / pairs, 4) if pairs else 1.0, "pairs": pairs,
            "largest_distinct": largest, "groups": len(groups),
            "keeper_is_the_original": round(float(np.mean(kept)), 4) if kept else None}


def run_size(n: int, args: argparse.Namespace, backbone: Path) -> dict[str, Any]:
    from index.building.runner import build_index

    root, idx = args.work / str(n), args.work / f"{n}.idx"
    settings = json.dumps({"photos": n, "copies": args.copies, "large": args.large, "seed": args.seed,
                           "split": args.split, "exif": args.exif, "smooth": args.smooth,
                           "edits": [SMALL_EDITS, LARGE_EDITS]})
    done = root / "done"
    if not done.exists() or done.read_text() != settings or not (idx / "index.faiss").exists():
        if done.exists():
            print(f"{n}: the collection in {root} was written with other settings or edits: written anew", flush=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(idx, ignore_errors=True)
        t0 = time.perf_counter()
        copies = write_collection(root, n, args.copies, args.large, args.seed, args.split, exif=args.exif,
                                  fashion_too=not args.smooth)
        print(f"{n}: collection written in {time.perf_counter() - t0:.0f} s", flush=True)
        t0 = time.perf_counter()
        build_index(root, backbone, idx, progress=False, device="cpu")
        print(f"{n}: index built in {time.perf_counter() - t0:.0f} s", flush=True)
        (root / "copies.json").write_text(json.dumps(copies))
        done.write_text(settings)
    copies = json.loads((root / "copies.json").read_text())
    index_bytes = sum(p.stat().st_size for p in idx.iterdir() if p.is_file() and p.name not in CACHE_FILES)
    out = {"photos": n + args.large, "copies_planted": len(copies), "index_gb": round(index_bytes / 1e9, 3),
           **_search(ROOT, idx, args.work / f"{n}.search.json", copies, index_bytes, progress=args.progress)}
    if args.add:
        out["added"] = _added(n, args, idx, root, copies, index_bytes)
    if args.peer:  # the same search by another checkout's code, on the same index, in the same run
        out["peer"] = _search(args.peer, idx, args.work / f"{n}.peer.json", copies, index_bytes)
    return out


def _added(n: int, args: argparse.Namespace, idx: Path, root: Path, copies: dict[str, str],
           index_bytes: int) -> dict[str, Any]:
    """The search again after ``--add`` of the photos were added (new photos, a share of them with a copy, under
    ``root/added``) and the index updated (a copy of it, with what the full search kept): its time against the
    full search's."""
    from index.building.runner import update_index

    extra = max(1, round(args.add * n))
    added = args.work / f"{n}.added"
    settings = (root / "done").read_text() + f" + {extra}, {OLD_EDITS}, {OLD_LARGE_EDITS}"  # the collection's, and
    if not (added / "done").exists() or (added / "done").read_text() != settings:        # as many new photos
        shutil.rmtree(added, ignore_errors=True)
        more = write_collection(added, extra, args.copies, 0, args.seed + 7, args.split, fashion_too=False,
                                exif=args.exif)
        more = {f"added/{c}": f"added/{p}" for c, p in more.items()}
        more |= _copies_of_old(root, added, n, max(len(OLD_EDITS), round(args.copies * extra)), args.seed + 11)
        shutil.rmtree(root / "added", ignore_errors=True)
        (added / "copies.json").write_text(json.dumps(more))
        (added / "done").write_text(settings)
    if not (root / "added").is_dir():  # into the collection (again, where it was written anew since)
        (root / "added").mkdir()
        for folder in ("photos", "copies", "old"):
            shutil.copytree(added / folder, root / "added" / folder)
    grown = args.work / f"{n}.idx-added"
    shutil.rmtree(grown, ignore_errors=True)
    shutil.copytree(idx, grown)
    update_index(grown, progress=False, device="cpu")
    every = copies | json.loads((added / "copies.json").read_text())
    got = _search(ROOT, grown, args.work / f"{n}.added.json", every, index_bytes, cold=False)
    got["photos_added"] = extra + sum(1 for c in json.loads((added / "copies.json").read_text()))
    return got


def _copies_of_old(root: Path, added: Path, n: int, count: int, seed: int) -> dict[str, str]:
    """Copies of photos already in the collection, made since and added with the new ones (under ``added/old``: the
    update's search of the photos from before among the new is what finds them): ``count`` small ones, each edit of
    :data:`OLD_EDITS` in turn, and each large photo's :data:`OLD_LARGE_EDITS`. Copy -> photo paths (from ``root``);
    an edit's name begins with ``old-``."""
    rng = np.random.default_rng(seed)
    (added / "old").mkdir(parents=True)
    out = {}
    for k, i in enumerate(sorted(rng.choice(n, min(n, count), replace=False).tolist())):
        src = f"photos/{i // 1000:04d}/{i:07d}.png"
        edit = OLD_EDITS[k % len(OLD_EDITS)]
        data, suffix = _small_copy(Image.open(root / src).convert("RGB"), edit)
        (added / "old" / f"{i:07d}_old-{edit}.{suffix}").write_bytes(data)
        out[f"added/old/{i:07d}_old-{edit}.{suffix}"] = src
    for src in sorted((root / "large").glob("L*.jpg")) if (root / "large").is_dir() else []:
        with Image.open(src) as im:
            img = im.convert("RGB")
        for edit in OLD_LARGE_EDITS:
            _large_copy(img, edit, rng).save(added / "old" / f"{src.stem}_old-{edit}.jpg", "JPEG", quality=92)
            out[f"added/old/{src.stem}_old-{edit}.jpg"] = src.relative_to(root).as_posix()
    return out


def _search(code: Path, idx: Path, out: Path, copies: dict[str, str], index_bytes: int, cold: bool = True,
            progress: bool = False) -> dict[str, Any]:
    """`moco index dedup`'s search of ``idx`` by the code of checkout ``code``, in a process of its own: its
    wall time, peak memory and scores. ``cold``: what an earlier search kept in the index folder is deleted first.
    ``progress``: each stage's bar (its rate and time left) on stderr."""
    if cold:
        for name in CACHE_FILES:
            (idx / name).unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(code))
    subprocess.run([sys.executable, "-c", _SEARCH, str(idx), str(out)] + ["progress"] * progress, env=env,
                   check=True, cwd=code)
    got = json.loads(out.read_text())
    d = got["decision"]
    return {"seconds": round(got["seconds"], 1), "peak_gb": round(got["peak_bytes"] / 1e9, 3),
            "beyond_index_gb": round((got["peak_bytes"] - index_bytes) / 1e9, 3), "proposed": d["proposed"],
            "verified": d["verified"], "checked": d.get("checked", d["proposed"]), "reused": d.get("reused", 0),
            "looked_up": d.get("looked_up"), "crop_families": d.get("crop_families", 0),
            "stages": got.get("stages", {}),
            "memory_gb": {k: [round(b / 1e9, 3) for b in v] for k, v in got.get("memory", {}).items()},
            "threshold": d["threshold"], **_score(got["groups"], copies)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000", help="small photos per collection, comma separated")
    p.add_argument("--copies", type=float, default=0.02, help="share of the small photos given a copy (0.02)")
    p.add_argument("--large", type=int, default=6, help="large photos, each with its 4 copies (6: of the 12 "
                   "wallpapers that are not plain colours, the first 6 report and the last 6 choose)")
    p.add_argument("--work", type=Path, required=True, help="where the collections and indexes go (kept: a rerun "
                   "measures the search again)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", choices=("choose", "report"), default="report", help="which photos: rules are chosen on "
                   "choose (other Fashion-MNIST images, the last wallpapers) and reported on report, the default")
    p.add_argument("--peer", type=Path, default=None, help="another checkout (a git worktree of an earlier commit): "
                   "its search measured on the same indexes, side by side")
    p.add_argument("--add", type=float, default=0.0, help="then add this share of new photos (0.01: 1%%, with "
                   "copies), update the index and search again, keeping what the full search kept: its time")
    p.add_argument("--exif", action="store_true", help="photos as cameras write them: each with a date taken and a "
                   "camera, kept by the copies an editor made and dropped by re-encodes for the web (use another "
                   "--work: the collections differ)")
    p.add_argument("--smooth", action="store_true", help="smooth pictures alone, no Fashion-MNIST (busy photos: no "
                   "flat background; use another --work: the collections differ)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--progress", action="store_true", help="show each stage of the search as it goes (its rate and "
                   "time left) on stderr: for a long run")
    args = p.parse_args(argv)

    from bench._backbone import bench_backbone
    from bench._machine import cpu_model

    backbone, described = bench_backbone(args.work, None, None, SMALL)
    report: dict[str, Any] = {"backbone": described, "cpu": cpu_model(), "threads": os.environ["OMP_NUM_THREADS"],
                              "aim": AIM, "exif": args.exif, "command": shlex.join(["python", "bench/dedup_scale.py",
                                                                 *(argv or sys.argv[1:])]), "sizes": []}
    if args.peer:  # which code the peer is
        report["peer_commit"] = subprocess.run(["git", "-C", str(args.peer), "rev-parse", "--short", "HEAD"],
                                               capture_output=True, text=True).stdout.strip() or None
    for n in [int(s) for s in args.sizes.split(",") if s.strip()]:
        report["sizes"].append(run_size(n, args, backbone))
        r = report["sizes"][-1]
        for who, x in (("this", r), ("peer", r.get("peer"))):
            if x is None:
                continue
            print(f"{r['photos']} photos, {who}: {x['seconds']} s, peak {x['peak_gb']} GB ({x['beyond_index_gb']} "
                  f"beyond the index), precision {x['pair_precision']}, largest {x['largest_distinct']}, "
                  f"proposed {x['proposed']} ({x.get('crop_families', 0)} of them crop families), verified "
                  f"{x['verified']}, keeper the original "
                  f"{x['keeper_is_the_original']}", flush=True)
            print("  recall: " + ", ".join(f"{e} {v} ({r['copies'][e]})" for e, v in x["recall"].items()), flush=True)
            if x.get("stages"):
                print("  stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in x["stages"].items()), flush=True)
            if x.get("memory_gb"):
                print("  memory at each stage's end (resident, peak so far): " + ", ".join(
                    f"{k} {rss} / {peak} GB" for k, (rss, peak) in x["memory_gb"].items()), flush=True)
        if r.get("added"):
            a = r["added"]
            print(f"  after adding {a['photos_added']} photos: {a['seconds']} s ({a['seconds'] / r['seconds']:.3f} of "
                  f"the full search), {a['checked']} pairs checked, {a['reused']} kept; recall: "
                  + ", ".join(f"{e} {v}" for e, v in a["recall"].items()), flush=True)
            if a.get("stages"):
                print("  stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in a["stages"].items()), flush=True)
        if r.get("peer"):
            print(f"  this / peer: time {r['seconds'] / max(r['peer']['seconds'], 1e-9):.2f}x, peak memory "
                  f"{r['peak_gb'] / max(r['peer']['peak_gb'], 1e-9):.2f}x", flush=True)
    print(f"{report['cpu']}; {report['threads']} threads; {described}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
