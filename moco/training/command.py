"""The command that trains, ``moco train`` and ``python -m moco.training`` (torchrun's entry point): its flags, the
config it resolves from them (preset <- ``--config`` file <- flags, or the checkpoint's on ``--resume``), and the
run's one-line summary. Importable without torch, so that building the CLI's parser (``moco --help``) does not load
the trainer, which is imported when a run starts."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moco.config import is_vit
from moco.errors import UserError

if TYPE_CHECKING:
    from moco.data.photos import Scan
    from moco.training.summary import TrainingSummary
    from moco.weights.layouts import SplitCheckpoint

__all__ = ["DESCRIPTION", "TrainPlan", "add_train_arguments", "plan_training", "summary_line", "train_from_args",
           "main"]

logger = logging.getLogger(__name__)

DESCRIPTION = (
    "Train MoCo v1/v2/v3 on a folder of unlabeled photos (recursive). Writes RUN_DIR/checkpoint.pt, config.json, "
    "metrics.jsonl, skipped.txt and curves.png. Flags override the --config file's values, which override the "
    "preset's."
)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``moco train`` and ``python -m moco.training``: DATA_DIR, --out, run control, a flag per field."""
    from moco.config import PRESETS, add_config_arguments

    p.add_argument("data_dir", metavar="DATA_DIR", nargs="?", help="folder of photos (optional with --resume)")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory")
    p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="recipe to start from: v1 | v2 | v3 (the papers) | cpu (short CPU runs; see the README) "
                   "(default: cpu for a --time-budget run on a CPU, else v2)")
    p.add_argument("--resume", action="store_true", help="continue RUN_DIR/checkpoint.pt exactly where it stopped")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="JSON or YAML file of config fields (e.g. a run's config.json): preset <- file <- flags")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write the metrics as TensorBoard scalars to RUN_DIR/tensorboard (needs the "
                   "tensorboard extra)")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="STEP",
        help="checkpoint and exit at this step, as if interrupted (the schedule still spans the whole "
        "run): to split training over job slots; continue with --resume",
    )
    add_config_arguments(p)


def summary_line(summary: TrainingSummary, run_dir: Path) -> str:
    """One line about a finished (or stopped) run, for the console."""
    how = f" (stopped by {summary.stopped_by}; continue with --resume)" if summary.stopped_by else ""
    if summary.stopped_by == "time budget":  # finished, maybe short of its schedule
        planned = summary.planned_steps
        how = (f" (stopped by its time budget at {summary.steps} of {planned} steps)" if planned
               else " (its time budget is spent)")
    from moco.whiten import features_text

    loss, white = summary.final_loss, summary.whitening
    mirror = " and their mirror images" if white and white.mirror else ""
    stages = f", {white.dim}-d{features_text(white.stages)}" if white and white.stages else ""
    fitted = (f"; whitening fitted on {white.rows} photos{mirror}{stages} in {white.seconds:.1f} s"
              if white else "")
    from moco.data.photos import skipped_notes

    left_out = "".join(f"; {note}" for note in skipped_notes(summary.unsupported))
    if summary.excluded:
        left_out += f"; {summary.excluded} files and folders left out by --exclude"
    return (
        f"trained {summary.steps}/{summary.total_steps} steps on {summary.images} images "
        f"({summary.skipped} skipped) on {summary.device} {summary.precision}{how}; "
        f"final loss {loss if loss is None else round(loss, 4)}{fitted}; checkpoint {run_dir / 'checkpoint.pt'}"
        f"{left_out}"
    )


@dataclass
class TrainPlan:
    """A new run's settings: its ``preset``, the config fields it sets (``overrides``, for
    :func:`moco.config.resolve_config`), the ``--init`` checkpoint read once (None: none) and ``notes``, lines about
    a default chosen for the flags' user (`moco train` logs them)."""

    preset: str
    overrides: dict[str, Any]
    init: SplitCheckpoint | None = None
    notes: list[str] = field(default_factory=list)


def plan_training(photos: str | Path | Scan, given: dict[str, Any], preset: str | None = None) -> TrainPlan:
    """The settings of a new run on ``photos`` (its folder, listed only if the crop is fitted to it, or its
    :class:`~moco.data.photos.Scan`, made once by the caller) from the config fields a command sets (``given``: its
    flags; they win) and its ``preset`` (None: :func:`moco.config.default_preset`), for `moco train` and `moco run`.

    The cpu preset's crop is fitted to the photos (:func:`moco.config.cpu_image_size`) unless ``given`` sets it or
    names a ViT. ``given["init"]`` (a file or an official name) is read here, once: unless ``given`` sets ``arch``,
    the architecture and stem are those of its weights (:func:`moco.weights.arch.detect_arch`), a small stem's crop
    no larger than theirs; what else it fixes comes from it (:func:`moco.weights.layouts.init_settings`).
    ``overrides`` lists ``init`` and ``exclude`` first, then what the weights fix, the crop, the rest of ``given``.
    """
    from moco.config import PRESETS, TrainConfig, cpu_image_size, default_preset

    notes = []
    if not preset:
        preset = default_preset(given.get("time_budget", 0.0), given.get("device", "auto"))
        if preset == "cpu":
            notes.append("a time budget on a CPU: the cpu preset (short-run recipe; --preset v2 for the paper's)")
    out: dict[str, Any] = {name: given[name] for name in ("init", "exclude") if name in given}
    size = None
    if preset == "cpu" and "image_size" not in given and not is_vit(given.get("arch", "")):
        from moco.data.photos import short_sides

        size = cpu_image_size(short_sides(photos, exclude=given.get("exclude", ())))
        if size != PRESETS["cpu"]["image_size"]:
            notes.append(f"small photos: the cpu preset trains at {size} px, their own size (--image-size to choose)")
    init = None
    if given.get("init"):
        from moco.weights.layouts import init_settings, read_checkpoint
        from moco.weights.pretrained import resolve

        init = read_checkpoint(resolve(given["init"]))
        arch = given.get("arch", TrainConfig.arch)
        if "arch" not in given:  # the model must match the weights it starts from
            from moco.weights.arch import detect_arch

            guess = detect_arch(init)
            arch = out["arch"] = guess.arch
            out["small_stem"] = guess.small_stem
            if size is not None and guess.small_stem:
                size = min(size, guess.image_size)
        out.update(init_settings(init, arch))  # the flags win; a mismatch is refused as the weights load
    if size is not None:
        out["image_size"] = size
    out.update(given)
    return TrainPlan(preset, out, init, notes)


def train_from_args(args: argparse.Namespace) -> TrainingSummary:
    """Resolve the config (preset <- --config file <- flags, or the checkpoint's on --resume) and train; returns
    train()'s summary. A new run's settings come from :func:`plan_training` (as `moco run`'s do): an ``--init``
    checkpoint (or official name, fetched once) is read there, once, and its weights handed to train()."""
    from moco.config import config_overrides, load_config_file, resolve_config
    from moco.training.checkpoints import resume_config
    from moco.training.loop import train
    from moco.training.setup import bn_splits_for, warn_small_bn_groups
    from moco.weights.layouts import load_checkpoint

    from_file = load_config_file(args.config) if args.config else {}
    data_dir = args.data_dir or from_file.get("data_dir", "")  # DATA_DIR overrides the file's, as any flag does
    from_file.pop("data_dir", None)
    from_file.pop("out", None)  # --out is required and always wins
    file_preset = from_file.pop("preset", None)
    preset = args.preset or file_preset
    overrides = {**from_file, **config_overrides(args)}
    run_dir = Path(args.out)
    init = ckpt = None
    if args.resume:
        if not (run_dir / "checkpoint.pt").exists():
            raise UserError(f"--resume: no checkpoint at {run_dir / 'checkpoint.pt'}; drop --resume to start a new run")
        if preset:
            overrides["preset"] = preset
        ckpt = load_checkpoint(run_dir / "checkpoint.pt")  # read once: its config here, its state in train()
        cfg = resume_config(run_dir, {**overrides, "data_dir": data_dir}, ckpt)
    else:
        if not data_dir:
            raise UserError("training needs DATA_DIR, the folder of photos to train on (or --resume with --out)")
        if (run_dir / "checkpoint.pt").exists():
            raise UserError(
                f"{run_dir} already holds a training run: add --resume to continue it, or choose another --out"
            )
        plan = plan_training(data_dir, overrides, preset)
        for note in plan.notes:
            logger.info(note)
        init = plan.init
        cfg = resolve_config(plan.preset, data_dir=data_dir, out=args.out, **plan.overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0 and cfg.bn_splits >= 0:  # the flags' user is told, not train()'s callers
        warn_small_bn_groups(replace(cfg, bn_splits=bn_splits_for(cfg, world)), world, cfg.head == "v3" and world > 1)
    return train(cfg, resume=args.resume, progress=not args.quiet, stop_after=args.stop_after,
                 tensorboard=args.tensorboard, init=init, checkpoint=ckpt)


def main(argv: list[str] | None = None) -> int:
    """``python -m moco.training`` (the entry point for torchrun): the flags of ``moco train``; 2 on bad input."""
    parser = argparse.ArgumentParser(prog="python -m moco.training", description=DESCRIPTION)
    add_train_arguments(parser)
    args = parser.parse_args(argv)  # before torch loads: --help and a bad flag answer at once
    from tqdm.contrib.logging import logging_redirect_tqdm

    from moco.runtime import setup_logging

    setup_logging()
    try:
        with logging_redirect_tqdm():
            summary = train_from_args(args)
    except UserError as e:  # StorageError, NetworkError (disk full, offline) exit 1: not bad input
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary_line(summary, Path(args.out)))
    return 128 + summary.signal if summary.signal else 0
