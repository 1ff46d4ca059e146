"""Shared fixtures: small generated photo collections (never downloaded)."""

from __future__ import annotations

import os

# `make test` runs the files on two workers (pytest-xdist, --dist loadfile): one thread each, as the two cores are
# theirs (two threads each would oversubscribe them). Set before torch or numpy (OpenBLAS) start their thread pools,
# so this process computes as the test's subprocesses do, which inherit it (a whitening fitted in one and compared
# with the other's must come from the same arithmetic).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# The session's temporary folder: every temporary file of the run (pytest's tmp_path, tempfile's, Gradio's uploads,
# the subprocesses') goes into one folder made for it, in the system's temporary folder; the process that made it
# removes it when the session ends (a failed session keeps the failed tests' tmp_path folders, until the next
# session starts). The workers and the subprocesses inherit it through $TMPDIR.
SESSION_TMP_ENV = "MOCO_TEST_TMP"
SESSION_TMP_PREFIX = "moco-tests-"
_made_here: Path | None = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _session_tmp() -> None:
    """Make the session's temporary folder (once, in the first process), after removing those of earlier sessions
    whose process is gone."""
    global _made_here
    if os.environ.get(SESSION_TMP_ENV):
        return
    system = Path(tempfile.gettempdir())
    for old in system.glob(SESSION_TMP_PREFIX + "*"):
        try:
            pid = int((old / "pid").read_text())
        except (OSError, ValueError):  # a session starting right now (or not ours): left alone
            continue
        if pid == 0 or not _alive(pid):
            shutil.rmtree(old, ignore_errors=True)
    _made_here = Path(tempfile.mkdtemp(prefix=SESSION_TMP_PREFIX, dir=system))
    (_made_here / "pid").write_text(str(os.getpid()))
    os.environ[SESSION_TMP_ENV] = os.environ["TMPDIR"] = tempfile.tempdir = str(_made_here)
    os.environ["GRADIO_TEMP_DIR"] = str(_made_here / "gradio")


_session_tmp()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's temporary folder removed by the process that made it; after a failure, all but pytest's own
    folders (which keep only the failed tests')."""
    if _made_here is None:
        return
    failed = getattr(config, "_moco_failed", 0)
    for item in _made_here.iterdir():
        if failed and item.name.startswith("pytest-of-"):
            continue
        shutil.rmtree(item, ignore_errors=True) if item.is_dir() else item.unlink(missing_ok=True)
    if failed:
        (_made_here / "pid").write_text("0")  # ... kept only until the next session
        print(f"\nthe failed tests' temporary folders are kept in {_made_here}")
    else:
        shutil.rmtree(_made_here, ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._moco_failed = session.testsfailed or (exitstatus not in (0, 5))

from moco.data.sample import make_sample_collection  # noqa: E402

# The longest files first: a worker that picks one up late would be left running it alone at the end. Only the order
# of the files changes; the tests inside a file keep theirs.
LONG_FIRST = ["test_readme", "test_train", "test_distributed", "test_browser", "test_api", "test_pipeline",
              "test_index_crash", "test_run_page", "test_memory_bounds", "test_cli_help", "test_pretrained",
              "test_install", "test_export", "test_special_files", "test_run_recovery", "test_ui", "test_fit_resume",
              "test_embed_cli", "test_reliability", "test_run_whitening", "test_status", "test_doors",
              "test_access", "test_isolation"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def sample_photos(tmp_path_factory) -> Path:
    """A generated collection: 6 families x 8 images of 48 px, JPEG and PNG, in family sub-folders."""
    root = tmp_path_factory.mktemp("photos")
    make_sample_collection(root, per_family=8, size=48, seed=0)
    return root


# Tiny but real settings: ResNet-18 with the small stem on 16 px crops, a few steps.
TINY = dict(
    arch="resnet18",
    small_stem=True,
    image_size=16,
    batch_size=8,
    bn_splits=2,
    queue_size=32,
    workers=0,
    save_every_minutes=1000.0,
)

# The same settings as command-line flags.
TINY_CLI = "--arch resnet18 --small-stem --image-size 16 --batch-size 8 --bn-splits 2 --queue-size 16 --workers 0"
TINY_CLI = [*TINY_CLI.split(), "--quiet"]


def random_backbone(folder: Path, image_size: int = 32, seed: int = 0) -> Path:
    """Export a randomly initialized torchvision ResNet-18 (a real model, fast enough for tests)."""
    import torch
    import torchvision

    from moco.export.exporter import export_backbone

    torch.manual_seed(seed)
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), folder / f"tv{seed}.pth")
    out = folder / f"backbone{seed}_{image_size}.safetensors"
    export_backbone(folder / f"tv{seed}.pth", out, image_size=image_size)
    return out


@pytest.fixture(scope="session")
def backbone(tmp_path_factory) -> Path:
    """An exported ResNet-18 backbone (random weights, 32 px input)."""
    return random_backbone(tmp_path_factory.mktemp("backbone"))


@pytest.fixture(autouse=True)
def _restore_logging():
    """`app.cli.main` points logging at the (captured) stderr of its test; undo that after each test."""
    import logging

    root = logging.getLogger()
    before = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in before[0]:
            root.removeHandler(h)
    root.setLevel(before[1])


def trained_index(tmp: Path, photo_size: int = 48) -> dict[str, Path]:
    """A tiny trained v2 run (a real queue with image ids), its exported backbone and an index of its photos.

    Returns the paths: photos, ckpt (RUN/checkpoint.pt), idx, tmp.
    """
    from index.building.runner import build_index
    from moco.config import resolve_config
    from moco.export.exporter import export_backbone
    from moco.training.loop import train

    photos = tmp / "photos"
    make_sample_collection(photos, per_family=6, size=photo_size, seed=2)
    cfg = resolve_config("v2", data_dir=str(photos), out=str(tmp / "run"), **{**TINY, "image_size": 32},
                         max_steps=6, precision="fp32")
    train(cfg, progress=False)
    export_backbone(tmp / "run" / "checkpoint.pt", tmp / "backbone.safetensors")
    build_index(photos, tmp / "backbone.safetensors", tmp / "idx", progress=False)
    return {"photos": photos, "ckpt": tmp / "run" / "checkpoint.pt", "idx": tmp / "idx", "tmp": tmp}
