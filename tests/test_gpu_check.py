"""bench/gpu_check.py, the prepared device check, cannot rot before a GPU is lent: its steps run here on the CPU
(faiss-cpu standing in for the GPU index), at small sizes, through the same script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--arch", "resnet18", "--image-size", "32", "--batch-size", "16", "--steps", "2", "--warmup", "1",
         "--presets", "v2,v3", "--photos", "48", "--run-steps", "2", "--vectors", "5000", "--embed-photos", "24"]


def test_without_a_cuda_device_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no CUDA device here" in r.stdout and not out.exists()


@pytest.mark.slow
def test_its_steps_run_on_the_cpu_and_agree(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", *SMALL, "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["mismatches"] == [] and res["device_arg"] == "cpu"
    assert [row["preset"] for row in res["train"]["rows"]] == ["v2", "v3"]
    assert all(row["img_s"] > 0 and row["channels_last"] for row in res["train"]["rows"])
    assert res["run"]["photos"] == 48 and res["run"]["first_is_query"] and not res["run"]["index_on_gpu"]
    assert res["faiss"]["flat_same_ids"] == 1.0 and res["faiss"]["ivf_recall_at_10"] >= 0.9
    assert res["embed"]["photos"] == 24 and res["embed"]["min_cosine_device_cpu"] >= 0.999
