"""The test suite cleans up after itself: a session (on two workers, with subprocesses) leaves nothing in the system's
temporary folder; a failed one keeps only its failed tests' folders, until the next session starts. Real pytest
sessions in subprocesses, each with its own system temporary folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import SESSION_TMP_ENV, SESSION_TMP_PREFIX
from .live import run_tree

ROOT = Path(__file__).resolve().parents[1]


def _pytest(system: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m pytest ARGS`` in the checkout, as `make test` starts it, with ``system`` as $TMPDIR."""
    env = {k: v for k, v in os.environ.items()
           if k not in (SESSION_TMP_ENV, "GRADIO_TEMP_DIR", "PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST")
           and not k.startswith("PYTEST_XDIST")}
    env.update(TMPDIR=str(system), PYTHONPATH=str(ROOT))
    return run_tree([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env, timeout=900)


@pytest.mark.slow
def test_a_session_of_the_suite_leaves_nothing_in_the_temporary_folder(tmp_path):
    system = tmp_path / "system-tmp"
    system.mkdir()
    done = _pytest(system, "-n", "2", "--dist", "loadfile", "-q",
                   "tests/test_reliability.py::test_atomic_write_gives_the_mode_of_a_plain_open",
                   "tests/test_reliability.py::test_an_interrupt_right_after_a_temp_file_is_made_leaves_nothing",
                   "tests/test_export.py::test_pt2_and_cli")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "passed" in done.stdout and list(system.iterdir()) == []


def test_a_failed_session_keeps_its_failed_tests_folders_until_the_next(tmp_path):
    system, tests = tmp_path / "system-tmp", tmp_path / "t"
    system.mkdir()
    tests.mkdir()
    (tests / "pytest.ini").write_text("[pytest]\ntmp_path_retention_policy = failed\n")
    (tests / "test_some.py").write_text(
        "import tempfile\n\n"
        "def test_fails(tmp_path):\n    (tmp_path / 'evidence').write_text('x')\n    assert False\n\n"
        "def test_passes(tmp_path):\n    (tmp_path / 'a').write_text('x')\n    tempfile.mkstemp()\n")
    args = ("-c", str(tests / "pytest.ini"), "--rootdir", str(tests), "-p", "tests.conftest", "-q")
    done = _pytest(system, *args, str(tests / "test_some.py"))
    assert done.returncode == 1 and "1 failed, 1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    [kept] = system.iterdir()
    assert kept.name.startswith(SESSION_TMP_PREFIX) and (kept / "pid").read_text() == "0"
    files = sorted(p.relative_to(kept).parts[-2:] for p in kept.rglob("*") if p.is_file() and p.name != "pid")
    assert files == [("test_fails0", "evidence")]  # not the passing test's, nor tempfile's
    done = _pytest(system, *args, "-k", "passes", str(tests / "test_some.py"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(system.iterdir()) == []  # the kept folder went with the next session's start


def test_a_command_past_its_time_is_killed_with_the_processes_it_started(tmp_path):
    """``run_tree``: a command whose child holds its output open (a torchrun rank blocked in a collective) fails the
    test at its timeout, and the child goes with it (where ``subprocess.run`` would wait for the child forever)."""
    import time

    pid_file = tmp_path / "child.pid"
    script = f"sleep 600 & echo $! > {pid_file}; echo started; wait"
    with pytest.raises(pytest.fail.Exception, match=r"ran past 1 s: killed with its processes\n(.|\n)*started"):
        run_tree(["sh", "-c", script], timeout=1)
    stat = Path(f"/proc/{pid_file.read_text().strip()}/stat")
    deadline = time.monotonic() + 60  # a guard against a hang, not a measurement
    while _state(stat) not in ("gone", "Z"):
        assert time.monotonic() < deadline, "the command's child outlived it"
        time.sleep(0.05)


def _state(stat: Path) -> str:
    """A process's state letter from its /proc stat (Z: dead, not yet reaped), or "gone"."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
