"""The command that trains, ``moco train`` and ``python -m moco.training`` (torchrun's entry point): its flags, the
config it resolves from them (preset <- ``--config`` file <- flags, or the checkpoint's on ``--resume``), and the
run's one-line summary. Importable without torch, so that building the CLI's parser (``moco --help``) does not load
the trainer, which is imported when a run starts."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from moco.config import is_vit
from moco.errors import UserError

__all__ = ["DESCRIPTION", "add_train_arguments", "summary_line", "train_from_args", "main"]

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


def summary_line(summary: dict[str, Any], run_dir: Path) -> str:
    """One line about a finished (or stopped) run, for the console."""
    how = f" (stopped by {summary['stopped_by']}; continue with --resume)" if summary["stopped_by"] else ""
    if summary["stopped_by"] == "time budget":  # finished, maybe short of its schedule
        planned = summary.get("planned_steps")
        how = (f" (stopped by its time budget at {summary['steps']} of {planned} steps)" if planned
               else " (its time budget is spent)")
    loss, white = summary["final_loss"], summary.get("whitening")
    mirror = " and their mirror images" if white and white.get("mirror") else ""
    stages = f", {white['dim']}-d with the pooled {'/'.join(white['stages'])}" if white and white.get("stages") else ""
    fitted = (f"; whitening fitted on {white['rows']} photos{mirror}{stages} in {white['seconds']:.1f} s"
              if white else "")
    from moco.data.photos import skipped_notes

    left_out = "".join(f"; {note}" for note in skipped_notes(summary.get("unsupported") or {}))
    if summary.get("excluded"):
        left_out += f"; {summary['excluded']} files and folders left out by --exclude"
    return (
        f"trained {summary['steps']}/{summary['total_steps']} steps on {summary['images']} images "
        f"({summary['skipped']} skipped) on {summary['device']} {summary['precision']}{how}; "
        f"final loss {loss if loss is None else round(loss, 4)}{fitted}; checkpoint {run_dir / 'checkpoint.pt'}"
        f"{left_out}"
    )


def train_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Resolve the config (preset <- --config file <- flags, or the checkpoint's on --resume) and train; returns
    train()'s summary. An ``--init`` checkpoint (or official name, fetched once) is read here, once: what it fixes
    goes into the config (:func:`moco.weights.layouts.init_settings`) and the weights are handed to train()."""
    from moco.config import (
        PRESETS,
        TrainConfig,
        config_overrides,
        cpu_image_size,
        default_preset,
        load_config_file,
        resolve_config,
    )
    from moco.data.photos import short_sides
    from moco.training.checkpoints import resume_config
    from moco.training.loop import train
    from moco.training.setup import bn_splits_for, warn_small_bn_groups
    from moco.weights.layouts import init_settings, read_checkpoint
    from moco.weights.pretrained import resolve

    from_file = load_config_file(args.config) if args.config else {}
    data_dir = args.data_dir or from_file.get("data_dir", "")  # DATA_DIR overrides the file's, as any flag does
    from_file.pop("data_dir", None)
    from_file.pop("out", None)  # --out is required and always wins
    file_preset = from_file.pop("preset", None)
    preset = args.preset or file_preset
    overrides = {**from_file, **config_overrides(args)}
    run_dir = Path(args.out)
    init = None
    if args.resume:
        if not (run_dir / "checkpoint.pt").exists():
            raise UserError(f"--resume: no checkpoint at {run_dir / 'checkpoint.pt'}; drop --resume to start a new run")
        if preset:
            overrides["preset"] = preset
        cfg = resume_config(run_dir, {**overrides, "data_dir": data_dir})
    else:
        if not data_dir:
            raise UserError("training needs DATA_DIR, the folder of photos to train on (or --resume with --out)")
        if (run_dir / "checkpoint.pt").exists():
            raise UserError(
                f"{run_dir} already holds a training run: add --resume to continue it, or choose another --out"
            )
        if not preset:
            preset = default_preset(overrides.get("time_budget", 0.0), overrides.get("device", "auto"))
            if preset == "cpu":
                logger.info("a time budget on a CPU: the cpu preset (short-run recipe; --preset v2 for the paper's)")
        if preset == "cpu" and "image_size" not in overrides and not is_vit(overrides.get("arch", "")):
            overrides["image_size"] = cpu_image_size(short_sides(data_dir, exclude=overrides.get("exclude", ())))
            if overrides["image_size"] != PRESETS["cpu"]["image_size"]:
                logger.info("small photos: the cpu preset trains at %d px, their own size (--image-size to choose)",
                            overrides["image_size"])
        if overrides.get("init"):
            init = read_checkpoint(resolve(overrides["init"]))
            for name, value in init_settings(init, overrides.get("arch", TrainConfig.arch)).items():
                overrides.setdefault(name, value)  # the flags win; a mismatch is refused as the weights load
        cfg = resolve_config(preset, data_dir=data_dir, out=args.out, **overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0 and cfg.bn_splits >= 0:  # the flags' user is told, not train()'s callers
        warn_small_bn_groups(replace(cfg, bn_splits=bn_splits_for(cfg, world)), world, cfg.head == "v3" and world > 1)
    return train(cfg, resume=args.resume, progress=not args.quiet, stop_after=args.stop_after,
                 tensorboard=args.tensorboard, init=init)


def main(argv: list[str] | None = None) -> int:
    """``python -m moco.training`` (the entry point for torchrun): the flags of ``moco train``; 2 on bad input."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    from moco.runtime import setup_logging

    parser = argparse.ArgumentParser(prog="python -m moco.training", description=DESCRIPTION)
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    try:
        with logging_redirect_tqdm():
            summary = train_from_args(args)
    except UserError as e:  # StorageError, NetworkError (disk full, offline) exit 1: not bad input
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary_line(summary, Path(args.out)))
    return 128 + summary["signal"] if summary["signal"] else 0
