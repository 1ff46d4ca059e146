"""The library as a user meets it (issue 31): every public name is the documented object whatever was imported
before, type checkers see the public API, the wheel says it is typed, the dependency floors are the versions whose
APIs we call, the cache follows the user's conventions, a run's config.json takes a new folder of photos, and
MoCo v3's ViT tweaks apply where the official code applies them."""

from __future__ import annotations

import ast
import importlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from app.cli.commands import main
from moco.data.sample import make_sample_collection
from tests.conftest import TINY_CLI

ROOT = Path(__file__).resolve().parents[1]

# The documented object of each public name (README's library section): module and attribute.
DOCUMENTED = {
    "moco": {
        "MoCo": "moco.model.builder:MoCo", "TrainConfig": "moco.config:TrainConfig", "PRESETS": "moco.config:PRESETS",
        "resolve_config": "moco.config:resolve_config", "train": "moco.training.loop:train",
        "resume_config": "moco.training.checkpoints:resume_config",
        "export_backbone": "moco.export.exporter:export_backbone",
        "Embedder": "moco.embed:Embedder", "apply_space": "moco.whiten:apply_space",
        "UserError": "moco.errors:UserError",
        "fetch_pretrained": "moco.weights.pretrained:fetch", "PRETRAINED": "moco.weights.pretrained:REGISTRY",
    },
    "index": {
        "ImageIndex": "index.search.image_index:ImageIndex", "SearchResult": "index.search.image_index:SearchResult",
        "build_index": "index.building.runner:build_index", "update_index": "index.building.runner:update_index",
        "find_duplicates": "index.duplicates.dedup:find_duplicates", "VectorStore": "index.search.store:VectorStore",
    },
}


def _documented(package: str, name: str) -> object:
    module, attribute = DOCUMENTED[package][name].split(":")
    return getattr(importlib.import_module(module), attribute)


# --------------------------------------------------------------------------------------- public names
# In an interpreter where none of our packages is imported yet: import the name's own module first (as
# `python -m moco.training`, a test or an app does), or the name first and its module after; then `from PACKAGE import
# NAME` must still be the documented object. One interpreter imports the third-party libraries (torch, faiss: most
# of a start-up's time) and each case runs in a fork of it, so every case starts without moco, index or app.
_PROBE = """
import importlib, json, os, sys
cases, order = json.loads(sys.argv[1]), sys.argv[2]
import faiss, numpy, PIL.Image, safetensors, timm, torch, torchvision  # third-party only
assert not [m for m in sys.modules if m.split(".")[0] in ("moco", "index", "app")], "ours imported before a fork"
failed = {}
for package, name, module, attribute in cases:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the case, in a fork where none of our modules is imported
        os.close(read)
        try:
            if order == "module first":
                importlib.import_module(module)
                got = getattr(importlib.import_module(package), name)
                exec(f"from {package} import {name} as again")
            else:
                exec(f"from {package} import {name} as got")
                importlib.import_module(module)
                exec(f"from {package} import {name} as again")
            want = getattr(sys.modules[module], attribute)
            assert got is want and again is want, (got, again, want)
            os._exit(0)
        except BaseException as e:
            os.write(write, repr(e).encode()[-600:])
            os._exit(1)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        err = f.read().decode()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed[f"{package}.{name}"] = err or f"exit status {status}"
print(json.dumps(failed))
"""


@pytest.mark.slow  # one interpreter with torch and faiss, forked per name
@pytest.mark.parametrize("order", ["module first", "name first"])
def test_every_public_name_is_the_documented_object_whatever_was_imported_before(order):
    cases = [(package, name, *where.split(":")) for package, names in DOCUMENTED.items()
             for name, where in names.items()]
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases), order], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, failed


def test_moco_train_is_the_function_you_call():
    import moco.training.loop  # noqa: F401 - the submodule first: it must not take the function's name
    from moco import train
    from moco.config import resolve_config

    assert callable(train) and train.__name__ == "train" and train.__module__ == "moco.training.loop"
    with pytest.raises(Exception) as e:  # called as documented: it gets as far as the config's photos
        train(resolve_config("v2", data_dir=str(ROOT / "no-such-photos"), out="/nonexistent/run"))
    assert not isinstance(e.value, TypeError), e.value


# ------------------------------------------------------------------------------------ typing, wheel
def _type_checking_imports(package: str) -> dict[str, str]:
    """``{name: "module:attribute"}`` imported under ``if TYPE_CHECKING:`` in ``package/__init__.py``."""
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    blocks = [n for n in tree.body if isinstance(n, ast.If) and isinstance(n.test, ast.Name)
              and n.test.id == "TYPE_CHECKING"]
    assert len(blocks) == 1, f"{package}/__init__.py: one `if TYPE_CHECKING:` block of imports"
    found = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.level == 0, ast.dump(node)
        for alias in node.names:
            found[alias.asname or alias.name] = f"{node.module}:{alias.name}"
    return found


@pytest.mark.parametrize("package", ["moco", "index"])
def test_type_checkers_see_every_public_name_as_what_it_is(package):
    seen = _type_checking_imports(package)
    exported = importlib.import_module(package).__all__
    assert sorted(seen) == sorted(exported)  # every name of __all__, nothing else
    assert seen == DOCUMENTED[package]  # ... from the module it really comes from
    assert (ROOT / package / "py.typed").is_file()


def test_the_wheel_is_typed(tmp_path):
    """A real wheel build (setuptools, no network) holds py.typed beside each library package."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("moco", "index", "app"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    code = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=src, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = zipfile.ZipFile(tmp_path / "dist" / proc.stdout.split()[-1]).namelist()
    assert "moco/py.typed" in names and "index/py.typed" in names


# -------------------------------------------------------------------------------- dependency floors
# The oldest version of each dependency with the APIs we call (the call, where).
FLOORS = {
    "torch": ("2.5", "torch.onnx.export(..., dynamo=True, dynamic_shapes=...) in moco/export_writers.py"),
    "torchvision": ("0.20", "the torchvision built for torch 2.5"),
    "timm": ("1.0.16", 'timm.create_model("local-dir:DIR") in moco/export_writers.py (--format timm)'),
}


def _floor(requirement: str) -> tuple[str, str] | None:
    import re

    m = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9.]*)", requirement)
    return (m.group(1).lower(), m.group(2)) if m else None


def test_dependency_floors_have_the_apis_we_call():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = dict(f for f in map(_floor, project["dependencies"]) if f)
    for name, (need, why) in FLOORS.items():
        assert Version(floors[name]) >= Version(need), f"{name}>={floors[name]}: {why} needs {name}>={need}"
    writers = (ROOT / "moco" / "export" / "writers.py").read_text()
    assert "dynamo=True" in writers  # the reason of the torch floor still holds


# ----------------------------------------------------------------------------------------- the cache
CACHES = [
    ({"MOCO_HOME": "{tmp}/mine", "XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/mine"),  # MOCO_HOME first
    ({"XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/xdg/moco-retrieval"),  # then the XDG cache
    ({"MOCO_HOME": "", "XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/xdg/moco-retrieval"),  # empty: unset
    ({}, "{tmp}/home/.cache/moco-retrieval"),  # then ~/.cache
    ({"XDG_CACHE_HOME": "relative/xdg"}, "{tmp}/home/.cache/moco-retrieval"),  # the spec: relative is ignored
]


def test_the_cache_follows_moco_home_then_xdg_then_home(monkeypatch, tmp_path, capsys):
    from moco.weights.pretrained import REGISTRY, cache_path, moco_home

    for env, home in CACHES:
        with monkeypatch.context() as m:
            m.setenv("HOME", str(tmp_path / "home"))
            for name in ("MOCO_HOME", "XDG_CACHE_HOME"):
                m.delenv(name, raising=False)
            for name, value in env.items():
                m.setenv(name, value.format(tmp=tmp_path))
            want = Path(home.format(tmp=tmp_path))
            assert moco_home() == want, env
            assert cache_path(next(iter(REGISTRY.values()))).parent == want / "checkpoints"
            assert main(["pretrained"]) == 0  # what `moco pretrained` says
            assert f"Cache: {want / 'checkpoints'}" in capsys.readouterr().out, env


# ----------------------------------------------------------------------------- config.json + PHOTOS
def test_photos_override_the_data_dir_of_a_config_file(sample_photos, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "1"]) == 0
    other = tmp_path / "other photos"
    make_sample_collection(other, per_family=4, size=32, seed=5)
    again = tmp_path / "again"
    code = main(["train", str(other), "--config", str(run / "config.json"), "--out", str(again), "--quiet"])
    assert code == 0, capsys.readouterr().err
    first, second = (json.loads((r / "config.json").read_text()) for r in (run, again))
    assert second["data_dir"] == str(other)  # the folder given on the command line, as any flag wins
    assert {**second, "data_dir": first["data_dir"], "out": first["out"]} == first  # the rest from the file
    assert "24 images" in capsys.readouterr().out  # and trained on it


# ------------------------------------------------------------------------------ MoCo v3's ViT tweaks
VIT = dict(arch="vit_tiny_patch16_224", image_size=32, mlp_hidden=32, dim=16, batch_size=8, workers=0)


def _sincos(net) -> torch.Tensor:
    from moco.model.backbones import sincos_2d

    grid = net.patch_embed.grid_size
    return sincos_2d(grid[0], grid[1], net.embed_dim)


def _v3_tweaked(net) -> bool:
    """Fixed sin-cos positions and a frozen patch projection (vits.py), or timm's learnable ones."""
    fixed = not net.pos_embed.requires_grad and torch.equal(net.pos_embed[0, 1:], _sincos(net))
    frozen = not any(p.requires_grad for p in net.patch_embed.proj.parameters())
    assert fixed == frozen, (fixed, frozen)  # both or neither
    return fixed


@pytest.fixture(scope="module")
def vit_init(tmp_path_factory) -> Path:
    """A timm ViT's weights (as a pretrained one would be), for --init."""
    import timm

    path = tmp_path_factory.mktemp("vit") / "vit.pth"
    torch.manual_seed(0)
    torch.save(timm.create_model(VIT["arch"], pretrained=False, img_size=32, num_classes=0).state_dict(), path)
    return path


TWEAKS = [
    ("v3", {}, True),  # MoCo v3 from scratch: the official recipe
    ("v3", {"init": "INIT"}, False),  # from pretrained weights: they keep learning
    ("v2", {}, False),  # another preset: timm's ViT
    ("cpu", {}, False),
    ("v2", {"vit_v3_tweaks": "on"}, True),  # asked for
    ("v3", {"vit_v3_tweaks": "off"}, False),
]


def test_v3_vit_tweaks_only_where_the_official_code_applies_them(vit_init):
    from moco.config import resolve_config
    from moco.training.optim import build_optimizer
    from moco.training.setup import build_model
    from moco.weights.layouts import load_init

    for preset, extra, tweaked in TWEAKS:
        extra = {k: str(vit_init) if v == "INIT" else v for k, v in extra.items()}
        queue = {} if preset == "v3" else {"queue_size": 16}
        cfg = resolve_config(preset, **VIT, **queue, **extra)
        model = build_model(cfg)
        if cfg.init:
            load_init(model, cfg.init)  # as train() does
            assert torch.equal(model.backbone.pos_embed, torch.load(vit_init)["pos_embed"])  # the weights' own
        net = model.backbone
        assert _v3_tweaked(net) == tweaked, (preset, extra)
        trained = {id(p) for group in build_optimizer(model, cfg).param_groups for p in group["params"]}
        assert (id(net.pos_embed) in trained) == (not tweaked), (preset, extra)  # learnable: in the optimizer


def test_runs_saved_before_the_flag_resume_with_the_tweaks_they_were_built_with():
    from moco.config import from_plain, resolve_config, to_plain

    old = to_plain(resolve_config("v2", **VIT, queue_size=16))
    del old["vit_v3_tweaks"]  # a config.json / checkpoint written before the field existed
    assert from_plain(old).vit_v3_tweaks == "on"


def test_vit_v3_tweaks_on_a_resnet_is_refused():
    from moco.config import resolve_config
    from moco.errors import UserError

    with pytest.raises(UserError, match="--vit-v3-tweaks on applies to ViT backbones"):
        resolve_config("v2", arch="resnet18", vit_v3_tweaks="on")


SCRIPT = """from moco import resolve_config, train

cfg = resolve_config("v2", data_dir={data!r}, out={out!r}, arch="resnet18", small_stem=True, image_size=16,
                     batch_size=8, bn_splits=2, queue_size=16, max_steps=2, workers=2, precision="fp32")
{call}
"""


@pytest.mark.slow
@pytest.mark.parametrize("guarded", [False, True])
def test_the_readme_training_snippet_saved_as_a_script(sample_photos, tmp_path, guarded):
    """Issue 39: the README's training snippet, saved as a script without `if __name__ == "__main__":`, ended in
    BrokenProcessPool after 100 lines of tracebacks: each decoding worker (spawned) imports the script again and
    tried to train. Unguarded, it now fails with one error that names the pitfall and the fix; guarded, it trains."""
    out = tmp_path / "run"
    call = ('if __name__ == "__main__":\n    print(train(cfg, progress=False).steps, "steps")' if guarded
            else 'print(train(cfg, progress=False).steps, "steps")')
    script = tmp_path / "train_mine.py"
    script.write_text(SCRIPT.format(data=str(sample_photos), out=str(out), call=call))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    if guarded:
        assert proc.returncode == 0 and "2 steps" in proc.stdout, proc.stderr[-3000:]
        return
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "BrokenProcessPool" not in proc.stderr and proc.stderr.count("Traceback") == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("moco.errors.UserError: ") and str(script) in last, last
    assert 'if __name__ == "__main__":' in last and "workers=0" in last
    assert "steps" not in proc.stdout and not out.exists()  # nothing trained (parent or worker), nothing left


# ---------------------------------------------------------------------------------------------- devices
@pytest.mark.parametrize(("cuda", "mps", "want"), [(True, True, "cuda:0"), (False, True, "mps"), (False, False, "cpu"),
                                                   (True, False, "cuda:0")])
def test_device_auto_picks_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, want):
    from moco.runtime import resolve_device, resolve_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    device = resolve_device("auto")
    assert str(device) == want
    if want == "mps":
        assert resolve_precision("auto", device) == "fp32" and resolve_precision("bf16", device) == "bf16"


def test_a_device_that_is_not_there_is_refused_by_name(monkeypatch):
    from moco.errors import UserError
    from moco.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    for name, words in [("cuda", "no CUDA GPU"), ("cuda:1", "no CUDA GPU"), ("mps", "no Apple GPU"),
                        ("tpu", "not a device")]:
        with pytest.raises(UserError, match=words) as e:
            resolve_device(name)
        assert name in str(e.value)
