"""One embedding space, the same through every door (issue 28): the Embedder, the index's search (library, CLI
``--json``, page handler), the pt2 and ONNX programs and the timm folder give the vectors of the index's own space,
fitted on the photos it searches; every format declares what it outputs; other spaces are refused. The run pools
every feature there is: layer1-3 and the photos' edge layout (moco.edges) beside the backbone's output."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moco.config import resolve_config
from moco.embed import Embedder
from moco.errors import UserError
from moco.export.exporter import export_backbone
from moco.training.loop import train
from moco.whiten import SPACE_FILE, apply_space, fit_space, load_space

SETUP = dict(image_size=32, batch_size=8, bn_splits=2, queue_size=16, workers=0, max_steps=3, precision="fp32",
             keep_checkpoints=1, save_every_minutes=1000.0)
DIM = 512 + 64 + 128 + 256 + 512  # resnet10t's output, its pooled layer1-3 and the edge layout


@pytest.fixture(scope="module")
def built(tmp_path_factory, sample_photos):
    """A cpu-preset run (stages forced on; edges on, as the preset's auto has them for 48 photos from scratch),
    its export and an index of its photos."""
    from index.building.runner import build_index

    tmp = tmp_path_factory.mktemp("doors")
    cfg = resolve_config("cpu", data_dir=str(sample_photos), out=str(tmp / "run"), whiten_stages="on",
                         whiten_edges="on", **SETUP)
    train(cfg, progress=False)
    export_backbone(tmp / "run" / "checkpoint.pt", tmp / "b.safetensors")
    build_index(sample_photos, tmp / "b.safetensors", tmp / "idx", progress=False, device="cpu")
    return tmp


def _photos(root):
    return sorted(p for p in root.rglob("*") if p.suffix in (".jpg", ".png"))


def test_the_index_fits_its_own_space_on_its_photos_and_declares_it(built):
    from index.search.image_index import ImageIndex

    idx = ImageIndex.open(built / "idx")
    ids, feats = idx.catalog.vectors(dim=idx.dim)  # N, N x D: the catalog keeps features
    export = Embedder.load(built / "b.safetensors", device="cpu", precision="fp32").space  # the training-time one
    want = fit_space(feats, "centred", export)  # 48 photos: too few to whiten on their own (the rule): centred
    np.testing.assert_allclose(idx.mean, feats.mean(0), atol=1e-6)
    np.testing.assert_allclose(idx.to_space(feats), want(feats), atol=1e-5)
    d = DIM - 512  # the network's part is centred only: its matrix scales it, and the edges, and mixes nothing
    m = idx.space.matrix
    assert not idx.whitened and np.allclose(m[:d, :d], m[0, 0] * np.eye(d)) and not m[:d, d:].any()
    assert np.allclose(m[d:, d:], m[d, d] * np.eye(512)) and not m[d:, :d].any()
    meta = idx.meta
    assert meta["dim"] == DIM and meta["backbone"]["backbone_dim"] == 512 and "embed_dim" not in meta["backbone"]
    assert meta["space"]["width"] == DIM and meta["space"]["rule"] == "centred" and not meta["space"]["whitened"]
    assert meta["features"] == {"mirror": True, "stages": [["layer1", 64], ["layer2", 128], ["layer3", 256],
                                                           ["edges", 512]]}
    space, smeta = load_space(built / "idx" / SPACE_FILE)  # the copy for the other doors
    assert space.digest == idx.space.digest and smeta["backbone_sha256"] == meta["backbone_sha256"]
    assert idx.stats()["space"]["fitted_on"].startswith("this collection (48 photos)")
    said = idx.stats()["space_description"]  # what the page's status says of its scores
    assert "and the photos' edge layout, centred on this collection (48 photos); the edges 80% of each score" in said
    from app.page.handlers import SearchApp
    from app.page.views import READY_HINT, ready_hint

    app = SearchApp(idx, idx.load_embedder(device="cpu"))
    status = app.collection()[0]  # and of its model, plainly: on the Collection tab and the Search tab's hint
    assert "**Model:** trained from scratch on few photos, too weak to trust alone: 80% of each score is the " \
           "photos' edge layout" in status
    assert ready_hint(app).startswith(READY_HINT) and "too weak to trust alone: 80% of each score" in ready_hint(app)


def test_a_dark_version_of_a_photo_finds_it_first(built, sample_photos, tmp_path):
    """Issue 55: the light/dark twin of a photo comes first where the network trained on a few photos does not put
    it there by itself."""
    from PIL import Image

    from index.search.image_index import ImageIndex

    idx = ImageIndex.open(built / "idx")
    files = _photos(sample_photos)
    emb = idx.load_embedder(device="cpu")
    network = Embedder.load(built / "b.safetensors", device="cpu", precision="fp32", whiten=False)
    found = by_network = 0
    for n in range(0, len(files), 6):
        dark = tmp_path / f"dark{n}.png"
        Image.fromarray(255 - np.asarray(Image.open(files[n]).convert("RGB"))).save(dark)
        hits = idx.search_image(dark, emb, k=1)
        found += hits.paths[0][0] == str(files[n].relative_to(sample_photos))
        plain = network.embed([dark, *files])  # (1 + N) x 512: the network's output alone
        by_network += int(np.argmax(plain[1:] @ plain[0])) == n
    assert found >= 7 and by_network <= 1, (found, by_network)  # of 8 (the sample's families hold look-alikes)


def test_every_door_gives_the_same_vector(built, sample_photos, capsys):
    from app.cli.commands import main
    from app.page.handlers import SearchApp
    from index.search.image_index import ImageIndex

    idx = ImageIndex.open(built / "idx")
    ref = Embedder.load(built / "b.safetensors", device="cpu", precision="fp32", space=built / "idx")
    assert ref.space.digest == idx.space.digest and ref.dim == DIM
    files = _photos(sample_photos)
    vecs = ref.embed(files)  # N x D: the reference, in fp32
    query = files[5]
    # the index's own door: its embedder's features, mapped by its space
    emb = idx.load_embedder(device="cpu")
    via_index = idx.to_space(emb.embed([query]))  # 1 x D (bf16 autocast on the CPU)
    assert float(via_index[0] @ vecs[5]) > 0.99
    # CLI search --json (the photo itself kept): the scores of the hits are the reference cosines
    assert main(["index", "search", str(built / "idx"), str(query), "-k", "6", "--json", "--include-queries"]) == 0
    kept = json.loads(capsys.readouterr().out)
    by_path = {str(f.relative_to(sample_photos)): n for n, f in enumerate(files)}
    ref_scores = [float(vecs[5] @ vecs[by_path[h["path"]]]) for h in kept]
    np.testing.assert_allclose([h["score"] for h in kept], ref_scores, atol=2e-2)
    assert kept[0]["path"] == str(query.relative_to(sample_photos))
    # by default the CLI leaves the photo itself out: the same ranking, less it
    assert main(["index", "search", str(built / "idx"), str(query), "-k", "5", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert [h["path"] for h in hits] == [h["path"] for h in kept[1:]]
    # the page's handler, which leaves it out too: same ranking and scores
    app = SearchApp(idx, emb)
    _, _, state = app.search(str(query), k=5)
    assert state.paths == [h["path"] for h in hits]
    np.testing.assert_allclose(state.scores, [h["score"] for h in hits], atol=1e-3)
    # the programs and the timm folder, exported in the index's space
    x = torch.randn(3, 3, 32, 32)
    want = ref.embed_views(x)  # 3 x D
    export_backbone(built / "run" / "checkpoint.pt", built / "i.pt2", fmt="pt2", space=built / "idx")
    program = torch.export.load(str(built / "i.pt2")).module()
    np.testing.assert_allclose(program(x).detach().numpy(), want, atol=1e-4)
    import onnxruntime as ort

    meta = export_backbone(built / "run" / "checkpoint.pt", built / "i.onnx", fmt="onnx", space=built / "idx")
    session = ort.InferenceSession(str(built / "i.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"images": x.numpy()})[0], want, atol=1e-4)
    props = {p.key: p.value for p in __import__("onnx").load(str(built / "i.onnx")).metadata_props}
    assert props["embed_dim"] == str(DIM) == str(json.loads(props["output"])["width"]) and meta.backbone_dim == 512
    assert json.loads(props["output"])["digest"] == idx.space.digest
    import timm

    export_backbone(built / "run" / "checkpoint.pt", built / "timm", fmt="timm", space=built / "idx")
    model = timm.create_model(f"local-dir:{built / 'timm'}", pretrained=True)
    np.testing.assert_allclose(apply_space(model, x, built / "timm").numpy(), want, atol=1e-4)


def test_each_format_declares_its_output(built):
    import zipfile

    from moco.export.reader import load_exported

    export = Embedder.load(built / "b.safetensors", device="cpu", precision="fp32")
    x = torch.randn(2, 3, 32, 32)
    _, meta = load_exported(built / "b.safetensors")
    out = meta.output
    assert (out["width"], out["whitened"], out["normalized"], out["mirror"]) == (DIM, True, True, True)
    assert out["fitted_on"] == "training photos" and out["digest"] == export.space.digest
    export_backbone(built / "run" / "checkpoint.pt", built / "t.pt2", fmt="pt2")  # the training-time space
    with zipfile.ZipFile(built / "t.pt2") as z:
        name = next(n for n in z.namelist() if n.endswith("moco_meta.json"))
        pmeta = json.loads(z.read(name))
    assert pmeta["embed_dim"] == str(DIM) and json.loads(pmeta["output"]) == out
    program = torch.export.load(str(built / "t.pt2")).module()
    np.testing.assert_allclose(program(x).detach().numpy(), export.embed_views(x), atol=1e-4)
    export_backbone(built / "run" / "checkpoint.pt", built / "t_timm", fmt="timm")
    tspace, _ = load_space(built / "t_timm" / SPACE_FILE)  # the timm folder carries the space beside the model
    assert tspace.digest == export.space.digest
    tmeta = load_exported(built / "t_timm" / "model.safetensors")[1]
    assert tmeta.output["apply"].startswith("moco.apply_space")


def test_an_index_refuses_an_embedder_of_another_space(built):
    from index.search.image_index import ImageIndex

    idx = ImageIndex.open(built / "idx")
    plain = Embedder.load(built / "b.safetensors", device="cpu", whiten=False)  # one view, no stages
    with pytest.raises(UserError, match=r"searches in its own space \(mirror-averaged backbone features with the "
                                        r"pooled layer1/layer2/layer3.*this embedder gives features"):
        idx.check_embedder(plain)
    trained_space = Embedder.load(built / "b.safetensors", device="cpu")  # vectors already in the training space
    with pytest.raises(UserError, match="already whitened on training photos.*do not mix"):
        idx.check_embedder(trained_space)
    with pytest.raises(UserError, match="--space bakes"):
        export_backbone(built / "run" / "checkpoint.pt", built / "x.safetensors", space=built / "idx")
    other = built / "other"
    other.mkdir()
    import shutil

    shutil.copy(built / "idx" / SPACE_FILE, other / SPACE_FILE)
    data = load_space(other / SPACE_FILE)
    from moco.whiten import save_space

    save_space(data[0], other / SPACE_FILE, "0" * 64, source_sha256="1" * 64)  # the space of another model
    with pytest.raises(UserError, match="another model"):
        export_backbone(built / "run" / "checkpoint.pt", built / "x.pt2", fmt="pt2", space=other)
    with pytest.raises(UserError, match="space of backbone sha256 000000000000"):
        Embedder.load(built / "b.safetensors", device="cpu", space=other)
