"""README.md's examples run (issue 31): every fenced ``python`` block and every line of a ``bash``/``sh``/``console``
fence, in the README's order, in one folder of generated photos, as a reader would type them.

Each shell line is run, changed only as SUBSTITUTIONS says (small sizes, a free port, this tree's CLI), or listed in
EXCEPTIONS with the reason it cannot run here (internet, GPU, docker, the test suite itself). A line of no known kind
that is not listed fails the test, as does an exception the README no longer has. Inline code names commands in
prose; the fenced lines are the examples.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from moco.data.sample import make_sample_collection

from .live import run_tree

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 350  # issue 31: a manual, not a lab notebook
SHELL_FENCES = {"bash", "sh", "shell", "console"}

# Examples that cannot run here, each with its reason (the line as written, its comment left out).
EXCEPTIONS = {
    "make test": "the README test runs inside `make test` (make test -> pytest -> this file)",
    "make run PHOTOS=~/Pictures INIT=moco_v2_800ep": "internet: downloads moco_v2_800ep (about 200 MB), then trains "
                                                     "a ResNet-50 at 224 px on it",
    "make run GPU=1 PHOTOS=~/Pictures": "GPU: installs faiss-gpu into the venv and needs a CUDA device",
    "pip install .[gpu,ui]": "installs faiss-gpu into this tree's environment; this tree installs itself (`make "
                             "install`), and tests/test_install.py asks pip's resolver what each documented install "
                                          "brings (exactly one FAISS)",
    "make install CPU=1 TORCH_INDEX=URL": "PyTorch's CPU wheel index (URL) is not reachable here; the Makefile's "
                                          "CPU=1 path is read by tests/test_install.py",
    "docker build -t moco-retrieval .": "docker: builds an image from a CUDA base image (internet, a docker daemon)",
    "docker run --gpus all -v ~/Pictures:/photos:ro -v moco-work:/work -p 7860:7860 --env-file moco.env "
    "moco-retrieval": "docker and a GPU (--gpus all), on the image of the line above",
    "torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --nproc_per_node=8 -m moco.training ...": "a second machine "
    "(multi-node; `...` stands for the flags of the line above, which runs)",
}

# How a runnable line is changed before it runs: what, to what, why. Every row must still apply to some example.
TINY_TRAIN = "--image-size 32 --batch-size 8 --bn-splits 2 --queue-size 16 --workers 0 --max-steps 2 --quiet"
SUBSTITUTIONS = [
    ("make run VARS", "the Makefile's own command for VARS (`make -n -o install run VARS`), through this tree's CLI, "
     "+ `--max-steps 2 --no-serve --quiet`", "the same pipeline in seconds; serving is checked by `moco serve`"),
    ("moco train ... / torchrun ... -m moco.training ...", f"+ `{TINY_TRAIN}` (flags given last win)",
     "2 steps at 32 px instead of a run of minutes"),
    ("--arch resnet50", "--arch resnet18", "the same code path, a fifth of the work (and of the ONNX export)"),
    ("torchrun --nproc_per_node=8", "python -m torch.distributed.run --standalone --nproc_per_node=2",
     "2 CPU processes on gloo; --standalone: a free port"),
    ("moco serve ...", "+ `--port FREE`, stopped once the page answers", "it serves until stopped"),
    ("max_steps=200, batch_size=64 (python)", "max_steps=2, batch_size=8", "2 steps instead of 200"),
    ("python bench/SCRIPT.py", "this tree's script, with no CUDA device visible", "gpu_check.py says there is no GPU "
     "and exits 0 (tests/test_gpu_check.py runs its steps on the CPU)"),
]
PYTHON_SUBSTITUTIONS = {"max_steps=200": "max_steps=2", "batch_size=64": "batch_size=8"}

# What the folder the examples run in holds (HOME points at it, so ~/Pictures is one of them):
#   Pictures/               30 generated photos of 32 px in family sub-folders, 6 of them under trips/2024/
#   runs/default/sample/photos/   the sample, small: 24 photos of 32 px where `make run` keeps it (instead of 240
#                           of 96 px that it would generate), so `make run` trains on it
#   query.jpg, a.jpg, b.png  photos the examples name; login.txt, the login of --auth-file (alice:long-secret)
# and $MOCO_HOME is its own, with MOCO_PRETRAINED_URL at a port nothing listens on: the machine is offline, and the
# README says that `make run PHOTOS=...` then trains from scratch, saying why.


@dataclass(frozen=True)
class Example:
    """One example of the README: a python block or one (continued) shell line, with its line number."""

    line: int
    kind: str  # "python" or "shell"
    text: str


def readme_examples(text: str) -> list[Example]:
    """Every fenced python block and every shell line (`\\` continuations joined, `$ ` prompts and comments gone)."""
    found: list[Example] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```\s*([\w-]*)", lines[i])
        if not m:
            i += 1
            continue
        lang, start, i = m.group(1).lower(), i + 1, i + 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        body = lines[start:i]
        i += 1
        if lang == "python":
            found.append(Example(start + 1, "python", "\n".join(body) + "\n"))
        elif lang in SHELL_FENCES:
            found += _shell_lines(body, start + 1)
    return found


def _shell_lines(body: list[str], first: int) -> list[Example]:
    """The commands of a shell fence: continued lines joined, comments and prompts dropped."""
    out: list[Example] = []
    pending, at = "", first
    for n, raw in enumerate(body, first):
        line = raw.strip()
        if not pending:
            at = n
            if line.startswith("$ "):
                line = line[2:]
            elif not line or line.startswith("#"):
                continue
        pending += line[:-1].strip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            command = " ".join(shlex.split(pending, comments=True))  # the line as typed, comment left out
            out.append(Example(at, "shell", command))
            pending = ""
    return out


# ----------------------------------------------------------------------------------------------- running
@dataclass
class Workspace:
    """The folder the examples run in, and the environment they see."""

    root: Path
    env: dict[str, str]


def make_workspace(root: Path) -> Workspace:
    """Generated photos where the examples look for them (see the comment above Example)."""
    make_sample_collection(root / "Pictures", per_family=4, size=32, seed=1)
    make_sample_collection(root / "Pictures" / "trips" / "2024", per_family=1, size=32, seed=2)
    make_sample_collection(root / "runs" / "default" / "sample" / "photos", per_family=4, size=32, seed=0)
    photos = sorted((root / "Pictures").rglob("*.jpg"))
    shutil.copy(photos[0], root / "query.jpg")
    shutil.copy(photos[1], root / "a.jpg")
    png = sorted((root / "Pictures").rglob("*.png"))
    shutil.copy(png[0] if png else photos[2], root / "b.png")
    (root / "login.txt").write_text("alice:long-secret\n")  # a login kept off the command line
    (root / "login.txt").chmod(0o600)
    env = dict(os.environ, HOME=str(root), MOCO_HOME=str(root / ".moco-home"), PYTHONPATH=str(ROOT),
               MOCO_PRETRAINED_URL=f"http://127.0.0.1:{_free_port()}")
    env.pop("XDG_CACHE_HOME", None)
    return Workspace(root, env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _expand(word: str, home: Path) -> str:
    """The shell's tilde expansion, at the start of a word or after `=` (as bash does for VAR=~/x)."""
    return re.sub(r"(^|=)~(?=/|$)", lambda m: m.group(1) + str(home), word)


def _words(example: Example, ws: Workspace) -> list[str]:
    """The example's words after the shell's expansion (its comment is already gone)."""
    return [_expand(w, ws.root) for w in shlex.split(example.text)]


def _run_cli(args: list[str], ws: Workspace) -> tuple[int, str]:
    """`moco ARGS` in this process (`app.cli.main`, what the console script calls), in the workspace and its
    environment: (exit status, output tail)."""
    from app.cli.commands import main

    out, root = io.StringIO(), logging.getLogger()
    handlers, level, cwd, env = list(root.handlers), root.level, os.getcwd(), dict(os.environ)
    try:
        os.chdir(ws.root)
        os.environ.clear()
        os.environ.update(ws.env)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(args)
            except SystemExit as e:  # argparse: a flag the command does not have
                code = e.code if isinstance(e.code, int) else 2
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for h in [h for h in root.handlers if h not in handlers]:  # main() points logging at the output above
            root.removeHandler(h)
        root.setLevel(level)
    return code, out.getvalue()[-3000:]


def _small(words: list[str]) -> list[str]:
    """--arch resnet50 -> resnet18, and the tiny training flags last."""
    words = [("resnet18" if w == "resnet50" and words[i - 1] == "--arch" else w) for i, w in enumerate(words)]
    return [*words, *TINY_TRAIN.split()]


def _make_run(words: list[str], ws: Workspace) -> tuple[int, str]:
    """`make run VARS` as the Makefile would run it, through this tree's CLI, without installing or serving."""
    if shutil.which("make") is None:
        return 1, "make is not installed"
    proc = subprocess.run(["make", "-s", "-f", str(ROOT / "Makefile"), "-n", "-o", "install", *words[1:]],
                          cwd=ws.root, env=ws.env, capture_output=True, text=True, timeout=60)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode or len(lines) != 1 or not shlex.split(lines[0])[0].endswith("/moco"):
        return proc.returncode or 1, f"make -n printed {lines!r}: {proc.stderr[-2000:]}"
    return _run_cli([*shlex.split(lines[0])[1:], "--max-steps", "2", "--no-serve", "--quiet"], ws)


def _torchrun(words: list[str], ws: Workspace) -> tuple[int, str]:
    args = [("--nproc_per_node=2" if w.startswith("--nproc_per_node") else w) for w in words[1:]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *_small(args)]
    env = dict(ws.env, OMP_NUM_THREADS="1")  # one core per process, as tests/test_distributed.py
    proc = run_tree(cmd, cwd=ws.root, env=env, timeout=600)
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:]


def start_server(words: list[str], ws: Workspace) -> tuple[subprocess.Popen, int]:
    """`moco serve ...` on a free port, in the background."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", *words[1:], "--port", str(port)], cwd=ws.root,
                            env=ws.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, port


def wait_for_page(proc: subprocess.Popen, port: int, timeout: float = 240,
                  while_up: Callable[[int], None] | None = None) -> tuple[int, str]:
    """0 once the page answers on ``port`` (then ``while_up(port)`` runs); the server is stopped either way."""
    deadline, answer = time.monotonic() + timeout, None
    while time.monotonic() < deadline and proc.poll() is None and answer is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                answer = r.status
        except OSError:
            time.sleep(0.5)
    if answer == 200 and while_up is not None:
        while_up(port)
    proc.terminate()
    try:
        out = proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
    return (0 if answer == 200 else 1), f"page answered {answer}; {out[-2500:]}"


def run_example(example: Example, ws: Workspace, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run one example as SUBSTITUTIONS says: (exit status, output tail). Servers are left to `run_all`."""
    if example.kind == "python":
        code = example.text
        for old, new in PYTHON_SUBSTITUTIONS.items():
            code = code.replace(old, new)
        proc = subprocess.run([sys.executable, "-c", code], cwd=ws.root, env=env or ws.env, capture_output=True,
                              text=True, timeout=600)
        return proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    words = _words(example, ws)
    if words[:2] == ["make", "run"]:
        return _make_run(words, ws)
    if words[0] == "torchrun":
        return _torchrun(words, ws)
    if words[0] == "moco":
        return _run_cli(_small(words[1:]) if words[1] == "train" else words[1:], ws)
    if words[0] == "python" and words[1].startswith("bench/"):
        proc = subprocess.run([sys.executable, str(ROOT / words[1]), *words[2:]], cwd=ws.root,
                              env=dict(ws.env, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=600)
        return proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    return 1, f"no runner for {words[0]!r}: run it here, or list it in EXCEPTIONS with the reason"


def _api_client(ex: Example) -> bool:
    """A python example that calls the JSON API of a running server (at ``$MOCO_URL``)."""
    return ex.kind == "python" and "MOCO_URL" in ex.text


def run_all(examples: list[Example], ws: Workspace) -> list[str]:
    """Every example not excepted, in order (servers together at the end, the JSON API's clients against the first
    of them while it serves): the failures, described."""
    failures, servers, clients = [], [], [ex for ex in examples if _api_client(ex)]
    for ex in examples:
        if ex.kind == "shell" and ex.text in EXCEPTIONS or _api_client(ex):
            continue
        if ex.kind == "shell" and ex.text.startswith("moco serve "):
            servers.append((ex, *start_server(_words(ex, ws), ws)))
            continue
        started = time.monotonic()
        code, out = run_example(ex, ws)
        print(f"README.md:{ex.line}: {time.monotonic() - started:.1f} s, exit {code}")
        if code:
            failures.append(f"README.md:{ex.line} ({time.monotonic() - started:.0f} s, exit {code}): {ex.text}\n{out}")
    def call_api(port: int) -> None:
        for client in clients:
            code, out = run_example(client, ws, dict(ws.env, MOCO_URL=f"http://127.0.0.1:{port}"))
            print(f"README.md:{client.line}: the JSON API, exit {code}")
            if code or not re.search(r"^1 \S+ ", out, re.M):  # a result of rank 1 printed
                failures.append(f"README.md:{client.line} (exit {code}, against {port}): {client.text}\n{out}")
        clients.clear()  # against one server

    for ex, proc, port in servers:
        code, out = wait_for_page(proc, port, while_up=call_api)
        if code:
            failures.append(f"README.md:{ex.line} (exit {code}): {ex.text}\n{out}")
    if clients:
        failures.append(f"README.md:{clients[0].line}: no `moco serve` example for the JSON API's client to call")
    return failures


# -------------------------------------------------------------------------------------------------- tests
def test_the_readme_is_a_manual_of_at_most_350_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): history goes to bench/NOTES.md"


def test_every_example_has_a_runner_or_a_listed_reason():
    examples = readme_examples(README.read_text())
    shell = {e.text for e in examples if e.kind == "shell"}
    assert not set(EXCEPTIONS) - shell, f"exceptions the README no longer has: {set(EXCEPTIONS) - shell}"
    unknown = [e.text for e in examples if e.kind == "shell" and e.text not in EXCEPTIONS
               and e.text.split()[0] not in ("moco", "make", "torchrun", "python")]
    assert not unknown, f"no runner and no reason: {unknown}"
    code = "".join(e.text for e in examples if e.kind == "python")
    assert all(old in code for old in PYTHON_SUBSTITUTIONS), "a python substitution no longer applies"
    assert any("--arch resnet50" in s for s in shell)
    assert any(s.startswith("torchrun --nproc_per_node=8") for s in shell)
    assert {"python", "shell"} <= {e.kind for e in examples}


def test_fences_lines_prompts_and_continuations_are_parsed_as_typed():
    text = "\n".join(["intro `moco inline` is prose", "```console", "$ moco index stats \\", "    x.idx   # a note",
                      "", "# a comment", "make run PHOTOS=~/P", "```", "```python", "print(1)", "```",
                      "```text", "moco not an example", "```"])
    assert readme_examples(text) == [Example(3, "shell", "moco index stats x.idx"),
                                     Example(7, "shell", "make run PHOTOS=~/P"), Example(10, "python", "print(1)\n")]
    assert _expand("PHOTOS=~/P", Path("/h")) == "PHOTOS=/h/P" and _expand("~/P", Path("/h")) == "/h/P"


def test_a_broken_example_fails(tmp_path):
    """What a README edit that breaks an example meets: a failure naming its line."""
    ws = make_workspace(tmp_path)
    broken = readme_examples("\n".join(["```bash", "moco index stats no-such.idx", "frobnicate --all", "```",
                                        "```python", "import moco", "moco.no_such_function()", "```"]))
    failures = run_all(broken, ws)
    assert len(failures) == 3, failures
    assert failures[0].startswith("README.md:2 (") and "no-such.idx" in failures[0]
    assert "no runner for 'frobnicate'" in failures[1] and "no_such_function" in failures[2]


@pytest.mark.slow  # every example of the README, in order: about two minutes on 2 cores (make test runs it)
def test_every_readme_example_runs(tmp_path):
    ws = make_workspace(tmp_path)
    examples = readme_examples(README.read_text())
    failures = run_all(examples, ws)
    assert not failures, "\n\n".join(failures)
    assert (tmp_path / "runs" / "default" / "sample" / "index" / "index.json").is_file()  # `make run` ran
    assert (tmp_path / "pictures.idx" / "index.json").is_file() and (tmp_path / "idx.onnx").is_file()


def test_the_screenshots_are_of_todays_page():
    """docs/screenshots.py records each picture's sha256 and the tabs the page had when it was taken: every
    picture the README shows is that file, of a page with today's tabs (on a desktop all on screen). A tab added
    without new screenshots fails here."""
    import hashlib
    import json
    import re

    record = json.loads((ROOT / "docs" / "screenshots.json").read_text())
    tabs = re.findall(r'gr\.Tab\("([^"]+)"', (ROOT / "app" / "page" / "blocks.py").read_text())
    shown = re.findall(r'(?:\(|src=")docs/(screenshot[^")]*\.png)', (ROOT / "README.md").read_text())
    assert len(tabs) >= 8 and sorted(set(shown)) == sorted(record), (shown, sorted(record))
    for name, seen in record.items():
        assert hashlib.sha256((ROOT / "docs" / name).read_bytes()).hexdigest() == seen["sha256"], name
        assert sorted(seen["tabs"]) == sorted(tabs), (name, seen["tabs"], tabs)  # a phone: some in a menu
        assert seen["visible"] == (tabs if "phone" not in name else tabs[: len(seen["visible"])]), name
