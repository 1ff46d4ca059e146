"""Runs that explain themselves: RUN/config.json, `moco train --config FILE`, `--tensorboard`, and the options of
`Embedder.embed`."""

from __future__ import annotations

import contextlib
import json
import re
import sys

import numpy as np
import pytest
import torch

from app.cli.commands import main
from moco.config import resolve_config
from moco.extras import install_hint
from moco.training.metrics import read_metrics
from moco.weights.layouts import load_checkpoint
from tests.conftest import TINY_CLI

# The tiny settings of tests/conftest.py as a config file (TINY_CLI as keys), to combine with flags.
TINY_FILE = {"arch": "resnet18", "small_stem": True, "image_size": 16, "batch_size": 8, "bn_splits": 2,
             "queue_size": 16, "workers": 0}


def _train(*args: str) -> int:
    return main(["train", *args, "--quiet"])


# ------------------------------------------------------------------------------------------ config.json
def test_run_writes_its_resolved_config(sample_photos, tmp_path):
    run = tmp_path / "run"
    assert _train(str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "2", "--preset", "v1") == 0
    written = json.loads((run / "config.json").read_text())
    assert written == load_checkpoint(run / "checkpoint.pt")["config"]  # the resolved config, plain types
    assert written["preset"] == "v1" and written["temperature"] == 0.07 and written["max_steps"] == 2
    assert written["data_dir"] == str(sample_photos) and written["out"] == str(run)

    # a run's config.json is a valid --config: the new run reproduces it (only --out differs)
    again = tmp_path / "again"
    assert _train("--config", str(run / "config.json"), "--out", str(again)) == 0
    assert {**json.loads((again / "config.json").read_text()), "out": str(run)} == written


@pytest.mark.parametrize(("flags", "preset"), [
    (["--time-budget", "5"], "cpu"),  # a time budget on a CPU: the short-run recipe
    ([], "v2"),  # no budget: the paper's
    (["--time-budget", "5", "--preset", "v2"], "v2"),  # a named preset always wins
])
def test_a_cpu_time_budget_run_defaults_to_the_cpu_preset(sample_photos, tmp_path, flags, preset):
    from moco.config import PRESETS

    run = tmp_path / "run"
    assert _train(str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "2", *flags) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["preset"] == preset and cfg["arch"] == "resnet18"  # the flags still win over the preset
    assert cfg["lr"] == PRESETS[preset]["lr"] and cfg["queue_size"] == 16


@pytest.mark.parametrize(("sides", "crop"), [
    ([], 112), ([3000, 2000], 112), ([160], 112),  # the preset's crop for photos of 160 px and more
    ([28] * 5, 32), ([32], 32), ([50], 48), ([64], 64), ([159], 64),  # small photos: their size, 32..64
    ([20, 30, 500], 32),  # the median decides
])
def test_cpu_image_size_follows_small_photos(sides, crop):
    from moco.config import cpu_image_size

    assert cpu_image_size(sides) == crop


def test_a_cpu_preset_run_without_image_size_trains_at_the_photos_size(sample_photos, tmp_path, capsys):
    at = TINY_CLI.index("--image-size")
    tiny = TINY_CLI[:at] + TINY_CLI[at + 2 :]  # no --image-size: the preset chooses
    run = tmp_path / "run"
    assert _train(str(sample_photos), "--out", str(run), *tiny, "--max-steps", "1", "--time-budget", "5") == 0
    assert json.loads((run / "config.json").read_text())["image_size"] == 48  # the 48-px photos, not 112
    assert "small photos: the cpu preset trains at 48 px" in capsys.readouterr().err


def test_cpu_preset_leaves_the_paper_presets_as_published():
    from moco.config import PRESETS

    cpu = resolve_config("cpu")
    assert (cpu.arch, cpu.batch_size, cpu.image_size, cpu.decorrelation) == (PRESETS["cpu"]["arch"], 128, 112, 0.1)
    assert all(resolve_config(p).decorrelation == 0.0 for p in ("v1", "v2", "v3"))  # the papers have no such term
    assert cpu.whiten and not any(resolve_config(p).whiten for p in ("v1", "v2", "v3"))  # nor a fitted whitening
    assert cpu.whiten_stages == "auto" and all(resolve_config(p).whiten_stages == "off" for p in ("v1", "v2", "v3"))
    v2 = resolve_config("v2")
    assert (v2.arch, v2.batch_size, v2.lr, v2.queue_size, v2.temperature, v2.momentum, v2.image_size) == (
        "resnet50", 256, 0.03, 65536, 0.2, 0.999, 224)
    assert v2.min_image_size == 0 and resolve_config("v3").min_image_size == 0


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_file_then_flags(sample_photos, tmp_path, suffix):
    values = {**TINY_FILE, "preset": "v1", "temperature": 0.5, "mean": [0.5, 0.5, 0.5], "max_steps": 2}
    path = tmp_path / f"my{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(values))
    else:
        import yaml

        path.write_text(yaml.safe_dump(values))
    run = tmp_path / "run"
    assert _train(str(sample_photos), "--out", str(run), "--config", str(path), "--temperature", "0.3") == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["temperature"] == 0.3  # the flag wins over the file
    assert cfg["preset"] == "v1" and cfg["lr_schedule"] == "step"  # the file's preset, with its own defaults
    assert cfg["arch"] == "resnet18" and cfg["small_stem"] is True and cfg["mean"] == [0.5, 0.5, 0.5]  # the file's
    assert load_checkpoint(run / "checkpoint.pt")["step"] == 2


def test_preset_flag_overrides_the_files_preset(sample_photos, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**TINY_FILE, "preset": "v1", "max_steps": 1}))
    run = tmp_path / "run"
    assert _train(str(sample_photos), "--out", str(run), "--config", str(path), "--preset", "v2") == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["preset"] == "v2" and cfg["temperature"] == 0.2 and cfg["arch"] == "resnet18"


@pytest.mark.parametrize(
    "content, needles",
    [
        ({"arch": "resnet18", "batchsize": 8}, ["batchsize", "batch_size"]),  # unknown key: named, fix suggested
        ({"batch_size": "eight"}, ["batch_size", "'eight'", "int"]),  # wrong type
        ({"small_stem": "yes"}, ["small_stem", "true or false"]),
        ({"mean": [0.5, 0.5]}, ["mean", "three numbers"]),
        ({"preset": "v9"}, ["v9", "v1, v2, v3"]),
        (["arch", "resnet18"], ["mapping"]),
        # What the flags refuse, a file refuses too, at once and naming the file (not late, not as a flag).
        ({"std": [0, 0, 0]}, ["std", "positive"]),
        ({"mean": [0.5, float("nan"), 0.5]}, ["mean", "finite"]),
        ({"lr": -1}, ["lr", "positive learning rate"]),
        ({"crop_min": 1.5}, ["crop_min", "area fraction"]),
        ({"optimizer": "adam"}, ["optimizer", "sgd, lars, adamw"]),
        ({"temperature": float("inf")}, ["temperature", "finite"]),
    ],
)
def test_bad_config_file_exits_2_naming_the_key(sample_photos, tmp_path, capsys, content, needles):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    run = tmp_path / "run"
    assert _train(str(sample_photos), "--out", str(run), "--config", str(path)) == 2
    err = capsys.readouterr().err
    assert str(path) in err
    for needle in needles:
        assert needle in err
    assert not run.exists()  # nothing was started


def test_unreadable_config_files_exit_2(sample_photos, tmp_path, capsys, monkeypatch):
    run = str(tmp_path / "run")
    assert _train(str(sample_photos), "--out", run, "--config", str(tmp_path / "missing.json")) == 2
    assert "missing.json" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text('{"arch": "resnet18",\n "lr": }')
    assert _train(str(sample_photos), "--out", run, "--config", str(broken)) == 2
    err = capsys.readouterr().err
    assert "broken.json" in err and "line 2" in err
    other = tmp_path / "c.toml"
    other.write_text("arch = 'resnet18'")
    assert _train(str(sample_photos), "--out", run, "--config", str(other)) == 2
    assert ".json" in capsys.readouterr().err
    yml = tmp_path / "c.yml"
    yml.write_text("arch: resnet18\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed
    assert _train(str(sample_photos), "--out", run, "--config", str(yml)) == 2
    err = capsys.readouterr().err
    assert "pip install pyyaml" in err and "JSON" in err


def _alias_bomb(levels: int) -> str:
    """"Billion laughs": each level an anchored list of nine aliases of the level below (9**levels strings)."""
    parts = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    parts += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return f"arch: [{', '.join(parts)}]\n"


@pytest.mark.parametrize("levels", [5, 9])  # 9: the 434-byte file that took 2.7 GB and 28 s before a MemoryError
def test_yaml_alias_bomb_is_refused_naming_the_file(tmp_path, levels):
    from moco.config import load_config_file
    from moco.errors import UserError

    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(levels))
    with pytest.raises(UserError, match="aliases") as e:
        load_config_file(path)
    assert str(path) in str(e.value) and len(str(e.value)) < 400


def test_yaml_recursive_alias_and_a_long_value_are_short_messages(tmp_path):
    from moco.config import load_config_file
    from moco.errors import UserError

    path = tmp_path / "loop.yaml"
    path.write_text("arch: &a [x, *a]\n")
    with pytest.raises(UserError, match="refers to itself") as e:
        load_config_file(path)
    assert str(path) in str(e.value)
    path.write_text(f"arch: [{', '.join(['x'] * 5000)}]\n")  # no alias: a plain long value, shown shortened
    with pytest.raises(UserError, match="arch") as e:
        load_config_file(path)
    assert len(str(e.value)) < 400


def test_yaml_reads_every_float_a_person_writes(tmp_path):
    from moco.config import load_config_file

    path = tmp_path / "floats.yaml"  # YAML 1.1 reads 3e-2 and 1.0e5 (exponent without a dot or sign) as strings
    path.write_text("lr: 3e-2\nweight_decay: 1e-4\nmomentum: 9.99E-1\ntemperature: 2.0e-1\ntime_budget: 1e1\n"
                    "crop_min: .8e-1\nepochs: 100\n")
    assert load_config_file(path) == {"lr": 0.03, "weight_decay": 1e-4, "momentum": 0.999, "temperature": 0.2,
                                      "time_budget": 10.0, "crop_min": 0.08, "epochs": 100}
    path.write_text("epochs: 1e2\n")  # an int field still wants an int
    from moco.errors import UserError

    with pytest.raises(UserError, match="epochs = 100.0 is not an int"):
        load_config_file(path)


@pytest.mark.parametrize("flag, value", [("--temperature", "inf"), ("--lr", "nan"), ("--time-budget", "inf")])
def test_flags_and_files_share_one_validation(sample_photos, tmp_path, capsys, flag, value):
    run = tmp_path / "run"
    assert _train(str(sample_photos), "--out", str(run), *TINY_CLI, flag, value) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value} is not a finite number" in err and not run.exists()


# ------------------------------------------------------------------------------------------ tensorboard
def test_tensorboard_scalars_equal_metrics(sample_photos, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert _train(str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "3", "--tensorboard") == 0
    records = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    for key in ("loss", "lr", "m"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2, 3]
        assert [e.value for e in events] == pytest.approx([r[key] for r in records], rel=1e-6)


def test_tensorboard_missing_exits_2_naming_the_extra(sample_photos, tmp_path, capsys, monkeypatch):
    for name in ("tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # as if tensorboard were not installed
    run = tmp_path / "run"
    assert _train(str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "1", "--tensorboard") == 2
    assert install_hint("tensorboard") in capsys.readouterr().err
    assert not (run / "checkpoint.pt").exists()


# ------------------------------------------------------------------------------------------ Embedder.embed
@pytest.fixture(scope="module")
def embedder(backbone):
    from moco import Embedder

    return Embedder.load(backbone, device="cpu", precision="fp32")


def _images(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (40 + i, 50, 3), dtype=np.uint8) for i in range(n)]


def test_embed_normalize_false_returns_the_raw_features(embedder):
    images = _images(3)
    raw = embedder.embed(images, normalize=False)
    unit = embedder.embed(images)
    assert raw.dtype == np.float32 and raw.shape == unit.shape
    norms = np.linalg.norm(raw, axis=1)
    assert not np.allclose(norms, 1.0, atol=1e-2)  # really unnormalized (pooled ReLU features)
    np.testing.assert_allclose(raw / norms[:, None], unit, rtol=1e-5, atol=1e-6)


def test_embed_output_torch(embedder):
    images = _images(3)
    out = embedder.embed(images, output="torch")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.device.type == "cpu"
    np.testing.assert_array_equal(out.numpy(), embedder.embed(images))
    assert isinstance(embedder.embed(images, output="numpy"), np.ndarray)


def test_embed_bad_output_names_the_choices(embedder):
    from moco.errors import UserError

    with pytest.raises(UserError, match="'list'.*numpy.*torch"):
        embedder.embed(_images(1), output="list")


def test_embed_progress_bar_on_stderr(embedder, capsys):
    embedder.embed(_images(5), batch_size=2)
    assert capsys.readouterr().err == ""  # no bar by default
    embedder.embed(_images(5), batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert "embedding" in err and "5/5" in err


# ------------------------------------------------------------------------------------------ bounds and memory
@pytest.mark.parametrize("content, needles", [
    ("queue_size: 1000000000000\n", ["queue_size = 1000000000000 is out of range", "16777216"]),  # the allocator
    ("image_size: 1000000\n", ["image_size = 1000000 is out of range", "4096 pixels"]),  # killed for memory
    ("mean: [1e300, 0, 0]\n", ["mean = 1e+300,0.0,0.0 is out of range", "from 0 to 1"]),  # trained into NaN
    ("std: [1e-300, 1, 1]\n", ["std = 1e-300,1.0,1.0 is out of range", "from 0.001 to 1"]),  # a bare ValueError
    ("? [a, b]\n: 1\n", ["a key at line 1 column 3 is a list or a mapping", "field names"]),  # YAML's traceback
    ("{[1]: 2}\n", ["a key at line 1 column 2 is a list or a mapping", "field names"]),
])
def test_config_values_no_machine_can_hold_are_refused_at_once(sample_photos, tmp_path, capsys, content, needles):
    path = tmp_path / "c.yaml"
    path.write_text(content)
    run = tmp_path / "run"
    assert _train(str(sample_photos), "--out", str(run), "--config", str(path)) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "error:" in x)
    assert str(path) in line and all(n in line for n in needles), err
    assert "^" not in err and "Traceback" not in err and "<unicode string>" not in err  # no fragment of YAML's own
    assert not run.exists()  # refused before anything started


@pytest.mark.parametrize("flag, value, needle", [
    ("--queue-size", str(10**12), "16777216"),
    ("--image-size", str(10**6), "4096 pixels"),
    ("--std", "1e-300,1,1", "from 0.001 to 1"),
    ("--seed", "-1", "from 0 to 4294967295"),
    ("--knn-k", "0", "1 to 1000000"),
    ("--sgd-momentum", "1", "0.999"),
    ("--workers", "-2", "-1 (one per CPU core)"),
])
def test_flags_no_machine_can_hold_are_refused_at_once(sample_photos, tmp_path, capsys, flag, value, needle):
    run = tmp_path / "run"
    with contextlib.suppress(SystemExit):  # --mean/--std are parsed by argparse, which exits 2 itself
        assert _train(str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "1", flag, value) == 2
    err = capsys.readouterr().err
    assert flag in err and value in err and needle in err, err
    assert not run.exists()


def test_every_numeric_field_declares_its_bounds_and_files_and_flags_keep_them(tmp_path):
    from dataclasses import fields

    from moco.config import PRESETS, Bounds, TrainConfig, field_problem, flag_name, load_config_file
    from moco.errors import UserError

    numeric = [f for f in fields(TrainConfig) if f.type in ("int", "float") or str(f.type).startswith("tuple[float")]
    assert len(numeric) > 25
    for f in numeric:
        bounds = f.metadata.get("bounds")
        assert isinstance(bounds, Bounds), f"{f.name} declares no bounds"
        assert all(field_problem(f.name, p.get(f.name, f.default)) is None for p in PRESETS.values()), f.name
        big = int(bounds.hi) * 2 + 1 if f.type == "int" else bounds.hi * 2 + 1.0
        value = (big, 0.5, 0.5) if str(f.type).startswith("tuple") else big
        with pytest.raises(UserError, match=f"--{flag_name(f.name)} ") as e:  # a flag, or resolve_config's caller
            resolve_config("v2", **{f.name: value})
        assert "out of range" in str(e.value) and bounds.fix in str(e.value)
        path = tmp_path / "c.json"
        path.write_text(json.dumps({f.name: list(value) if isinstance(value, tuple) else value}))
        with pytest.raises(UserError, match=f"{path}: {f.name} = ") as e:  # a --config file: the same rule
            load_config_file(path)
        assert bounds.fix in str(e.value)


def test_a_run_no_machine_can_hold_is_refused_before_it_allocates(sample_photos, tmp_path, capsys):
    run = tmp_path / "run"
    flags = ["--arch", "resnet18", "--small-stem", "--workers", "0", "--bn-splits", "2", "--cache-size", "16"]
    assert _train(str(sample_photos), "--out", str(run), *flags, "--image-size", "4096", "--batch-size", "4096",
                  "--queue-size", "4096", "--max-steps", "1") == 2
    err = capsys.readouterr().err
    assert "--batch-size 4096, --image-size 4096: the run needs at least" in err and "TiB of memory" in err, err
    assert "or less" in err and "decoding photos" not in err
    assert not run.exists()  # refused before the run folder, the cache or the model


def test_the_memory_estimate_says_the_part_the_flag_and_a_value_that_fits():
    from dataclasses import replace

    from moco.errors import UserError
    from moco.training.memory import check_memory, estimate_memory, machine_memory

    eight = {"host": (8 * 2**30, "a test machine's memory")}
    for cfg in (resolve_config("cpu"), resolve_config("v2"), resolve_config("v3")):  # the presets fit in 8 GiB
        check_memory(cfg, memory=eight)
    big = resolve_config("v2", image_size=1024)  # 256 x 2 views of 1024 px, with activations
    with pytest.raises(UserError) as e:
        check_memory(big, memory=eight)
    msg = str(e.value)
    assert msg.startswith("--batch-size 256, --image-size 1024: the run needs at least") and "(8.0 GiB)" in msg
    for flag in ("batch_size", "image_size"):  # each fix named fits
        value = int(re.search(rf"--{flag.replace('_', '-')} (\d+) or less", msg)[1])
        check_memory(replace(big, **{flag: value}), memory=eight)
        with pytest.raises(UserError):
            check_memory(replace(big, **{flag: value * 2}), memory=eight)
    queue = resolve_config("v2", queue_size=2**24, dim=4096, symmetric=True)  # one queue per view
    part = next(p for p in estimate_memory(queue) if p.what.startswith("the queue"))
    assert part.nbytes == 2 * 2**24 * (4096 * 4 + 8) and part.fields == ("queue_size", "dim")
    with pytest.raises(UserError, match=r"^--queue-size 16777216, --dim 4096: .* for the queue of 16777216 keys"):
        check_memory(queue, memory=eight)
    # on a GPU its memory holds the batch, the machine's the photos being decoded
    check_memory(big, "cuda", memory={"device": (141 * 2**30, "the GPU's memory"), **eight})
    with pytest.raises(UserError, match="more than the GPU's memory"):
        check_memory(big, "cuda", memory={"device": (16 * 2**30, "the GPU's memory"), **eight})
    total, name = machine_memory()
    assert total > 2**28 and "memory" in name
