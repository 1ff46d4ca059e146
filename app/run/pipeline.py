"""`moco run`: photos -> trained (or given) model -> exported backbone -> index -> served UI, in one command.

A run's state belongs to its photo folder: each folder gets its own directory under WORK (``collection_dir``),
so another folder never reuses, nor overwrites, its training, export or index:

    WORK/sample/                   the generated sample collection (photos/), when no PHOTOS are given
    WORK/NAME-HASH/                a photo folder: NAME its last component, HASH 8 hex digits of its resolved path

Within that directory every step reuses what an earlier run of the same folder left:

    run/checkpoint.pt              training (resumed while its schedule is unfinished, or only its whitening
                                   fitted when that was interrupted; skipped when done)
    backbone.safetensors           re-exported only when the checkpoint's bytes changed
    index/                         updated (only new or changed photos embedded); rebuilt only when the
                                   backbone changed, into index.new/ first, so the old one keeps serving
    .moco.lock                     held while a run works here (a second run of the folder refuses, naming its PID)

With PHOTOS and no model given, ``pretrained`` (the CLI: moco_v2_800ep) is used as is when it is cached or can
be downloaded; otherwise training starts from scratch, and the output says why. The sample never fetches anything.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.run.status import RunStatus
from moco.errors import UserError

if TYPE_CHECKING:
    from moco.data.photos import Scan
    from moco.training.command import TrainPlan
    from moco.training.summary import TrainingSummary

__all__ = ["RunPlan", "collection_dir", "run_pipeline", "run_settings", "training_plan"]

logger = logging.getLogger(__name__)

CPU_MINUTES = 10.0  # default CPU training budget: a useful model, quickly
SAMPLE = "sample"  # WORK/sample: the generated collection (photos/) and its run, backbone and index
STATE = ("run", "backbone.safetensors", "index")  # what a run leaves in its folder's directory
KEPT = ("run/checkpoint.pt", "backbone.safetensors", "index")  # once one exists, a failed run leaves all as it is
LEGACY = (*STATE, "sample_photos")  # what earlier versions kept at the top of WORK, for whichever folder ran last


def collection_dir(work: str | Path, photos: str | Path | None) -> Path:
    """The directory under ``work`` that holds the run, backbone and index of ``photos`` (None: the sample).

    The sample gets ``work/sample`` (its photos in ``work/sample/photos``); a folder gets ``work/NAME-HASH``, NAME
    its last component (made safe for a file name), HASH the first 8 hex digits of the sha256 of its resolved
    path: two folders, even of the same name, never share one.
    """
    work = Path(work)
    if photos is None:
        return work / SAMPLE
    folder = Path(photos).expanduser().resolve()
    if folder == (work / SAMPLE / "photos").resolve():  # the sample, named explicitly
        return work / SAMPLE
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", folder.name)[:40].strip("._") or "photos"
    return work / f"{name}-{hashlib.sha256(os.fsencode(folder)).hexdigest()[:8]}"


@dataclass
class RunPlan:
    """What one `moco run` is asked to do (:func:`run_pipeline`'s arguments): ``photos`` (None: the sample), ``work``
    (WORK: every folder's directory is in it), the model given (``checkpoint`` used as is, or ``init`` trained
    from: a file or an official name), ``minutes`` (the time budget), ``train_overrides`` (config fields, winning
    over the run's choices), ``pretrained`` (the official model used when none is given), ``progress`` (bars),
    ``exclude`` (the ``--exclude`` patterns)."""

    photos: str | Path | None
    work: Path
    checkpoint: str | Path | None = None
    init: str | Path | None = None
    minutes: float | None = None
    train_overrides: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None
    progress: bool = True
    exclude: tuple[str, ...] = ()


def run_settings(n_images: int, cuda: bool, minutes: float | None) -> tuple[str, dict[str, Any]]:
    """The preset and the config fields `moco run` sets for the machine and a collection of ``n_images`` photos.

    GPU: the full MoCo v2 recipe (ResNet-50, 224 px, batch 256, 200 epochs) unless ``minutes`` caps it.
    CPU: the ``cpu`` preset (the short-run recipe, its network) under a time budget; batch and queue shrink for a
    small collection (the batch to about half of it, 16 at least), and Shuffle BN keeps 16 images per batch-norm
    group where the batch allows, 2 groups of batch / 2 below 32 (a smaller collection has no larger batch to give).
    """
    from moco.config import PRESETS

    if cuda:
        return "v2", ({"time_budget": float(minutes)} if minutes else {})
    batch = min(PRESETS["cpu"]["batch_size"], max(16, 2 ** int(math.log2(max(2, n_images // 2)))))
    splits = min(8, max(2, batch // 16))  # Shuffle BN over at least 2 groups, of 16 images where the batch allows
    queue = min(PRESETS["cpu"]["queue_size"], max(batch, 2 ** int(math.log2(max(2, n_images)))))
    return "cpu", {"batch_size": batch, "bn_splits": splits, "queue_size": queue,
                   "time_budget": float(minutes or CPU_MINUTES)}


def training_plan(scan: Scan, cuda: bool, minutes: float | None, init: str | None = None,
                  extra: dict[str, Any] | None = None, exclude: tuple[str, ...] = ()) -> TrainPlan:
    """`moco run`'s training settings for the photos of ``scan`` (the run's one listing of its folder): the fields of
    :func:`run_settings`, then ``extra`` (``train_overrides``), worked out as `moco train` works out its flags
    (:func:`moco.training.command.plan_training`): the cpu preset's crop fitted to the photos, and with ``init``
    (the ``--init`` file or name, read there once) the architecture and what else it fixes taken from it.
    ``exclude``: the ``--exclude`` patterns, never read; they go into the config."""
    from moco.training.command import plan_training

    preset, chosen = run_settings(len(scan.files), cuda, minutes)
    given = {**({"init": init} if init else {}), **({"exclude": tuple(exclude)} if exclude else {}), **chosen,
             **(extra or {})}
    return plan_training(scan, given, preset)


def _train(photos: Path, scan: Scan, run_dir: Path, plan: RunPlan, say: Callable[[str], None],
           status: RunStatus | None = None) -> Path:
    """Train on ``photos`` (listed once: ``scan``) into ``run_dir``, or resume the run there (its checkpoint read
    once here for where it stands and its config). ``plan.init``: what a new run starts from, as given (a file, or
    an official name the caller fetched), read once (:func:`training_plan`)."""
    import torch

    from moco.config import resolve_config
    from moco.training.checkpoints import resume_config, run_end, run_state
    from moco.training.loop import train
    from moco.weights.layouts import load_checkpoint

    ckpt_path = run_dir / "checkpoint.pt"
    if ckpt_path.is_file():
        ckpt = load_checkpoint(ckpt_path)
        step, total, state = int(ckpt.get("step", 0)), int(ckpt.get("total_steps") or 0), run_state(ckpt)
        end = run_end(ckpt)  # "600/600 steps", or where its time budget stopped it
        if state == "done":
            say(f"training: done earlier ({end}), reusing {ckpt_path}")
            return ckpt_path
        if state == "whitening":  # killed during the end-of-run fit: that fit alone, no training step
            say("training: finished earlier but its whitening was not fitted (interrupted): fitting it now")
        else:
            say(f"training: resuming {ckpt_path} at step {step}/{total}")
        cfg = resume_config(run_dir, {"data_dir": str(photos)}, ckpt)
        _stop_on_signal(train(cfg, resume=True, progress=plan.progress, checkpoint=ckpt), ckpt_path, say)
        return ckpt_path
    n = len(scan.files)
    if status is not None:
        status.photos_found = n
    if n < 16:
        raise UserError(f"{photos} has {n} photos: MoCo needs at least 16 to train; give more photos, or "
                        "CHECKPOINT=... (a pretrained model: no training)")
    chosen = training_plan(scan, torch.cuda.is_available(), plan.minutes, str(plan.init) if plan.init else None,
                           plan.train_overrides, plan.exclude)
    overrides = chosen.overrides
    say(f"training: MoCo {chosen.preset} on {n} photos ({', '.join(f'{k}={v}' for k, v in overrides.items())})")
    cfg = resolve_config(chosen.preset, data_dir=str(photos), out=str(run_dir), **overrides)
    summary = train(cfg, progress=plan.progress, init=chosen.init)
    if summary.skipped:
        say(f"training: on {summary.images} of the {n} photos, {summary.skipped} skipped as unreadable (listed "
            f"in {run_dir / 'skipped.txt'})")
    _stop_on_signal(summary, ckpt_path, say)
    return ckpt_path


def _stop_on_signal(summary: TrainingSummary, ckpt_path: Path, say: Callable[[str], None]) -> None:
    """A run stopped by Ctrl+C or SIGTERM ends here (its checkpoint saved), never goes on to export a half model;
    one cut short by its time budget says so, and goes on."""
    if summary.planned_steps:
        say(f"training: stopped by its time budget at {summary.steps} of {summary.planned_steps} steps")
    if summary.signal is not None:
        say(f"training: stopped by {summary.stopped_by} at step {summary.steps}/{summary.total_steps}; "
            f"{ckpt_path} is saved: run the same command to resume")
        raise KeyboardInterrupt


def _export(source: Path, out: Path, say: Callable[[str], None]) -> Path:
    from moco.export.exporter import export_backbone
    from moco.export.reader import embedding_dim, load_exported
    from moco.files import sha256_file

    digest = sha256_file(source)
    if out.is_file():
        _, meta = load_exported(out)
        if meta.source_sha256 == digest:
            say(f"export: {out} is up to date with {source.name}")
            return out
    tmp = out.with_name(".backbone.new.safetensors")
    meta = export_backbone(source, tmp)
    tmp.replace(out)
    say(f"export: {meta.arch} ({embedding_dim(meta)}-d, {meta.image_size} px) -> {out}")
    return out


def _index(photos: Path, backbone: Path, index_dir: Path, say: Callable[[str], None], progress: bool,
           exclude: tuple[str, ...] = ()) -> Any:
    """Build or update the index of ``photos`` in ``index_dir``; its ``--exclude`` patterns are set to ``exclude``
    (what this run's flags say, not added to an earlier run's)."""
    from index.building.runner import build_index, update_index
    from index.catalog import Catalog, catalog_meta
    from moco.files import sha256_file

    if (index_dir / "catalog.sqlite").is_file():
        cat = Catalog(index_dir / "catalog.sqlite")
        meta = catalog_meta(cat)
        cat.close()
        if meta["backbone_sha256"] == sha256_file(backbone) and Path(meta["root"] or "") == photos.resolve():
            s = update_index(index_dir, backbone=backbone, progress=progress, exclude=exclude, clear_excludes=True)
            say(f"index: updated {index_dir} ({s.embedded} new, {s.reembedded} changed, {s.removed} removed, "
                f"{s.unchanged} unchanged; {s.vectors} searchable)")
            return s
        fresh = index_dir.with_name(index_dir.name + ".new")
        shutil.rmtree(fresh, ignore_errors=True)
        say(f"index: the backbone or the photos changed: building a new index in {fresh}")
        s = build_index(photos, backbone, fresh, progress=progress, exclude=exclude)
        old = index_dir.with_name(index_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        index_dir.rename(old)
        fresh.rename(index_dir)
        shutil.rmtree(old, ignore_errors=True)  # nothing inside an index refers to its directory's name
    else:
        s = build_index(photos, backbone, index_dir, progress=progress, exclude=exclude)
    say(f"index: {s.vectors} photos searchable in {index_dir} ({s.kind}, {s.images_per_s:.0f} images/s, "
        f"{len(s.errors)} skipped)")
    return s


def _pretrained(name: str, say: Callable[[str], None], progress: bool) -> Path | None:
    """The cached or downloaded official checkpoint ``name``; None (and why) when it cannot be had."""
    from moco.weights.pretrained import REGISTRY, FetchError, cache_path, fetch

    if name not in REGISTRY:
        raise UserError(f"pretrained model {name!r} is unknown: use one of {', '.join(REGISTRY)}, or none")
    entry = REGISTRY[name]
    where = "cached" if cache_path(entry).is_file() else f"downloading it once into {cache_path(entry)}"
    say(f"model: {name} (official MoCo {entry.moco_version}, {entry.arch}, {entry.top1}% ImageNet linear top-1), "
        f"{where}")
    try:
        return fetch(name, progress)
    except FetchError as e:
        say(f"model: {name} is not available, training from scratch instead: {e}")
        return None


def _say_where(root: Path, work: Path, photos: Path, say: Callable[[str], None]) -> None:
    """Which directory this run uses, whether it reuses anything there, and an earlier version's layout if any."""
    if any((work / name).exists() for name in STATE):
        say(f"work: {work}, for {photos} alone: reusing what an earlier run of this folder left there")
    else:
        say(f"work: {work}, for {photos} alone (new: nothing of another photo folder's run is reused)")
    legacy = [str(root / name) for name in LEGACY if (root / name).exists()]
    if legacy:
        say(f"work: {', '.join(legacy)} were left by an earlier version (one photo folder per WORK): not reused "
            f"and left as they are, since each photo folder now has its own directory in {root}; delete them to "
            "free the space")


def run_pipeline(photos: str | Path | None, work: str | Path, checkpoint: str | Path | None = None,
                 init: str | Path | None = None, minutes: float | None = None, train_overrides: dict | None = None,
                 say: Callable[[str], None] = print, progress: bool = True,
                 pretrained: str | None = None, status: RunStatus | None = None,
                 locked: bool = False, exclude: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """Train (or take ``checkpoint``), export, index; returns the paths and the index summary.

    Everything is written in ``collection_dir(work, photos)``, this photo folder's own directory under ``work``.
    ``photos`` None: a generated sample collection in ``work/sample/photos`` (nothing is downloaded).
    ``checkpoint``/``init``: a file or an official name (``moco pretrained``). ``pretrained``: an official name
    to use as is when no model is given, if it is cached or can be downloaded (else: training from scratch).
    ``status``: told each stage and every message (still printed through ``say``); on an error its stage is
    "failed" (the error re-raised); its ``index_ready`` is set once the index is written.
    That directory is locked meanwhile (:func:`moco.files.lock_dir`): a second run of the same folder
    refuses, naming this one; runs of other folders under the same ``work`` go on. ``locked``: the caller holds
    that lock already (`moco run` takes it before it serves its page). A run that fails before it wrote a
    checkpoint, a backbone or an index removes what it created (:func:`moco.files.make_dirs`). ``exclude``:
    ``--exclude`` patterns (:mod:`moco.excludes`), never read, neither trained on nor indexed.
    """
    import contextlib

    from moco.files import lock_dir, make_dirs

    status = status if status is not None else RunStatus(work)

    def tell(message: str) -> None:
        say(message)
        status.say(message)

    try:
        own = collection_dir(work, photos)
        undo = make_dirs(own)
        with contextlib.nullcontext() if locked else lock_dir(own, "--work"):
            try:
                plan = RunPlan(photos, Path(work), checkpoint, init, minutes, dict(train_overrides or {}),
                               pretrained, progress, tuple(exclude))
                return _run(plan, tell, status)
            except BaseException:
                if not any((own / name).exists() for name in KEPT):  # failed before writing what a rerun reuses:
                    undo()  # what this run created goes (the generated sample, an empty WORK ...), nothing else
                raise
    except BaseException as e:
        status.fail(str(e) or type(e).__name__)
        raise


def _run(plan: RunPlan, say: Callable[[str], None], status: RunStatus) -> dict[str, Any]:
    """:func:`run_pipeline`'s work, its directory locked: the photo folder listed once, that listing passed along."""
    photos, checkpoint, init, pretrained, progress = (plan.photos, plan.checkpoint, plan.init, plan.pretrained,
                                                      plan.progress)
    if checkpoint and init:
        raise UserError("give CHECKPOINT (use it as is) or INIT (continue training from it), not both")
    root = plan.work
    work = collection_dir(root, photos)  # this folder's own: its run, backbone and index
    status.run_dir = work / "run"
    status.stage("photos", "generating a sample collection" if photos is None else str(photos))
    if photos is None:
        from moco.data.sample import make_sample_collection

        pretrained = None  # the sample stays offline
        photos = work / "photos"
        if not photos.is_dir():
            say(f"photos: none given, generating a sample collection in {photos}")
            make_sample_collection(photos, per_family=40, size=96, seed=0)
    photos = Path(photos).expanduser().resolve()
    if not photos.is_dir():
        raise UserError(f"photo folder not found: {photos} (PHOTOS=... must be a folder)")
    _say_where(root, work, photos, say)
    from moco.data.photos import scan_photos

    scan = scan_photos(photos, plan.exclude)  # the photos' folders listed, no photo read: once a run
    status.unsupported, status.excluded = scan.unsupported_counts(), scan.excluded
    for note in scan.notes():
        say(f"photos: {note}")
    if scan.excluded:
        say(f"photos: {scan.excluded} files and folders left out by --exclude, never read")
    work.mkdir(parents=True, exist_ok=True)
    from moco.weights.pretrained import resolve

    if checkpoint or init:
        status.stage("model", str(checkpoint or init))
    for given, what in ((checkpoint, "CHECKPOINT"), (init, "INIT")):
        if given and not resolve(given, progress).is_file():  # an official name: fetched (once) here
            raise UserError(f"{what}={given}: file not found (a checkpoint file, or a name from `moco pretrained`)")
    default = None
    if not checkpoint and not init and pretrained:
        status.stage("model", pretrained)
        checkpoint = default = _pretrained(pretrained, say, progress)
    if checkpoint:
        source = resolve(checkpoint)
        hint = f" (--pretrained none: train from scratch; --init {pretrained}: continue from it)" if default else ""
        say(f"training: skipped, using {source}{hint}")
    else:
        status.stage("training", str(work / "run"))
        source = _train(photos, scan, work / "run", plan, say, status)
    status.stage("export", str(work / "backbone.safetensors"))
    backbone = _export(source, work / "backbone.safetensors", say)
    status.stage("indexing", str(work / "index"))
    summary = _index(photos, backbone, work / "index", say, progress, plan.exclude)
    status.index_path, status.index_ready = work / "index", True
    status.stage("ready", str(work / "index"))
    return {"photos": photos, "checkpoint": source, "trained": not checkpoint, "backbone": backbone,
            "index": work / "index", "summary": summary}
