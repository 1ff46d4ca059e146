"""Every page of the command line works: `--help` of each subcommand and `python -m` entry point, `--version`."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from moco.config import TrainConfig, add_config_arguments, config_overrides, resolve_config
from tests.conftest import TINY_CLI

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100", OMP_NUM_THREADS="1")

# Every TrainConfig field is a flag of `moco train`, except DATA_DIR, which is positional.
TRAIN_FLAGS = [f"--{f.name.replace('_', '-')}" for f in fields(TrainConfig) if f.name != "data_dir"]
BUILD_FLAGS = ["--backbone", "--out", "-o", "--kind", "--memory-budget", "--exclude", "--batch-size", "--workers",
               "--device", "--gpu", "--quiet", "--json"]
API_FLAGS = ["--api-cors-origin", "--api-token", "--max-batch", "--batch-window-ms", "--max-pending",
             "JSON API"]  # the serving flags
UPDATE_FLAGS = ["--backbone", "--root", "--kind", "--exclude", "--clear-excludes", "--batch-size", "--workers",
                "--device", "--gpu", "--json"]

# The pages of `moco` (DESIGN.md's CLI contract) and what each must list.
PAGES = {
    "": ["train", "export", "embed", "sample", "index", "serve", "run", "--version", "--verbose"],
    "train": ["DATA_DIR", "--resume", "--quiet", "--stop-after", *TRAIN_FLAGS],
    "export": ["CHECKPOINT", "--out", "--arch", "--format", "--image-size"],
    "embed": ["PHOTOS", "--backbone", "--out", "-o", "--space", "--features", "--exclude", "--chunk-size",
              "--batch-size", "--workers", "--device", "--quiet"],
    "sample": ["OUT_DIR", "--per-family", "--size", "--seed"],
    "index": ["build", "update", "search", "stats", "dedup", "map", "themes", "unusual", "browse"],
    "index build": ["PHOTOS", *BUILD_FLAGS],
    "index update": ["IDX", *UPDATE_FLAGS],
    "index search": ["IDX", "IMAGE", "-k", "--folder", "--exclude-folder", "--taken-from", "--taken-to", "--backbone",
                     "--not", "--id", "--not-id", "--deduplicate", "--include-queries", "--json"],
    "index stats": ["IDX", "--json"],
    "index dedup": ["IDX", "--threshold", "--similar-threshold", "--kind", "--group", "--move-to", "--dry-run",
                    "--undo", "--keep", "--not-duplicates", "--exclude-folder", "--device", "--json"],
    "index map": ["IDX", "--out", "-o", "--method", "--refresh", "--json"],
    "index themes": ["IDX", "--themes", "--refresh", "--json"],
    "index unusual": ["IDX", "-n", "--offset", "--json"],
    "index browse": ["IDX", "--folder", "--theme", "--sort", "-n", "--offset", "--json"],
    "serve": ["IDX", "--checkpoint", "--backbone", "--host", "--port", "--auth", "--device", "--trusted-proxy",
              "--allowed-host", *API_FLAGS],
    "run": ["PHOTOS", "--work", "--checkpoint", "--init", "--minutes", "--max-steps", "--exclude", "--no-serve",
            "--host", "--trusted-proxy", "--allowed-host", *API_FLAGS],
}

# One process walks the whole parser tree (so a new subcommand, e.g. `moco pretrained`, is covered too) and runs
# `main([*page, "--help"])` for each page: one torch import instead of one per page.
_ALL_PAGES = r"""
import argparse, contextlib, io, json, sys, traceback
from app.cli import build_parser, main

def pages(parser, path=()):
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from pages(sub, (*path, name))

result = {}
for path in pages(build_parser()):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*path, "--help"])
        except SystemExit as e:
            code = e.code
        except Exception:
            code = "exception"
            traceback.print_exc()
    result[" ".join(path)] = [code, out.getvalue(), err.getvalue()]
json.dump(result, sys.stdout)
"""


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def _missing(text: str, names: list[str]) -> list[str]:
    """The flags/metavars in ``names`` that do not appear in ``text`` as a whole word."""
    return [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]


def _imported(importtime_stderr: str) -> set[str]:
    return set(re.findall(r"^import time:.*\|\s*([\w.]+)\s*$", importtime_stderr, re.M))


@pytest.fixture(scope="module")
def pages() -> dict[str, list]:
    proc = _python("-c", _ALL_PAGES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_every_page_of_the_contract_exists(pages):
    assert set(PAGES) <= set(pages), f"missing pages: {set(PAGES) - set(pages)}"


def test_every_page_exits_0_on_help(pages):
    failed = {page: err[-2000:] for page, (code, _, err) in pages.items() if code != 0 or "Traceback" in err}
    assert not failed, failed


@pytest.mark.parametrize("page", list(PAGES))
def test_page_lists_its_flags(pages, page):
    code, out, err = pages[page]
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert out.startswith(f"usage: moco {page}".rstrip())
    assert not _missing(out, PAGES[page])


def test_train_help_in_a_real_process_lists_every_config_field():
    proc = _python("-m", "app.cli", "train", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not _missing(proc.stdout, TRAIN_FLAGS)
    assert "60% and 80%" in proc.stdout  # a % in a field's help is text, not a format directive


def test_the_parser_and_help_load_no_torch():
    """`moco --help`, `moco index stats` and every page's parser start without torch (it takes seconds to load):
    the trainer, the exporter and the index load it when a command runs."""
    code = ("import sys; from app.cli import build_parser; build_parser(); "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torchvision', 'timm', 'gradio'}); "
            "print(heavy); sys.exit(bool(heavy))")
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_a_query_that_is_no_image_is_refused_before_torch_the_index_or_a_model_loads(backbone, sample_photos,
                                                                                   tmp_path):
    """`moco index search IDX notes.txt` (and a photo too small) exits 2 naming the file, in a process that never
    imported torch, read the index or built a backbone."""
    from index.building.runner import build_index

    build_index(sample_photos, backbone, tmp_path / "idx", progress=False)
    (tmp_path / "notes.jpg").write_text("not a photo")
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "tiny.png")
    for name, says in (("notes.jpg", "not an image"), ("tiny.png", "too small to search with")):
        code = ("import sys; from app.cli import main; rc = main(['index', 'search', sys.argv[1], sys.argv[2]]); "
                "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torchvision', 'timm', 'gradio'}); "
                "print(heavy); sys.exit(rc + 10 * bool(heavy))")
        proc = _python("-c", code, str(tmp_path / "idx"), str(tmp_path / name))
        assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-2000:])
        assert str(tmp_path / name) in proc.stderr and says in proc.stderr, proc.stderr[-2000:]


def test_version():
    import moco

    expected = importlib.metadata.version("moco-retrieval")
    assert moco.__version__ == expected
    proc = _python("-m", "app.cli", "--version")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["moco", expected]


@pytest.mark.parametrize(
    "argv, prog, flags",
    [
        (["moco.training", "--help"], "python -m moco.training",
         ["DATA_DIR", "--resume", "--stop-after", *TRAIN_FLAGS]),
        (["index.building", "--help"], "python -m index.building", ["PHOTOS", *BUILD_FLAGS]),
        (["index.building", "update", "--help"], "python -m index.building update", ["IDX", *UPDATE_FLAGS]),
    ],
)
def test_python_m_entry_points_parse_their_own_flags(argv, prog, flags):
    proc = _python("-X", "importtime", "-m", *argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stdout.startswith(f"usage: {prog}")
    assert not _missing(proc.stdout, flags)
    imported = _imported(proc.stderr)
    assert argv[0] in imported or argv[0].split(".")[0] in imported  # the import log was read
    assert not {m for m in imported if m == "app" or m.startswith("app.")}, "moco/ and index/ never import app/"
    assert "torch" not in imported, "the flags are read before torch loads (--help answers at once)"


def _config_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_config_arguments(parser)
    return parser


def test_every_field_has_its_help_and_default():
    for f in fields(TrainConfig):
        assert f.metadata.get("help", "").strip(), f"TrainConfig.{f.name} has no help text"
    options = [a for a in _config_parser()._actions if a.dest != "help"]
    assert {a.dest for a in options} == {f.name for f in fields(TrainConfig)} - {"data_dir", "out", "preset"}
    for a in options:
        assert "(default: " in a.help and a.help.endswith(")"), (a.dest, a.help)
        assert "%(" not in a.help.replace("%%", ""), (a.dest, a.help)  # no argparse format directives


def test_mean_and_std_flags(capsys):
    args = _config_parser().parse_args(["--mean", "0.5,0.4,0.3", "--std", "0.25, 0.2, 0.2"])
    cfg = resolve_config("v2", **config_overrides(args))
    assert cfg.mean == (0.5, 0.4, 0.3) and cfg.std == (0.25, 0.2, 0.2)
    for argv, word in [(["--std", "0.2,0,0.2"], "positive"), (["--mean", "0.5,0.5"], "three")]:
        with pytest.raises(SystemExit) as e:
            _config_parser().parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert argv[0] in err and argv[1] in err and word in err, err


def test_python_m_moco_train_bad_input_exits_2(sample_photos, tmp_path):
    proc = _python("-m", "moco.training", str(sample_photos), "--out", str(tmp_path / "run"), "--batch-size", "1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--batch-size 1" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
    proc = _python("-m", "moco.training", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "DATA_DIR" in proc.stderr, proc.stderr[-3000:]


def test_python_m_index_build_bad_input_exits_2(sample_photos, tmp_path):
    missing = tmp_path / "nowhere.safetensors"
    proc = _python("-m", "index.building", str(sample_photos), "--backbone", str(missing), "-o", str(tmp_path / "idx"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert str(missing) in proc.stderr and "Traceback" not in proc.stderr
    proc = _python("-m", "index.building", "update", str(tmp_path / "no-index"))
    assert proc.returncode == 2 and "no-index" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_python_m_entry_points_run(sample_photos, backbone, tmp_path):
    run = tmp_path / "run"
    proc = _python("-m", "moco.training", str(sample_photos), "--out", str(run), *TINY_CLI, "--max-steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "checkpoint.pt").is_file() and "trained 1/1 steps" in proc.stdout
    idx = tmp_path / "idx"
    proc = _python("-m", "index.building", str(sample_photos), "--backbone", str(backbone), "-o", str(idx), "--quiet",
                   "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["vectors"] == 48
    proc = _python("-m", "index.building", "update", str(idx), "--quiet", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["unchanged"] == 48


SCRIPTS = sorted(p for p in [*ROOT.glob("bench/*.py"), *ROOT.glob("docs/*.py")]
                 if not p.name.startswith("_") and "argparse" in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_script_has_a_help_page(script):
    """Each benchmark and docs script answers --help (exit 0, its usage) without doing any work."""
    out = subprocess.run([sys.executable, str(script), "--help"], env=ENV, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:") and "--help" in out.stdout


@pytest.mark.parametrize("argv, verbose", [
    (["index", "stats", "IDX", "-v"], True),  # after the subcommand (it exited 2)
    (["-v", "index", "stats", "IDX"], True),  # before it, not undone by the subcommand's own flag
    (["index", "stats", "IDX"], False),
    (["serve", "IDX", "--verbose"], True),
    (["train", "DATA", "--out", "RUN", "-v"], True),
])
def test_verbose_is_taken_before_and_after_the_subcommand(argv: list[str], verbose: bool) -> None:
    from app.cli import build_parser

    assert build_parser().parse_args(argv).verbose is verbose


def test_every_idx_argument_says_what_it_is() -> None:
    from app.cli import build_parser

    def parsers(p: argparse.ArgumentParser):
        yield p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in dict.fromkeys(a.choices.values()):
                    yield from parsers(sub)

    idx = [a for p in parsers(build_parser()) for a in p._actions if a.metavar == "IDX" and not a.option_strings]
    assert len(idx) >= 8 and all(a.help and "index folder" in a.help for a in idx)


def test_serve_help_names_every_tab_of_the_page_and_the_real_connection_default() -> None:
    """`moco serve --help` names the page's tabs as build_ui makes them (read from its source: the help must not
    import gradio), and describes --max-connections' default as the code works it out."""
    from app.cli.serve import PAGE_TABS
    from app.guard.connections import default_max_connections

    tabs = re.findall(r'gr\.Tab\("([^"]+)"', (ROOT / "app" / "page" / "blocks.py").read_text())
    assert len(tabs) >= 8
    named = re.findall(r"([A-Z]\w+)(?= \(|,| and|$)", PAGE_TABS)
    assert named == tabs, (named, tabs)
    out = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--help"], env=ENV, capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert "half the files" in " ".join(out.split()) and "half" in default_max_connections.__doc__
