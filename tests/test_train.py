"""The training loop end to end: presets, artifacts, exact resume, interruption, bad inputs."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from app.cli.commands import main
from moco.config import resolve_config
from moco.training.loop import train
from tests.conftest import TINY, TINY_CLI

V3_TINY = dict(TINY, queue_size=0, bn_splits=1, mlp_hidden=32, dim=16, warmup_epochs=1)


def _cfg(data, out, preset="v2", **kw):
    base = V3_TINY if preset == "v3" else TINY
    return resolve_config(preset, data_dir=str(data), out=str(out), **{**base, **kw})


@pytest.mark.parametrize("preset", ["v1", "v2", "v3"])
def test_presets_train_and_write_artifacts(sample_photos, tmp_path, preset):
    summary = train(_cfg(sample_photos, tmp_path / "run", preset, max_steps=3), progress=False)
    assert summary.steps == 3 and summary.images == 48
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert set(r) >= {"step", "epoch", "loss", "lr", "m", "img_s"}
        assert all(isinstance(v, (int, float)) and v == v and abs(v) != float("inf") for v in r.values())
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 3 and ckpt["config"]["preset"] == preset and len(ckpt["files"]) == 48
    assert (run / "curves.png").stat().st_size > 1000
    assert (run / "skipped.txt").read_text() == ""
    if preset == "v3":
        assert records[0]["m"] < records[-1]["m"] < 1.0  # cosine momentum schedule rises
    else:
        assert ckpt["model"]["queue_ptr"].item() == 3 * 8 % 32


def test_decorrelation_is_trained_and_logged_per_step(sample_photos, tmp_path):
    run = tmp_path / "run"
    summary = train(_cfg(sample_photos, run, max_steps=3, decorrelation=0.1), progress=False)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary.steps == 3 and all(r["decorrelation"] > 0 for r in records)  # a redundancy, logged each step
    assert json.loads((run / "config.json").read_text())["decorrelation"] == 0.1
    plain = tmp_path / "plain"
    train(_cfg(sample_photos, plain, max_steps=1), progress=False)
    assert "decorrelation" not in (plain / "metrics.jsonl").read_text()


def test_decorrelation_decay_scales_the_weight_with_the_learning_rate(sample_photos, tmp_path):
    run = tmp_path / "run"
    cfg = _cfg(sample_photos, run, max_steps=4, decorrelation=0.1, decorrelation_decay=True)
    train(cfg, progress=False)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    weights = [r["decorrelation_weight"] for r in records]  # no warm-up in TINY: the cosine starts at step 0
    assert weights == pytest.approx([0.1 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(4)], abs=1e-6)
    peak = cfg.lr * cfg.batch_size / 256
    assert [r["lr"] / peak for r in records] == pytest.approx([w / 0.1 for w in weights], abs=1e-3)  # lr's shape
    constant = tmp_path / "constant"
    train(_cfg(sample_photos, constant, max_steps=2, decorrelation=0.1), progress=False)
    assert {json.loads(line)["decorrelation_weight"] for line in (constant / "metrics.jsonl").open()} == {0.1}


def test_channels_last_trains_like_contiguous(sample_photos, tmp_path):
    """The default CNN layout (channels_last, split BN included) follows the contiguous run in fp32."""
    losses = {}
    for fmt in ("channels_last", "contiguous"):
        run = tmp_path / fmt
        train(_cfg(sample_photos, run, max_steps=3, precision="fp32", memory_format=fmt), progress=False)
        losses[fmt] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[fmt + " model"] = _state(run)["model"]
    assert losses["channels_last"] == pytest.approx(losses["contiguous"], rel=1e-4)
    a, b = losses["channels_last model"], losses["contiguous model"]
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3, msg=k)


def _state(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=True)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][name]), torch.as_tensor(sb[k][name])), (k, name)
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])


@pytest.mark.parametrize("preset,precision", [("v2", "fp32"), ("v2", "bf16"), ("v2", "fp16"), ("v3", "fp32")])
def test_resume_is_bit_exact(sample_photos, tmp_path, preset, precision):
    """fp16 is the older-GPU path (autocast + GradScaler); it runs on the CPU too, so its resume is checked here.

    fp16 on a CPU: torch's fp16 convolution backward has no fast CPU kernel (15 s a step for the tiny
    ResNet here), so that case trains timm's ``test_vit`` (a ViT of 0.3 M parameters, made for tests), whose frozen
    patch projection needs no convolution backward (``vit_tiny_patch16_224`` took 22 s of the suite's time here).
    """
    # 7 steps, split after step 3: the second run resumes mid-epoch (6 steps an epoch) and goes on past the epoch's
    # end, its data order and RNG state restored
    kw = dict(max_steps=7, precision=precision, symmetric=preset == "v2")
    if precision == "fp16":
        kw.update(arch="test_vit", small_stem=False, image_size=32)
    straight = _cfg(sample_photos, tmp_path / "a", preset, **kw)
    train(straight, progress=False)
    split = _cfg(sample_photos, tmp_path / "b", preset, **kw)
    first = train(split, progress=False, stop_after=3)
    assert first.steps == 3 and first.stopped_by == "stop_after=3"
    second = train(split, resume=True, progress=False)
    assert second.steps == 7
    _assert_same_state(_state(tmp_path / "a"), _state(tmp_path / "b"))
    scaler = _state(tmp_path / "a")["scaler"]
    assert scaler == _state(tmp_path / "b")["scaler"] and bool(scaler) == (precision == "fp16")  # loss scale kept
    lines_a = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    lines_b = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in lines_a] == [json.loads(x)["loss"] for x in lines_b]


def test_cli_end_to_end_with_bad_files(sample_photos, tmp_path, capsys):
    data = tmp_path / "photos"
    data.mkdir()
    for p in sorted(sample_photos.rglob("*"))[:30]:
        if p.is_file():
            (data / p.name).write_bytes(p.read_bytes())
    (data / "empty.jpg").write_bytes(b"")
    (data / "notes.png").write_text("not an image")
    (data / "ignored.txt").write_text("not a photo")
    run = tmp_path / "run"
    args = ["train", str(data), "--out", str(run), *TINY_CLI, "--max-steps", "2"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "trained 2/2 steps" in out.out and "2 skipped" in out.out
    skipped = dict(line.split("\t") for line in (run / "skipped.txt").read_text().splitlines())
    assert set(skipped) == {"empty.jpg", "notes.png"}
    # a second `train` into the same run is refused; --resume continues (nothing left: 2/2)
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "3", "--quiet"]) == 0
    assert _state(run)["step"] == 3
    # resuming with a setting that changes the result is refused, naming it
    assert main(["train", "--out", str(run), "--resume", "--lr", "0.5", "--quiet"]) == 2
    assert "lr=" in capsys.readouterr().err


def test_progressive_resolution_trains_at_its_sizes_and_resumes_bit_exact(sample_photos, tmp_path):
    from moco.training.optim import crop_size_at

    kw = dict(max_steps=8, image_size=32, min_image_size=16)
    straight = _cfg(sample_photos, tmp_path / "a", **kw)
    train(straight, progress=False)
    split = _cfg(sample_photos, tmp_path / "b", **kw)
    train(split, progress=False, stop_after=3)
    train(split, resume=True, progress=False)
    _assert_same_state(_state(tmp_path / "a"), _state(tmp_path / "b"))
    records = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["crop"] for r in records] == [crop_size_at(s, straight, 8) for s in range(8)]
    assert records[0]["crop"] == 16 and records[-1]["crop"] == 32  # low resolution first, the full size at the end


def test_auto_precision_trains_small_crops_of_a_stride_32_net_in_fp32(sample_photos, tmp_path, caplog):
    """16 px crops reach layer4's stride-2 conv as 1x1 maps; its bf16 backward on CPUs (oneDNN) gave NaN
    gradients in 3 of 20 tries: auto precision takes fp32 there, and the run stays finite."""
    cfg = _cfg(sample_photos, tmp_path / "r", small_stem=False, max_steps=3, precision="auto")
    with caplog.at_level("WARNING"):
        summary = train(cfg, progress=False)
    assert summary.precision == "fp32" and summary.final_loss == summary.final_loss
    if "bf16" in open("/proc/cpuinfo").read():  # where auto would have chosen bf16, the log says why it did not
        assert "training in fp32 instead" in caplog.text


def test_progressive_resolution_is_refused_for_vits():
    from moco.errors import UserError

    with pytest.raises(UserError, match="--min-image-size 112: progressive resolution is for CNNs"):
        resolve_config("v3", arch="vit_small_patch16_224", min_image_size=112)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--batch-size", "64", "--queue-size", "64"], "48 readable images"),  # more than the 48 images
        (["--batch-size", "9"], "--bn-splits"),
        (["--queue-size", "4"], "--queue-size"),
        (["--temperature", "0"], "--temperature"),
        (["--arch", "no_such_net"], "unknown backbone"),
        (["--min-image-size", "8"], "--min-image-size 8 is out of range"),
        (["--min-image-size", "24"], "from 16 to --image-size 16"),  # above the crop size it grows to
        (["--crop-min", "1.5"], "--crop-min 1.5 is out of range: use 0 (the recipe's) or an area fraction in (0, 1]"),
        (["--crop-min", "-0.1"], "--crop-min -0.1 is out of range"),
        (["--decorrelation", "-1"], "--decorrelation -1.0 is out of range: use 0 (off) or a positive weight"),
        (["--decorrelation-decay"], "--decorrelation 0.0 is out of range: --decorrelation-decay scales the term's"),
        (["--no-small-stem", "--precision", "bf16"], "bf16 backward on CPUs can return NaN"),  # 16 px, stride 32
    ],
)
def test_cli_bad_values_exit_2(sample_photos, tmp_path, capsys, extra, needle):
    args = ["train", str(sample_photos), "--out", str(tmp_path / "r"), *TINY_CLI, "--max-steps", "1", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_a_failed_train_checks_first_and_leaves_nothing_behind(sample_photos, tmp_path, capsys):
    """Issue 39: a wrong --arch was said only once every photo was decoded, and a run that failed before its first
    checkpoint left config.json, cache/, skipped.txt and its lock in its folder (which it may have made)."""
    run = tmp_path / "new" / "run"
    args = ["train", str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "1"]
    assert main([*args, "--arch", "no_such_net"]) == 2
    err = capsys.readouterr().err
    assert "unknown backbone" in err and "image cache" not in err  # said before any photo is decoded
    assert not (tmp_path / "new").exists()
    assert main([*args, "--batch-size", "64", "--queue-size", "64"]) == 2  # fails once the photos are counted
    err = capsys.readouterr().err
    assert "48 readable images" in err and "image cache" in err and not (tmp_path / "new").exists()  # all it made
    run.mkdir(parents=True)
    (run / "notes.txt").write_text("mine")
    assert main([*args, "--batch-size", "64", "--queue-size", "64"]) == 2
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]  # what was there stays, what the run made goes


def test_cli_empty_and_unreadable_folders_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", str(empty), "--out", str(tmp_path / "r1"), "--quiet"]) == 2
    assert "no images" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jpg").write_bytes(b"")
    (bad / "b.png").write_text("hello")
    assert main(["train", str(bad), "--out", str(tmp_path / "r2"), "--quiet"]) == 2
    assert str(bad) in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing"), "--out", str(tmp_path / "r3"), "--quiet"]) == 2


@pytest.mark.parametrize(
    "photos, flags, needles",
    [
        (1, ["--batch-size", "2", "--bn-splits", "1"], ["has 1 readable photo", "needs at least 2"]),
        (3, ["--batch-size", "8", "--bn-splits", "2"], ["--batch-size 3 --bn-splits 1"]),  # 2 / 2 splits: too few
    ],
)
def test_too_few_photos_for_the_batch_says_what_works(tmp_path, capsys, photos, flags, needles):
    from PIL import Image

    folder = tmp_path / "few"
    folder.mkdir()
    for i in range(photos):
        Image.new("RGB", (40, 40), (40 * i, 90, 200)).save(folder / f"{i}.png")
    assert main(["train", str(folder), "--out", str(tmp_path / "r"), *TINY_CLI, *flags, "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    assert "--batch-size 2 or smaller" not in err


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_continues(sample_photos, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "app.cli", "train", str(sample_photos), "--out", str(run), *TINY_CLI]
    cmd += ["--max-steps", "100000"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    # the signal goes only once the loop (which holds the handler) has logged 3 steps: on a loaded machine the
    # start-up alone can take minutes, and a signal before the loop is not what this test is about
    deadline = time.monotonic() + 600
    while proc.poll() is None and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run logged under 3 steps in 10 minutes: {proc.communicate()[1]}")
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1]  # still training: 100000 steps
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in out
    step = _state(run)["step"]
    assert step >= 3
    assert len(metrics.read_text().splitlines()) == step
    assert main(["train", "--out", str(run), "--resume", "--max-steps", str(step + 2), "--quiet"]) == 0
    assert _state(run)["step"] == step + 2


def test_vit_v3_keeps_patch_projection_and_position_embedding_fixed(sample_photos, tmp_path):
    from moco.model.builder import MoCo
    from moco.training.setup import build_model

    cfg = _cfg(
        sample_photos, tmp_path / "vit", "v3", arch="vit_tiny_patch16_224", small_stem=False, image_size=32, max_steps=3
    )
    assert cfg.optimizer == "adamw" and cfg.temperature == 0.2  # the paper's ViT recipe
    torch.manual_seed(cfg.seed)
    before: MoCo = build_model(cfg)  # the same initialization train() makes
    train(cfg, progress=False)
    after = torch.load(tmp_path / "vit" / "checkpoint.pt", weights_only=True)["model"]
    for name in ("backbone.patch_embed.proj.weight", "backbone.patch_embed.proj.bias", "backbone.pos_embed"):
        assert torch.equal(after[name], before.state_dict()[name]), name
    assert not torch.equal(
        after["backbone.blocks.0.attn.qkv.weight"], before.state_dict()["backbone.blocks.0.attn.qkv.weight"]
    )


def test_knn_monitor_logged_and_plotted(sample_photos, tmp_path):
    from moco.training.metrics import read_metrics

    cfg = _cfg(sample_photos, tmp_path / "knn", max_steps=6, val_dir=str(sample_photos), knn_k=5)
    train(cfg, progress=False)
    knn = [r for r in read_metrics(tmp_path / "knn" / "metrics.jsonl") if "knn_top1" in r]
    assert [r["step"] for r in knn] == [0, 6]  # before training and at the end of the (6-step) epoch
    assert all(0.0 <= r["knn_top1"] <= 1.0 for r in knn)
    assert knn[0]["knn_top1"] > 1 / 6  # even random features beat chance on these families
    pixels = {r["knn_pixels"] for r in knn}  # the centred-pixels floor beside every figure, the same each time
    assert len(pixels) == 1 and 1 / 6 < pixels.pop() <= 1.0
    assert all(0.0 <= r["knn_whitened"] <= 1.0 for r in knn)  # the same features whitened on the collection
    assert len({r["knn_pixels_whitened"] for r in knn}) == 1


@pytest.mark.parametrize(("slow_from", "stopped_by", "steps"), [(None, None, 15), (12, "time budget", 13)])
def test_time_budget_fits_the_schedule_to_the_budget(sample_photos, tmp_path, monkeypatch, slow_from, stopped_by,
                                                     steps):
    """Issue 39: on a loaded machine the first fit (step 10) came when the budget was nearly spent: 12 steps, the lr
    not annealed, and the test failed. The budget's clock is synthetic here (tests/step_clock.py), so the run is the
    same on any machine: 0.5 s a step, 2 s from step ``slow_from``, against 7.8 s of budget."""
    from tests.step_clock import StepClock

    StepClock(lambda step: 2.0 if slow_from is not None and step >= slow_from else 0.5).install(monkeypatch.setattr)
    run = tmp_path / "run"
    summary = train(_cfg(sample_photos, run, epochs=100_000, time_budget=0.13), progress=False)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # fitted at step 10 to 10 + (7.8 - 5) s / 0.5 s = 15 steps: the budget, not the 100,000 epochs, sets the schedule
    assert "total_steps" not in records[9] and all(r["total_steps"] == 15 for r in records[10:])
    assert summary.stopped_by == stopped_by and summary.steps == summary.total_steps == steps
    if stopped_by is None:  # ended with its schedule (7.5 s): the lr annealed to its end
        assert records[-1]["lr"] < 0.05 * records[0]["lr"] and summary.planned_steps is None
    else:  # slower after the fit: the budget is spent at step 13 (6 s by step 12, then 2 s a step)
        assert records[-1]["elapsed_s"] == pytest.approx(8.0) and summary.planned_steps == 15
        ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
        assert ckpt["step"] == ckpt["total_steps"] == 13 and ckpt["planned_steps"] == 15  # finished, cut short
        from moco.training.command import summary_line

        assert "trained 13/13 steps" in summary_line(summary, run)
        assert "(stopped by its time budget at 13 of 15 steps)" in summary_line(summary, run)


@pytest.mark.parametrize(("preset", "batch", "world", "splits"), [
    ("v2", 256, 1, 8), ("v2", 64, 1, 4), ("v2", 32, 1, 2), ("v2", 8, 1, 2), ("v2", 6, 1, 2), ("v2", 3, 1, 1),
    ("v2", 32, 8, 1), ("v1", 256, 2, 1), ("v3", 256, 1, 1),
])
def test_auto_bn_splits_keeps_16_images_per_group_on_one_process(preset, batch, world, splits):
    from moco.training.setup import bn_splits_for as _bn_splits

    queue = {} if preset == "v3" else {"queue_size": max(256, batch * world)}
    cfg = resolve_config(preset, batch_size=batch, **queue)
    assert cfg.bn_splits == (1 if preset == "v3" else 0)  # auto, unless the user (or v3) sets it
    assert _bn_splits(cfg, world) == splits
    assert _bn_splits(resolve_config(preset, batch_size=256, bn_splits=1, **queue), world) == 1  # explicit wins
