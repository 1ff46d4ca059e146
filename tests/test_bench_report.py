"""bench/report.py: the quality-per-minute tables read the curves right and judge the target from them."""

from __future__ import annotations

import json

import pytest

from bench import report

BASE = {"arch": "resnet18", "image_size": 32, "batch_size": 256, "queue_size": 4096, "lr": 0.06}


def _quality_text(tmp_path, monkeypatch, results: dict) -> str:
    """The report's quality sections for these result files (name -> content) and nothing else."""
    for name, d in results.items():
        (tmp_path / name).write_text(json.dumps(d))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    return "\n".join(report._quality())


def _row(name, curve, **setup):
    return {"name": name, "setup": setup, "steps": 10, "img_s": 100.0, "knn_top1": curve[-1][1], "curve": curve,
            "pixels": 0.5}


def test_kNN_at_a_minute_is_read_between_the_two_evaluations_around_it():
    curve = [[0.0, 0.5], [4.0, 0.6], [6.0, 0.7], [20.0, 0.9]]
    assert report._at(curve, 5) == pytest.approx(0.65)
    assert report._at(curve, 4) == pytest.approx(0.6) and report._at(curve, 20) == pytest.approx(0.9)
    assert report._at(curve, 21) is None  # past the run: no figure is made up
    assert report._at([[0.0, 0.5], [19.98, 0.8]], 20) == pytest.approx(0.8)  # the end of a 20-minute budget


@pytest.mark.parametrize(("cpu_late", "verdict"), [(0.95, "**met**"), (0.75, "**not met**")])
def test_quality_section_tables_every_run_and_judges_every_checkpoint(tmp_path, monkeypatch, cpu_late, verdict):
    cpu = {**BASE, "arch": "resnet10t"}
    rows = [_row("cpu", [[0, 0.5], [5, 0.8], [10, 0.85], [20, cpu_late]], preset="cpu", **cpu),
            _row("default", [[0, 0.5], [5, 0.7], [10, 0.75], [19.4, 0.8]], preset="v2", **BASE),  # its schedule ended
            _row("lightly", [[0, 0.5], [5, 0.6], [10, 0.65], [20, 0.7]])]
    d = {"minutes": 20, "cpu": "Test CPU", "threads": 1, "base": BASE, "dataset": "fashion", "rows": rows}
    text = _quality_text(tmp_path, monkeypatch, {"quality_per_minute_fashion_20min.json": d,
                                                 "quality_per_minute_fashion_5min.json": {**d, "minutes": 5}})
    assert "| cpu | --preset cpu: arch resnet10t | 10 | 100 | 80.00% | 85.00% | " + f"{100 * cpu_late:.2f}% |" in text
    assert "| lightly | lightly's example" in text and "| default | — | 10 | 100 | 70.00% | 75.00% | 80.00% |" in text
    assert f"at 5, 10, 20 min): {verdict}" in text
    assert "_not run_" in text  # the backgrounds set has no result here: listed as not run
    screen = f"| cpu | --preset cpu: arch resnet10t | 10 | 100 | {100 * cpu_late:.2f}% | {100 * (cpu_late - 0.8):+.2f}"
    assert screen in text  # the 5-minute screen's table: the end of each run against default's


def test_a_second_protocol_gets_its_own_table_judged_against_the_peers_it_ran(tmp_path, monkeypatch):
    rows = [_row("cpu", [[0, 0.5], [5, 0.8], [10, 0.85], [20, 0.9]], preset="cpu", **BASE),
            _row("default", [[0, 0.5], [5, 0.82], [10, 0.8], [20, 0.85]], preset="v2", **BASE)]
    d = {"minutes": 20, "cpu": "Test CPU", "threads": 2, "base": BASE, "dataset": "fashion", "rows": rows}
    text = _quality_text(tmp_path, monkeypatch, {"quality_per_minute_fashion_20min_2threads.json": d})
    assert "## Quality per CPU minute: Fashion-MNIST (2 threads per run)" in text
    assert "Test CPU, 2 thread(s) per run." in text
    assert "above default in this run: **not met**" in text  # default is ahead at 5 minutes


def test_runs_with_whitened_curves_get_a_second_table_judged_in_that_space(tmp_path, monkeypatch):
    rows = [_row("cpu", [[0, 0.5], [5, 0.8], [20, 0.9]], preset="cpu", **BASE),
            _row("default", [[0, 0.5], [5, 0.7], [20, 0.8]], preset="v2", **BASE),
            _row("lightly", [[0, 0.5], [5, 0.6], [20, 0.7]])]
    white = {"cpu": [[0, 0.6], [5, 0.84], [20, 0.86]], "default": [[0, 0.6], [5, 0.85], [20, 0.88]],
             "lightly": [[0, 0.6], [5, 0.7], [20, 0.75]]}
    for r in rows:
        r.update(curve_whitened=white[r["name"]], knn_whitened=white[r["name"]][-1][1], pixels_whitened=0.83)
    d = {"minutes": 20, "cpu": "Test CPU", "threads": 1, "base": BASE, "dataset": "fashion", "rows": rows}
    text = _quality_text(tmp_path, monkeypatch, {"quality_per_minute_fashion_20min_whitened.json": d})
    assert "Whitened pixels: **83.00%**" in text
    assert "| cpu | 84.00% | 84.67% | 86.00% |" in text  # 10 min: between the 5- and 20-minute evaluations
    assert "at 5, 10, 20 min): **met**" in text  # as they are: cpu ahead everywhere
    assert "(whitened, the cpu preset above default and lightly at 5, 10, 20 min): **not met**" in text


def test_the_spaces_section_lists_every_vector_kind_of_every_result(tmp_path, monkeypatch):
    r = {"raw": 0.7, "centred": 0.71, "whitened": 0.8, "whitened_shrink0.01": 0.81, "whitened_shrink0.1": 0.79,
         "ledoit_wolf_shrinkage": 0.002}
    d = {"command": "python bench/knn_spaces.py runs/x --dataset fashion", "cpu": "Test CPU", "dataset": "fashion",
         "model": "runs/x", "arch": "resnet10t", "trained": "moco train ...", "rows": {"model": r, "pixels": r}}
    (tmp_path / "knn_spaces_fashion_x.json").write_text(json.dumps(d))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    text = "\n".join(report._spaces())
    row = "| 70.00% | 71.00% | 80.00% | 81.00% | 79.00% | 0.002 |"
    assert f"| fashion | resnet10t (runs/x) {row} moco train ... |" in text and f"| fashion | pixels {row}  |" in text
    assert "python bench/knn_spaces.py runs/x --dataset fashion" in text


def test_a_run_of_the_cpu_preset_alone_gets_no_target_line(tmp_path, monkeypatch):
    d = {"minutes": 20, "cpu": "Test CPU", "threads": 2, "base": BASE, "dataset": "fashion",
         "rows": [_row("cpu", [[0, 0.5], [20, 0.9]], preset="cpu", **BASE)]}
    text = _quality_text(tmp_path, monkeypatch, {"quality_per_minute_fashion_20min_alone.json": d})
    assert "| cpu | --preset cpu: — | 10 | 100 |" in text and "Target" not in text.split("(alone)")[1].split("## ")[0]


@pytest.mark.parametrize(("issue_late", "verdict"), [(0.8, "**met**"), (0.92, "**not met**")])
def test_the_issues_command_is_judged_beside_default_and_lightly_where_it_ran(tmp_path, monkeypatch, issue_late,
                                                                             verdict):
    rows = [_row("cpu", [[0, 0.2], [5, 0.3], [20, 0.9]], preset="cpu", **BASE),
            _row("default", [[0, 0.2], [5, 0.25], [20, 0.5]], preset="v2", **BASE),
            _row("lightly", [[0, 0.2], [5, 0.22], [20, 0.4]]),
            _row("issue_cmd", [[0, 0.2], [5, 0.28], [20, issue_late]], preset="v2", **BASE, small_stem=True)]
    d = {"minutes": 20, "cpu": "Test CPU", "threads": 1, "base": BASE, "dataset": "photos", "rows": rows}
    text = _quality_text(tmp_path, monkeypatch, {"quality_per_minute_photos_20min.json": d})
    assert "## Quality per CPU minute: crops of 90 desktop pictures" in text
    assert "| issue_cmd | small_stem True |" in text
    assert f"(the cpu preset above default, lightly and issue_cmd at 5, 10, 20 min): {verdict}." in text


def test_a_run_that_fitted_its_whitening_gets_an_as_exported_column_with_the_fit_time(tmp_path, monkeypatch):
    cpu = {**_row("cpu", [[0, 0.5], [5, 0.8], [10, 0.85], [20, 0.9]], preset="cpu", **BASE),
           "knn_exported": 0.9345, "whitening_s": 2.44}
    rows = [cpu, _row("default", [[0, 0.5], [5, 0.7], [10, 0.75], [20, 0.8]], preset="v2", **BASE)]
    d = {"minutes": 20, "cpu": "Test CPU", "threads": 2, "base": BASE, "dataset": "fashion", "rows": rows}
    text = _quality_text(tmp_path, monkeypatch, {"quality_per_minute_fashion_20min_exported.json": d})
    assert "| run | setup | steps | img/s | 5 min | 10 min | 20 min | as exported |" in text
    assert "| cpu | --preset cpu: — | 10 | 100 | 80.00% | 85.00% | 90.00% | 93.45% |" in text
    assert "| default | — | 10 | 100 | 70.00% | 75.00% | 80.00% |  |" in text  # no whitening: an empty cell
    assert "the fit took 2.4 s (cpu)" in text and "mirror image" not in text  # a sixth-round run: plain features
    mirrored = {**d, "rows": [{**cpu, "whitening_mirror": True}, rows[1]]}
    text = _quality_text(tmp_path, monkeypatch, {"quality_per_minute_fashion_20min_exported.json": mirrored})
    assert "each photo's features averaged with its mirror image's" in text and "layer1-3" not in text
    staged = {**d, "rows": [{**cpu, "whitening_mirror": True, "whitening_stages": ["layer1", "layer2", "layer3"]},
                            rows[1]]}
    text = _quality_text(tmp_path, monkeypatch, {"quality_per_minute_fashion_20min_exported.json": staged})
    assert "mirror_features`), with the pooled outputs of layer1-3 beside the last stage's" in text
    plain = _quality_text(tmp_path, monkeypatch, {"quality_per_minute_fashion_20min.json": {**d, "rows": rows[1:]}})
    assert "as exported" not in plain.split("(exported)")[0]  # tables without such a run keep their columns


def test_current_figures_come_first_and_older_rounds_last(tmp_path, monkeypatch):
    """The cpu preset's current runs get one table (and a summary line) before every older round's table."""
    cpu = {**_row("cpu", [[0, 0.5], [5, 0.8], [10, 0.85], [20, 0.9]], preset="cpu", **BASE), "knn_exported": 0.9345,
           "pixels_whitened": 0.6}  # the strongest simple floor, beside the centred pixels
    d = {"minutes": 20, "cpu": "Test CPU", "threads": 2, "base": BASE, "dataset": "fashion", "rows": [cpu]}
    (tmp_path / report.CURRENT["fashion"][0]).write_text(json.dumps(d))
    (tmp_path / "quality_per_minute_fashion_20min.json").write_text(json.dumps({**d, "rows": [_row(
        "default", [[0, 0.5], [20, 0.8]], preset="v2", **BASE)]}))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    report.main()
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| Fashion-MNIST | 2 | cpu | 10 | 100 | 80.00% | 85.00% | 90.00% | **93.45%** | 50.00% | 60.00% |" in text
    floors = "pixels whitened the same way 60.00%, centred 50.00%"
    assert f"Fashion-MNIST (2 thread(s); 1 seed(s)) | 93.45% | {floors}" in text
    assert text.index("## Current figures") < text.index("## The cpu preset after 20 minutes, as exported") \
        < text.index("## Older rounds") < text.index("### Quality per CPU minute: Fashion-MNIST")
