"""Near-duplicate groups before and after (issue 28, 4): single linkage at the fixed thresholds (what `moco index
dedup` did) against groups around a representative at the index's calibrated threshold, on a labelled set.

    python bench/dedup_groups.py RUN_DIR PHOTOS_DIR --work /tmp/dedup_bench [--json bench/results/dedup_X.json]

RUN_DIR: a training run (its checkpoint.pt); PHOTOS_DIR: a folder of photos in one sub-folder per class (labels are
used only to score the groups: a group is *pure* when every member has its representative's class). The index is
built with the current code (its space and calibration); "before" links every pair at or above the old fixed
threshold of the backbone's kind (0.95 centred, 0.8 whitened, 0.7 with the pooled stages) and takes connected
components, as `index/duplicates/dedup.py` did.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _components(n: int, pairs: list[tuple[int, int]]) -> list[list[int]]:
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        parent[find(a)] = find(b)
    groups: dict[int, list[int]] = {}
    for x in range(n):
        groups.setdefault(find(x), []).append(x)
    return [g for g in groups.values() if len(g) > 1]


def _summary(groups: list[list[int]], labels: list[str], reps: list[int] | None = None) -> dict[str, float]:
    sizes = sorted((len(g) for g in groups), reverse=True)
    pure = 0
    for k, g in enumerate(groups):
        ref = labels[reps[k]] if reps else labels[g[0]]
        pure += all(labels[m] == ref for m in g)
    return {"groups": len(groups), "grouped_photos": sum(sizes), "largest": sizes[0] if sizes else 0,
            "top5_sizes": sizes[:5], "pure_groups_pct": round(100 * pure / len(groups), 1) if groups else 100.0,
            "mixed_classes_in_largest": len({labels[m] for m in max(groups, key=len)}) if groups else 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a run directory (its checkpoint.pt)")
    p.add_argument("photos", type=Path, help="photos in one sub-folder per class")
    p.add_argument("--work", type=Path, required=True, help="where the export and the index are written")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    import numpy as np

    from bench._machine import cpu_model
    from index.building.runner import build_index
    from index.calibrate import DEDUP_THRESHOLD, STAGED_DEDUP_THRESHOLD, WHITENED_DEDUP_THRESHOLD
    from index.duplicates.dedup import find_duplicates
    from index.search.image_index import ImageIndex
    from moco.export.exporter import export_backbone

    args.work.mkdir(parents=True, exist_ok=True)
    backbone = args.work / "backbone.safetensors"
    if not backbone.is_file():
        export_backbone(args.run / "checkpoint.pt", backbone)
    build_index(args.photos, backbone, args.work / "idx", progress=False)
    idx = ImageIndex.open(args.work / "idx")
    ids, feats = idx.catalog.vectors(dim=idx.dim)  # N, N x D
    rows = idx.catalog.rows_by_id(ids)
    labels = [rows[int(i)].path.split("/")[0] for i in ids]
    vecs = idx.to_space(feats)  # N x D
    pos = {int(i): n for n, i in enumerate(ids)}
    old_t = (STAGED_DEDUP_THRESHOLD if idx.pooled_stages else WHITENED_DEDUP_THRESHOLD) if idx.whitened \
        else DEDUP_THRESHOLD
    report = {"index": str(args.work / "idx"), "photos": len(ids), "space": idx.describe_space(), "cpu": cpu_model()}
    for name, t in (("old_threshold", old_t), ("calibrated_threshold", idx.dedup_threshold)):
        pairs = []
        for s in range(0, len(vecs), 2048):
            sim = vecs[s : s + 2048] @ vecs.T  # B x N
            a, b = np.nonzero(sim >= t)
            pairs += [(int(x) + s, int(y)) for x, y in zip(a, b) if x + s < y]
        before = _summary(_components(len(ids), pairs), labels)
        groups = find_duplicates(idx, t, save=False)
        after = _summary([[pos[m.id] for m in g.members] for g in groups], labels,
                         [pos[g.representative.id] for g in groups])
        report[name] = {"threshold": round(float(t), 4), "single_linkage": before, "representative": after}
    report["calibration"] = idx.meta.get("dedup_calibration")
    print(f"{report['photos']} photos; {report['space']}; CPU {report['cpu']}")
    head = ("threshold", "grouping", "groups", "grouped", "largest", "pure %", "classes in largest")
    print(f"{head[0]:<28} {head[1]:<16} {head[2]:>7} {head[3]:>8} {head[4]:>8} {head[5]:>7} {head[6]:>19}")
    for name in ("old_threshold", "calibrated_threshold"):
        r = report[name]
        for how in ("single_linkage", "representative"):
            s = r[how]
            print(f"{name + ' ' + str(r['threshold']):<28} {how:<16} {s['groups']:>7} {s['grouped_photos']:>8} "
                  f"{s['largest']:>8} {s['pure_groups_pct']:>7} {s['mixed_classes_in_largest']:>19}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
