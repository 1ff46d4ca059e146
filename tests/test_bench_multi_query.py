"""bench/multi_query.py at a tiny size: precision@10 by hand, and a run of the whole script (Fashion-MNIST from
Debian's dataset-fashion-mnist; skipped without it)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench._datasets import FASHION_DIR
from bench.multi_query import CANDIDATES, main, precision_at


def test_precision_at_10_counts_missing_results_as_wrong():
    labels = {i: i % 3 for i in range(30)}
    ids = np.array([0, 3, 6, 1, 9, -1, -1, -1, -1, -1])  # 4 of label 0, one of label 1, five missing
    assert precision_at(ids, labels, 0) == 0.4 and precision_at(ids, labels, 1) == 0.1
    assert precision_at(np.arange(0, 30, 3), labels, 0) == 1.0


@pytest.mark.skipif(not FASHION_DIR.exists(), reason="apt-get install dataset-fashion-mnist")
def test_the_bench_runs_at_a_tiny_size(tmp_path, capsys):
    out = tmp_path / "multi_query.json"
    assert main(["--photos", "120", "--trials", "3", "--size", "32", "--work", str(tmp_path / "work"),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = ["one photo", *(c[0] for c in CANDIDATES)]
    for split in ("tuning", "report"):
        table = report[split]["table"]
        assert list(table) == names and report[split]["photos"] == 120
        assert all(0 <= v <= 1 for per in table.values() for v in per.values())
        # one positive without negatives is the one-photo search for every rule but the logistic one
        assert all(table[n]["1+0"] == table["one photo"]["1+0"] for n in names if not n.startswith("logistic"))
    assert report["chosen"] in names[1:]
    assert "chosen on the tuning split" in capsys.readouterr().out


def test_the_report_tables_every_rule_on_both_splits(tmp_path, monkeypatch):
    from bench import report

    keys = ["1+0", "1+3", "3+0", "3+3", "5+0", "5+3"]
    table = {n: {**{k: 0.5 for k in keys}, "mean": 0.5} for n in ("one photo", "mean", "difference b=0.1")}
    table["difference b=0.1"]["mean"] = 0.75
    split = {"photos": 20, "trials": 3, "seconds": 1.0, "space": "centred", "table": table}
    d = {"backbone": "a test model", "photos": 20, "size": 32, "chosen": "difference b=0.1", "cpu": "Test CPU",
         "command": "python bench/multi_query.py --photos 20", "tuning": split, "report": split}
    (tmp_path / "multi_query_test.json").write_text(json.dumps(d))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    text = "\n".join(report._multi_query())
    assert "## Search with several photos" in text and "### a test model" in text and "Test CPU" in text
    assert "| difference b=0.1 | report | 0.500 | 0.500 | 0.500 | 0.500 | 0.500 | 0.500 | **0.750** |" in text
    assert "| one photo | tuning |" in text and "tuning split: **difference b=0.1**" in text
    monkeypatch.setattr(report, "RESULTS", tmp_path / "none")
    assert report._multi_query() == []
