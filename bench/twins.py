"""Light and dark twins in a small folder trained from scratch (issue 55): is each photo's twin its first neighbour?

    python bench/twins.py /usr/share/backgrounds/gnome --json bench/results/twins_gnome.json      # the report set
    python bench/twins.py FOLDER --work W                                                        # any other

Twins are files named ``NAME-l.*`` and ``NAME-d.*`` (as GNOME's desktop backgrounds are: one design, light and
dark). The script runs ``moco run FOLDER --pretrained none --no-serve`` (the cpu preset from scratch, no network:
what ``make run PHOTOS=FOLDER`` does offline) and ranks each photo's twin among the other photos, side by side from
that one run:

- ``index``: the index's own search (``ImageIndex.search_image``): today's vectors, the network's features beside
  the photos' edge layout (``moco.edges``) when the run took it;
- ``network``: the network's features alone, centred on the collection (the preset before the edges: what the
  index searched);
- ``edges``: the edge layout alone, centred on the collection (the floor: no learning at all).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._machine import cpu_model  # noqa: E402


def twin_of(name: str) -> str | None:
    """``NAME-d`` for ``NAME-l`` and the other way round; None for a photo without a twin's name."""
    if name.endswith("-l"):
        return name[:-1] + "d"
    if name.endswith("-d"):
        return name[:-1] + "l"
    return None


def ranks(names: list[str], vectors: np.ndarray) -> list[int]:
    """Each twin's rank (1: first) among the other photos by cosine of ``vectors`` (N x D, unit rows)."""
    sims = vectors @ vectors.T  # N x N
    np.fill_diagonal(sims, -np.inf)
    out = []
    for i, name in enumerate(names):
        twin = twin_of(name)
        if twin in names:
            out.append(int((sims[i] > sims[i, names.index(twin)]).sum()) + 1)
    return out


def centred(v: np.ndarray) -> np.ndarray:
    """Rows L2-normalized, centred on their mean, normalized again (N x D)."""
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    c = v - v.mean(0, keepdims=True)
    return c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="photos, the twins named NAME-l.* and NAME-d.*")
    parser.add_argument("--work", type=Path, help="where moco run keeps its run (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    from index.search.image_index import ImageIndex
    from moco.edges import DIM, EDGES

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "app.cli", "run", str(args.folder), "--pretrained", "none",
                              "--no-serve", "--work", str(work)], capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"moco run failed:\n{run.stderr[-3000:]}")
        seconds = time.monotonic() - started
        idx = ImageIndex.open(next(work.glob("*/index")))
        ids, feats = idx.catalog.vectors(dim=idx.dim)  # N, N x D: the features the index keeps
        rows = idx.catalog.rows_by_id(ids)
        names = [Path(rows[i].path).stem for i in ids.tolist()]
        emb = idx.load_embedder(device="cpu")
        found = {}
        for i, name in enumerate(names):
            hits = idx.search_image(idx.root / rows[int(ids[i])].path, emb, k=len(names))
            found[name] = [Path(p).stem for p in hits.paths[0] if Path(p).stem != name]
        by = {"index": [found[n].index(twin_of(n)) + 1 for n in names if twin_of(n) in names]}
        edges = EDGES in (name for name, _ in idx.space.stages)
        net = feats[:, :-DIM] if edges else feats
        by["network"] = ranks(names, centred(net))
        if edges:
            by["edges"] = ranks(names, centred(feats[:, -DIM:]))
    result = {"folder": str(args.folder), "photos": len(names), "twins": len(by["index"]), "edges_taken": edges,
              "run_seconds": round(seconds, 1), "cpu": cpu_model(),
              "first": {k: sum(r == 1 for r in v) for k, v in by.items()},
              "median_rank": {k: float(np.median(v)) for k, v in by.items()}, "ranks": by}
    print(f"{args.folder}: {len(names)} photos, {len(by['index'])} with a twin; moco run {seconds:.0f} s on "
          f"{result['cpu']}")
    for k, v in by.items():
        print(f"  {k:8s} twin first for {sum(r == 1 for r in v):2d} of {len(v)}, median rank {np.median(v):.1f}, "
              f"ranks {v}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
