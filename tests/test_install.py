"""A light library install: `moco` needs only its core dependencies; faiss and gradio come with extras.

A missing package is simulated faithfully: the subprocess installs an import blocker first (a
``sys.meta_path`` finder raising ModuleNotFoundError, exactly what Python raises for a package that is
not installed), then runs the real CLI or library code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from app.cli.commands import main
from moco.extras import install_hint
from tests.conftest import TINY_CLI
from tests.test_declared_imports import third_party_imports

ROOT = Path(__file__).resolve().parents[1]
NO_UI = "gradio,gradio_client"
NO_EXTRAS = "faiss,gradio,gradio_client,matplotlib"

# python LAUNCHER BLOCKED -m MODULE ARGS... | python LAUNCHER BLOCKED SCRIPT.py
LAUNCHER = """
import importlib.abc, runpy, sys

BLOCKED = set(sys.argv[1].split(","))


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
if sys.argv[2] == "-m":
    sys.argv = sys.argv[3:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(tmp_path: Path, blocked: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``-m MODULE ARGS`` or a script in a fresh interpreter where the ``blocked`` packages are missing."""
    launcher = tmp_path / "not_installed.py"
    launcher.write_text(LAUNCHER)
    return subprocess.run([sys.executable, str(launcher), blocked, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


# ------------------------------------------------------------------------------------------ pyproject
def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement string ("faiss-cpu>=1.13" -> "faiss-cpu")."""
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _third_party_imports(folder: Path) -> tuple[set[str], set[str]]:
    """Top-level third-party modules imported by ``folder/*.py``: (at module level, elsewhere: in functions, under
    try or if), as :func:`tests.test_declared_imports.third_party_imports` walks them."""
    under = folder.relative_to(ROOT).as_posix() + "/"
    found = [i for i in third_party_imports() if i.where.startswith(under)]
    return {i.module for i in found if i.module_level}, {i.module for i in found if not i.module_level}


def test_core_dependencies_are_the_light_set():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    assert core == {"torch", "torchvision", "timm", "pillow", "numpy", "safetensors", "tqdm", "filelock",
                    "platformdirs"}  # the last two: installed with torch anyway (filelock), or a few kB
    extras = {k: {_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    extras_text = {k: " ".join(v) for k, v in project["optional-dependencies"].items()}
    assert extras["index"] == {"faiss-cpu"}
    assert "gradio" in extras["ui"] and not extras["ui"] & {"faiss-cpu", "faiss-gpu"}  # the page brings no FAISS:
    # `[index,ui]` or `[gpu,ui]`, never both builds; the rest of `ui` is what the server imports itself (fastapi, ...)
    assert extras["gpu"] == {"faiss-gpu"} and "moco-retrieval[index" in extras_text["all"]
    assert "tensorboard" in extras["tensorboard"]
    assert all(f"[{name}" in extras_text["all"] or f",{name}" in extras_text["all"]
               for name in ("ui", "tensorboard", "plot", "heic", "raw"))
    assert extras["heic"] == {"pillow-heif"} and extras["raw"] == {"rawpy"}  # photos as phones and cameras keep them
    assert extras["map"] == {"umap-learn"} and "map" not in extras_text["all"]  # numba & co. only when asked for

    # every package `moco` imports is declared: at module level a core one, inside functions core or an extra
    top, inner = _third_party_imports(ROOT / "moco")
    dist = {m: {_name(d) for d in ds} for m, ds in packages_distributions().items()}
    optional = set().union(*extras.values())
    for module in top:
        assert dist[module] & core, f"moco imports {module} at module level, but {dist[module]} is not core"
    for module in inner:
        assert dist[module] & (core | optional), f"moco imports {module} ({dist[module]}), declared nowhere"


# ------------------------------------------------------------------------------------------ without extras
def test_light_install_trains_exports_and_embeds(sample_photos, tmp_path):
    run, backbone = tmp_path / "run", tmp_path / "b.safetensors"
    r = _run(tmp_path, NO_EXTRAS, "-m", "app.cli", "train", str(sample_photos), "--out", str(run), *TINY_CLI,
             "--max-steps", "2")
    assert r.returncode == 0, r.stderr
    assert (run / "checkpoint.pt").is_file() and (run / "metrics.jsonl").is_file()
    assert not (run / "curves.png").exists() and "matplotlib" in r.stderr  # skipped, with one line saying why
    r = _run(tmp_path, NO_EXTRAS, "-m", "app.cli", "export", str(run / "checkpoint.pt"), "-o", str(backbone))
    assert r.returncode == 0, r.stderr

    photos = sorted(str(p) for p in sample_photos.rglob("*.jpg"))[:5]
    code = f"""
import json, sys
import numpy as np
import moco
from moco import Embedder
emb = Embedder.load({str(backbone)!r}, device="cpu")
v = emb.embed({photos!r})
loaded = sorted({{m.partition(".")[0] for m in sys.modules}} & {set(NO_EXTRAS.split(","))!r})
print(json.dumps({{"shape": list(v.shape), "norms": np.linalg.norm(v, axis=1).tolist(), "loaded": loaded}}))
"""
    script = tmp_path / "embed.py"
    script.write_text(code)
    r = _run(tmp_path, NO_EXTRAS, str(script))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["shape"] == [5, 512] and out["loaded"] == []
    assert out["norms"] == pytest.approx([1.0] * 5, abs=1e-3)


@pytest.fixture(scope="module")
def index_dir(sample_photos, backbone, tmp_path_factory) -> Path:
    """A real index of the sample photos (built here, where faiss is installed)."""
    out = tmp_path_factory.mktemp("idx") / "idx"
    assert main(["index", "build", str(sample_photos), "--backbone", str(backbone), "-o", str(out), "--quiet"]) == 0
    return out


@pytest.mark.parametrize("blocked", [NO_UI, "faiss", NO_EXTRAS])
def test_serve_without_the_ui_extra_names_it(index_dir, tmp_path, blocked):
    r = _run(tmp_path, blocked, "-m", "app.cli", "serve", str(index_dir), "--port", "7999")
    assert r.returncode == 2, r.stderr
    assert install_hint("ui") in r.stderr and "Traceback" not in r.stderr
    assert "serving on" not in r.stdout


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", ["build", "update", "search", "stats", "dedup"])
def test_index_commands_without_faiss_name_the_index_extra(index_dir, sample_photos, backbone, tmp_path, command):
    new = tmp_path / "new_idx"
    args = {
        "build": [str(sample_photos), "--backbone", str(backbone), "-o", str(new)],
        "update": [str(index_dir)],
        "search": [str(index_dir), str(next(sample_photos.rglob("*.jpg")))],
        "stats": [str(index_dir)],
        "dedup": [str(index_dir)],
    }[command]
    before = _files(index_dir)
    r = _run(tmp_path, "faiss", "-m", "app.cli", "index", command, *args, "--quiet" if command in ("build", "update")
             else "--json")
    assert r.returncode == 2, r.stderr
    assert install_hint("index") in r.stderr and "Traceback" not in r.stderr
    assert not new.exists() and _files(index_dir) == before  # failed before writing anything


def test_two_faiss_builds_in_one_environment_are_refused_naming_both(index_dir, tmp_path):
    """`.[all,gpu]` installs faiss-cpu and faiss-gpu (extras only add): the index commands notice both, by the
    environment's own package metadata (a faiss-gpu dist-info beside this environment's faiss-cpu), before any work."""
    import importlib.metadata

    cpu = importlib.metadata.version("faiss-cpu")
    extra = tmp_path / "site"
    info = extra / "faiss_gpu-1.15.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faiss-gpu\nVersion: 1.15.1\n")
    before = _files(index_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(extra)])}
    r = subprocess.run([sys.executable, "-m", "app.cli", "index", "stats", str(index_dir), "--json"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr
    assert f"two FAISS builds are installed here (faiss-cpu {cpu}, faiss-gpu 1.15.1)" in r.stderr
    assert "pip uninstall -y faiss-gpu" in r.stderr and "Traceback" not in r.stderr
    assert _files(index_dir) == before
    r = subprocess.run([sys.executable, "-m", "app.cli", "index", "stats", str(index_dir), "--json"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr  # one build: as before


def _install_sets() -> dict[str, str]:
    """The extras each documented install asks for: the README's two, the Makefile's and the Dockerfile's."""
    makefile = (ROOT / "Makefile").read_text()
    make = re.findall(r"^EXTRAS \?= (\S+)$", makefile, re.M)  # GPU=1's, then the default's
    docker = re.findall(r'pip install "\./\[([\w,]+)\]"', (ROOT / "Dockerfile").read_text())
    readme = re.findall(r'pip install "\.\[([\w,]+)\]"', (ROOT / "README.md").read_text())
    return {**{f"README {extras}": extras for extras in readme}, "make install GPU=1": make[0],
            "make install": make[1], "docker GPU": docker[0], "docker CPU": docker[1]}


def test_images_and_make_install_the_extras_they_run():
    sets = _install_sets()
    assert sets["docker GPU"] == "gpu,ui,plot,heic,raw" and sets["docker CPU"] == "index,ui,plot,heic,raw"  # iPhones
    assert sets["make install"] == "all,dev"  # make run / make test get everything
    assert set(sets["make install GPU=1"].split(",")) == {"gpu", "ui", "plot", "tensorboard", "onnx", "parquet", "heic",
                                                          "raw", "watch", "dev"}
    makefile = (ROOT / "Makefile").read_text()
    install = makefile.split("$(STAMP): pyproject.toml", 1)[1].split("\ninstall:", 1)[0]  # the install recipe
    assert 'pip install -q -e ".[$(EXTRAS)]"' in install and "--no-deps" not in install  # (make dist: the wheel alone)
    assert "--no-deps" not in (ROOT / "Dockerfile").read_text()  # the GPU FAISS's CUDA libraries come with it


@pytest.mark.slow
def test_every_documented_install_resolves_to_exactly_one_faiss(tmp_path):
    """pip's own resolver, asked what each install would put in a fresh environment (``--dry-run
    --ignore-installed --report``): exactly one of faiss-cpu / faiss-gpu*, and the GPU one with its CUDA runtime."""
    import concurrent.futures
    import importlib.util

    # this tree's metadata from the setuptools at hand (pyproject's build requirement) when there is one: the same
    # requirements, without a fresh build environment for each of the resolutions (about 2 s of CPU each)
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []

    def resolve(extras: str) -> set[str]:
        report = tmp_path / f"{extras}.json"
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                            *isolation, "--report", str(report), f".[{extras}]"], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, (extras, r.stderr[-2000:])
        return {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}

    sets = _install_sets()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        distinct = sorted(set(sets.values()))  # an install documented twice is resolved once
        by_extras = dict(zip(distinct, pool.map(resolve, distinct)))
        resolved = {what: by_extras[extras] for what, extras in sets.items()}
        both = pool.submit(resolve, "all,gpu").result()  # undocumented, and extras only add: pip cannot refuse it
    assert sorted(n for n in both if n == "faiss-cpu" or n.startswith("faiss-gpu")) == ["faiss-cpu", "faiss-gpu"]
    # ... so the environment is refused when the index is opened (test_two_faiss_builds_in_one_environment_...)
    for what, names in resolved.items():
        faiss = sorted(n for n in names if n == "faiss-cpu" or n.startswith("faiss-gpu"))
        want = ["faiss-gpu"] if "gpu" in sets[what].split(",") else ["faiss-cpu"]
        assert faiss == want, (what, sets[what], faiss)
        if want == ["faiss-gpu"]:
            assert {"nvidia-cuda-runtime-cu12", "nvidia-cublas-cu12"} <= names, (what, sorted(names))


@pytest.mark.parametrize(("blocked", "flags", "extra"), [(NO_UI, [], "ui"), ("faiss", ["--no-serve"], "index")])
def test_run_without_its_extras_says_so_before_training(sample_photos, tmp_path, blocked, flags, extra):
    work = tmp_path / "work"
    r = _run(tmp_path, blocked, "-m", "app.cli", "run", str(sample_photos), "--work", str(work), "--max-steps", "2",
             "--quiet", *flags)
    assert r.returncode == 2, r.stderr
    assert install_hint(extra) in r.stderr and "Traceback" not in r.stderr
    assert not list(work.rglob("checkpoint.pt"))  # nothing was trained first


# ------------------------------------------------------------------------------------------ the Makefile
def test_make_run_echoes_its_command_on_one_line(tmp_path):
    r = subprocess.run(["make", "-n", "run", f"VENV={tmp_path / 'venv'}", "PHOTOS=/photos", "MINUTES=3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    command = f"{tmp_path / 'venv'}/bin/moco run /photos --work runs/default --minutes 3 --host 127.0.0.1 --port 7860"
    assert command in r.stdout.splitlines(), r.stdout  # one line, as it runs
    assert "\\\n" not in r.stdout


APT = """#!/bin/sh
echo "$(basename "$0") $*" >> "$LOG"
case "$(basename "$0") $*" in
  "apt-cache show chromium") exit "$KNOWN" ;;
  "apt-get -s install"*) printf 'Inst chromium (1 Debian)\\n%b' "$UPGRADES" ;;
esac
"""


@pytest.mark.parametrize(("known", "upgrades", "fails"), [(0, "", False), (1, "", False),
                                                      (0, "Inst libc6 [2.36-9] (2.36-10 Debian)\n", False),
                                                      (0, "", True)])
def test_make_test_installs_chromium_and_what_it_requires(tmp_path, known, upgrades, fails):
    """The chromium rule, run by make with apt-get/apt-cache stand-ins that record their calls (as root: no sudo).
    Issue 39: the rule refused an install that upgraded a package chromium's dependencies require, so `make test`
    stopped on a fresh machine; it installs them as `apt-get install chromium` does, and says which it upgrades."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for tool in ("apt-get", "apt-cache"):
        (bin_dir / tool).write_text(APT + ('[ "$1" = install ] && exit 100\n' if fails else ""))
        (bin_dir / tool).chmod(0o755)
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")
    (bin_dir / "id").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log), "KNOWN": str(known), "UPGRADES": upgrades}
    r = subprocess.run(["make", str(tmp_path / "chromium"), f"CHROMIUM={tmp_path / 'chromium'}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines()
    assert "chromium is missing: installing it and what it depends on" in r.stdout.splitlines()[0]  # said first
    assert ("apt-get update -qq" in calls) == bool(known)  # the lists updated only when chromium is unknown
    assert [c for c in calls if c.startswith("apt-get install")] == ["apt-get install -y -qq chromium"]  # plain
    assert ("newer versions of libc6" in r.stdout) == bool(upgrades)  # an upgrade it needs is said, then done
    if fails:
        assert r.returncode != 0 and "installing chromium failed" in r.stderr and "CHROMIUM=" in r.stderr
    else:
        assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_a_wheel_of_make_dist_installs_offline_into_a_fresh_venv_and_searches(tmp_path, sample_photos, backbone):
    """`make dist`'s wheel, installed with no package index into a new environment whose dependencies are the ones
    already on disk (this environment's site-packages, on its path): `moco --version` and a search, run from that
    environment's own files, outside the clone."""
    import importlib.metadata
    import sysconfig

    r = subprocess.run(["make", "-o", "install", "dist", f"DIST={tmp_path / 'dist'}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    wheels = list((tmp_path / "dist").glob("moco_retrieval-*-py3-none-any.whl"))
    assert len(wheels) == 1 and not (ROOT / "build").exists()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    bin_ = venv / "bin"
    purelib = subprocess.run([str(bin_ / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    deps = sysconfig.get_paths()["purelib"]  # this environment's
    (Path(purelib) / "deps-on-disk.pth").write_text(deps + "\n")  # torch, faiss, ... as installed here
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run([str(bin_ / "python"), "-m", "pip", "install", "--no-index", "--no-deps", str(wheels[0])],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def moco(*args: str) -> str:
        out = subprocess.run([str(bin_ / "moco"), *args], capture_output=True, text=True, env=env, cwd=outside,
                             timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    assert moco("--version").strip() == f"moco {importlib.metadata.version('moco-retrieval')}"
    where = subprocess.run([str(bin_ / "python"), "-c", "import moco, index, app; print(moco.__file__, index.__file__,"
                            " app.__file__)"], capture_output=True, text=True, env=env, cwd=outside, check=True)
    assert all(str(venv) in f for f in where.stdout.split()), where.stdout  # the wheel's files, not the clone's
    moco("index", "build", str(sample_photos), "--backbone", str(backbone), "-o", str(tmp_path / "idx"), "--quiet",
         "--device", "cpu")
    query = sorted(sample_photos.rglob("*.jpg"))[2]
    search = ["index", "search", str(tmp_path / "idx"), str(query), "-k", "5", "--json"]
    got = json.loads(moco(*search))
    clone = subprocess.run([sys.executable, "-m", "app.cli", *search], capture_output=True, text=True, cwd=ROOT,
                           env={**env, "PYTHONPATH": str(ROOT)}, timeout=600)  # the clone's code, the same index
    assert clone.returncode == 0, clone.stderr
    assert len(got) == 5 and got == json.loads(clone.stdout)
