"""One collection, one backbone, every door: the vector (or score) each gives for the same photos, and the largest
difference from the reference (the Embedder in the index's space, fp32).

    python bench/doors.py INDEX_DIR --checkpoint RUN/checkpoint.pt [--json bench/results/doors.json]

Doors: ``Embedder.load(B, space=INDEX_DIR)`` (the reference), the index's search (its embedder's features mapped by
its space, as the library and ``moco index search`` do), ``moco index search --json`` scores, the page's search
handler scores, and the pt2 program, ONNX program and timm folder exported with ``--space INDEX_DIR``.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from bench._machine import cpu_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("index_dir", type=Path)
    p.add_argument("--checkpoint", type=Path, required=True, help="the checkpoint the index's backbone came from")
    p.add_argument("--photos", type=int, default=16, help="photos of the collection to compare (default 16)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    import numpy as np
    import onnxruntime as ort
    import timm
    import torch

    from app.cli.commands import main as cli
    from app.page.handlers import SearchApp
    from index.search.image_index import ImageIndex
    from moco.data.augment import center_view
    from moco.data.photos import load_square_u8
    from moco.embed import Embedder
    from moco.export.exporter import export_backbone
    from moco.whiten import apply_space

    idx = ImageIndex.open(args.index_dir)
    ref = Embedder.load(idx.meta["backbone_path"], device="cpu", precision="fp32", space=args.index_dir)
    rows = sorted(idx.catalog.rows().values(), key=lambda r: r.path)[: args.photos]
    files = [idx.root / r.path for r in rows]
    squares = torch.from_numpy(np.stack([load_square_u8(f, ref.resize) for f in files]))  # N x R x R x 3
    views = center_view(squares, ref.image_size, ref.pixel_mean, ref.pixel_std)  # N x 3 x s x s
    want = ref.embed_views(views)  # N x D
    doors: dict[str, float] = {}
    emb = idx.load_embedder(device="cpu")
    doors["index search (bf16 autocast features, index space)"] = float(
        np.abs(idx.to_space(emb.embed_views(views)) - want).max())
    fp32 = Embedder.load(idx.meta["backbone_path"], device="cpu", precision="fp32", space="features")
    doors["index search (fp32 features, index space)"] = float(
        np.abs(idx.to_space(fp32.embed_views(views)) - want).max())
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        export_backbone(args.checkpoint, t / "b.pt2", fmt="pt2", space=args.index_dir)
        prog = torch.export.load(str(t / "b.pt2")).module()
        doors["pt2 program (--space)"] = float(np.abs(prog(views).detach().numpy() - want).max())
        export_backbone(args.checkpoint, t / "b.onnx", fmt="onnx", space=args.index_dir)
        sess = ort.InferenceSession(str(t / "b.onnx"), providers=["CPUExecutionProvider"])
        doors["ONNX program (--space)"] = float(np.abs(sess.run(None, {"images": views.numpy()})[0] - want).max())
        try:
            export_backbone(args.checkpoint, t / "timm", fmt="timm", space=args.index_dir)
            model = timm.create_model(f"local-dir:{t / 'timm'}", pretrained=True)
            doors["timm folder + moco.apply_space"] = float(np.abs(apply_space(model, views, t / "timm").numpy()
                                                                   - want).max())
        except Exception as e:  # noqa: BLE001 - a backbone timm has no model for (the small stem): say so
            print(f"timm: {e}")
    # scores: the CLI's --json and the page's handler for the first photo, against the reference cosines
    q = want[0]
    out = io.StringIO()
    with redirect_stdout(out):
        cli(["index", "search", str(args.index_dir), str(files[0]), "-k", "10", "--json"])
    hits = json.loads(out.getvalue())
    ref_scores = [float(q @ ref.embed([idx.root / h["path"]])[0]) for h in hits]
    doors["moco index search --json (scores)"] = float(np.abs(np.array([h["score"] for h in hits]) - ref_scores).max())
    _, _, state = SearchApp(idx, emb).search(str(files[0]), k=10)
    page = {p: s for p, s in zip(state.paths, state.scores)}
    doors["page search handler (scores)"] = float(max(abs(page[h["path"]] - r) for h, r in zip(hits, ref_scores)
                                                      if h["path"] in page))
    print(f"{idx.describe_space()}; {len(files)} photos; reference: Embedder.load(B, space=INDEX) in fp32")
    print(f"{'door':<55} {'largest |difference|':>20}")
    for name, diff in doors.items():
        print(f"{name:<55} {diff:>20.2e}")
    print(f"largest over every door: {max(doors.values()):.2e}   (CPU: {cpu_model()})")
    if args.json:
        args.json.write_text(json.dumps({"index": str(args.index_dir), "photos": len(files), "doors": doors,
                                         "space": idx.meta.get("space"), "cpu": cpu_model()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
