"""The run's status for the UI: ETA, incremental metrics.jsonl reading, summaries, the training bar, the pipeline."""

from __future__ import annotations

import io
import json

import pytest

from app.run.status import RunStatus, eta_seconds, loss_frame, status_markdown
from moco.config import resolve_config
from moco.training.loop import train
from moco.training.metrics import shown_total
from tests.conftest import TINY


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _records(rates: list[float], total: int | None = 100) -> list[dict]:
    """Per-step records whose step i took ``rates[i-1]`` seconds."""
    out, elapsed = [], 0.0
    for step, dt in enumerate(rates, 1):
        elapsed += dt
        r = {"step": step, "loss": 9.0 - step / 100, "elapsed_s": elapsed, "img_s": 8 / dt}
        if total is not None:
            r["total_steps"] = total
        out.append(r)
    return out


# ---------------------------------------------------------------------------------------------- eta_seconds
def test_eta_at_a_constant_rate():
    assert eta_seconds(_records([0.5] * 30)) == pytest.approx(70 * 0.5)
    assert eta_seconds(_records([0.5] * 100)) == 0.0
    assert eta_seconds(_records([2.0], total=20)) == pytest.approx(19 * 2.0)  # one record: the rate so far


def test_eta_follows_a_slowdown():
    records = _records([0.5] * 20 + [2.0] * 20)
    assert eta_seconds(records) == pytest.approx(60 * 2.0)  # the recent rate, not the run's average
    assert eta_seconds(records, window=40) == pytest.approx(60 * (50 - 0.5) / 39)  # steps 1..40: 49.5 s over 39 steps


def test_eta_is_none_before_the_schedule_is_known():
    assert eta_seconds([]) is None
    assert eta_seconds(_records([0.5] * 8, total=None)) is None
    fitted_then_not = [*_records([0.5] * 3), {"step": 4, "loss": 1.0, "elapsed_s": 2.0}]
    assert eta_seconds(fitted_then_not) is None  # the last record decides
    assert eta_seconds([{"step": 5, "loss": 1.0}]) is None  # no elapsed_s (an older run)


def test_eta_ends_with_the_time_budget():
    """Issue 39: the Status tab said ETA 31 min of a run with a 10-minute budget (steps slower than when its schedule
    was fitted). The run ends at its budget whatever its schedule: the ETA is the earlier of the two ends."""
    records = _records([1.0] * 280 + [6.2] * 20, total=600)  # 404 s spent, 300 steps left at 6.2 s: 31 min
    assert eta_seconds(records) == pytest.approx(300 * 6.2)
    assert eta_seconds(records, budget_s=600.0) == pytest.approx(600 - 404)  # the budget ends it first
    assert eta_seconds(records, budget_s=4000.0) == pytest.approx(300 * 6.2)  # the schedule ends it first
    assert eta_seconds(_records([1.0] * 700, total=800), budget_s=600.0) == 0.0  # spent: it stops at once


def test_the_status_tab_uses_the_runs_budget_and_names_its_skipped_photos(tmp_path):
    """Issue 39: the tab's ETA ignored the run's budget, and it never named the photos that were skipped."""
    from moco.data.cache import write_skipped

    status = RunStatus(tmp_path / "w")
    status.run_dir.mkdir(parents=True)
    (status.run_dir / "metrics.jsonl").write_text(_lines(_records([1.0] * 280 + [6.2] * 20, total=600)))
    assert status.snapshot()["eta_s"] == pytest.approx(300 * 6.2)  # no config.json yet: the schedule's end
    (status.run_dir / "config.json").write_text(json.dumps({"time_budget": 10.0, "preset": "cpu"}))
    snap = status.snapshot()
    assert snap["eta_s"] == pytest.approx(600 - 404) and snap["skipped_count"] == 0
    assert "ETA 3 min 16 s" in status_markdown({**snap, "stage": "training"}) and "Skipped" not in status_markdown(snap)
    skipped = [(f"trip/bad{i:02d}.jpg", "cannot identify image file") for i in range(12)] + [("caf\udce9.jpg", "empty")]
    write_skipped(status.run_dir / "skipped.txt", skipped)
    status.photos_found = 339
    text = status_markdown({**status.snapshot(), "stage": "training"})
    assert "**Skipped** 13 of the 339 photos found" in text and "`trip/bad00.jpg` (cannot identify image file)" in text
    assert "`trip/bad09.jpg`" in text and "bad10" not in text and "and 3 more" in text  # capped: all in skipped.txt
    write_skipped(status.run_dir / "skipped.txt", skipped[-1:])
    text = status_markdown({**status.snapshot(), "stage": "ready"})
    assert "**Skipped** 1 of the 339 photos found" in text and "`caf\\xe9.jpg` (empty)" in text  # re-read, escaped


# ---------------------------------------------------------------------------------------------- snapshot
def _lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_snapshot_reads_metrics_incrementally(tmp_path):
    clock = FakeClock()
    status = RunStatus(tmp_path, clock=clock)
    snap = status.snapshot()  # no run yet
    assert (snap["stage"], snap["step"], snap["total_steps"], snap["loss"], snap["eta_s"]) == ("starting", 0, None,
                                                                                                [], None)
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    records = _records([0.5] * 12, total=None)
    metrics.write_text(_lines(records[:3]))
    snap = status.snapshot()
    assert snap["step"] == 3 and [s for s, _ in snap["loss"]] == [1, 2, 3] and snap["total_steps"] is None
    assert snap["img_s"] == pytest.approx(16.0) and snap["eta_s"] is None
    # Appended lines, and a half-written last one: only the complete lines count.
    half = json.dumps(records[4])
    with metrics.open("a") as f:
        f.write(_lines(records[3:4]) + half[:10])
    assert status.snapshot()["step"] == 4
    # Only the new bytes are read: a change to an earlier line (same length) is not seen.
    text = metrics.read_text()
    metrics.write_text(text.replace('"loss": 8.99', '"loss": 7.99', 1))
    with metrics.open("a") as f:
        f.write(half[10:] + "\n")
    snap = status.snapshot()
    assert snap["step"] == 5 and snap["loss"][0] == (1, 8.99) and [s for s, _ in snap["loss"]] == [1, 2, 3, 4, 5]
    # The schedule fitted, kNN logged: total_steps and the ETA appear.
    fitted = [dict(r, total_steps=40) for r in records[5:12]]
    metrics.open("a").write(_lines([*fitted[:3], {"step": 8, "epoch": 1.0, "knn_top1": 0.5}, *fitted[3:]]))
    snap = status.snapshot()
    assert snap["step"] == 12 and snap["total_steps"] == 40 and snap["knn"] == [(8, 0.5)]
    assert snap["eta_s"] == pytest.approx(28 * 0.5)
    assert status._tail is not None and status._tail.offset == metrics.stat().st_size


def test_snapshot_rereads_a_truncated_or_rewritten_file(tmp_path):
    status = RunStatus(tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    old = _records([0.5] * 10)
    metrics.write_text(_lines(old))
    assert status.snapshot()["step"] == 10
    # Resumed from a checkpoint at step 6: the lines past it dropped (a shorter file), then step 7 again.
    new = [dict(r, loss=1.0) for r in _records([0.7] * 7)[6:]]
    metrics.write_text(_lines(old[:6] + new))
    snap = status.snapshot()
    assert snap["step"] == 7 and snap["loss"][-1] == (7, 1.0) and [s for s, _ in snap["loss"]] == list(range(1, 8))
    # Rewritten again and already longer than before: still noticed, read from the start.
    longer = [dict(r, loss=2.0, pos_sim=0.123456) for r in _records([0.7] * 12)[3:]]
    metrics.write_text(_lines(old[:3] + longer))
    snap = status.snapshot()
    assert snap["step"] == 12 and [s for s, _ in snap["loss"]] == list(range(1, 13))
    assert [v for _, v in snap["loss"][3:]] == [2.0] * 9
    metrics.unlink()  # the run folder removed
    assert status.snapshot()["loss"] == []


def test_records_with_wrong_types_are_ignored_and_said_once(tmp_path, caplog):
    status = RunStatus(tmp_path, clock=FakeClock())
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    good = _records([0.5] * 4)
    odd = [{"step": 5, "loss": "abc", "elapsed_s": "x", "img_s": None, "total_steps": "100"},  # valid JSON, wrong types
           {"step": 6, "epoch": 1.0, "knn_top1": "high", "knn_pixels": [0.1]}, {"step": 7, "loss": True}]
    metrics.write_text(_lines(good + odd))
    with caplog.at_level("WARNING"):
        snap = status.snapshot()
        with metrics.open("a") as f:
            f.write(_lines([{"step": 8, "loss": {"a": 1}}]))
        snap = status.snapshot()
    assert [s for s, _ in snap["loss"]] == [1, 2, 3, 4] and snap["knn"] == [] and snap["knn_pixels"] is None
    assert snap["step"] == 4 and snap["eta_s"] == pytest.approx(96 * 0.5)  # from the good records
    assert "**Training** step 4 / 100" in status_markdown({**snap, "stage": "training"})
    assert len(loss_frame(snap)) == 4
    said = [r.getMessage() for r in caplog.records if "metrics.jsonl" in r.getMessage()]
    assert len(said) == 1 and "'loss'" in said[0] and "'abc'" in said[0] and "step 5" in said[0]


def test_stages_messages_and_clock(tmp_path):
    clock = FakeClock()
    status = RunStatus(tmp_path, clock=clock)
    status.stage("photos", "/photos")
    clock.now += 5
    status.stage("training", "/work/run")
    clock.now += 3
    for i in range(60):
        status.say(f"line {i}")
    snap = status.snapshot()
    assert (snap["stage"], snap["detail"], snap["stage_s"], snap["total_s"]) == ("training", "/work/run", 3, 8)
    assert len(snap["messages"]) == 50 and snap["messages"][-1] == "line 59"
    assert snap["history"] == ["starting", "photos", "training"]
    with pytest.raises(ValueError, match="unknown stage"):
        status.stage("napping")
    status.fail("disk full")
    assert status.snapshot()["stage"] == "failed" and status.error == "disk full"


# ---------------------------------------------------------------------------------------------- summaries
def _snap(**kw) -> dict:
    base = {"stage": "starting", "detail": "", "stage_s": 12.0, "total_s": 20.0, "messages": [], "step": 0,
            "total_steps": None, "loss": [], "knn": [], "img_s": None, "eta_s": None, "error": None}
    return {**base, **kw}


def test_status_markdown_for_each_stage():
    training = _snap(stage="training", step=120, total_steps=640, loss=[(119, 6.3), (120, 6.1234)], img_s=85.0,
                     eta_s=190.0)
    text = status_markdown(training)
    assert "**Training**" in text and "step 120 / 640" in text and "loss 6.12" in text and "ETA 3 min 10 s" in text
    fitting = status_markdown(_snap(stage="training", step=8, loss=[(8, 7.0)]))
    assert "step 8" in fitting and "/" not in fitting.split("step 8")[1].split("·")[0]
    assert "fitting the schedule to the time budget (ETA after step 10)" in fitting
    assert "starting" in status_markdown(_snap(stage="training", detail="/w/run"))
    assert "kNN top-1 42.0%" in status_markdown(_snap(stage="training", step=3, total_steps=9, knn=[(0, 0.42)]))
    assert "ETA 1 h 2 min" in status_markdown(_snap(stage="training", step=3, total_steps=9, eta_s=3725.0))
    assert status_markdown(_snap(stage="indexing", detail="/w/index")).startswith("**Indexing**: /w/index")
    assert status_markdown(_snap(stage="photos", detail="/p")).startswith("**Photos**")
    assert status_markdown(_snap(stage="export")).startswith("**Export**")
    assert status_markdown(_snap(stage="model", detail="moco_v2_800ep")).startswith("**Model**: moco_v2_800ep")
    assert status_markdown(_snap(stage="ready")) == "**Ready**: search is on"
    assert status_markdown(_snap(stage="failed", error="no photos")) == "**Failed**: no photos"


def test_loss_frame():
    frame = loss_frame(_snap(loss=[(1, 9.0), (2, 8.5)], knn=[(0, 0.2), (2, 0.3)]))
    assert list(frame.columns) == ["step", "value", "series"]
    assert frame["series"].tolist() == ["loss", "loss", "kNN top-1", "kNN top-1"]
    assert frame["step"].tolist() == [1, 2, 0, 2] and frame["value"].tolist() == [9.0, 8.5, 0.2, 0.3]
    assert list(loss_frame(_snap()).columns) == ["step", "value", "series"]
    long = loss_frame(_snap(loss=[(s, 1.0) for s in range(1, 10_002)]))
    assert len(long) <= 2002 and long["step"].iloc[-1] == 10_001  # thinned, the last point kept


# ---------------------------------------------------------------------------------------------- training bar
def _cfg(data, run, **kw):
    return resolve_config("v2", data_dir=str(data), out=str(run), **{**TINY, **kw})


def test_bar_shows_no_total_until_the_schedule_is_known():
    from tqdm import tqdm

    assert shown_total(600, schedule_known=False) is None
    assert shown_total(600, schedule_known=True) == 600
    bar = tqdm(total=shown_total(600, False), unit="step", file=io.StringIO())
    bar.update(5)
    assert "<" not in str(bar) and "/600" not in str(bar)  # steps and rate only: no ETA
    bar.total = 40
    bar.refresh()
    assert "5/40" in str(bar) and "<" in str(bar)  # elapsed<remaining: the ETA
    bar.close()


def test_budget_run_logs_total_steps_once_fitted(sample_photos, tmp_path, capsys):
    """A time budget long enough never to end the run (stop_after does): no wall-clock dependence."""
    run = tmp_path / "run"
    summary = train(_cfg(sample_photos, run, epochs=100_000, time_budget=30.0), stop_after=12)
    assert summary.steps == 12 and summary.total_steps > 12  # fitted (to at most the 600,000 planned)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all("total_steps" not in r for r in records[:10])  # the fit happens after step 10's record
    assert all(r["total_steps"] == summary.total_steps for r in records[10:])
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    err = capsys.readouterr().err.replace("\r", "\n")
    shown = [line for line in err.splitlines() if "step/s" in line or "s/step" in line]  # the bar's (slow: s/step)
    fit = next(i for i, line in enumerate(shown) if f"10/{summary.total_steps}" in line)
    assert fit > 0 and not any("%" in line or "<" in line for line in shown[:fit])  # no total, no ETA: steps, rate
    assert all("%" in line and "<" in line for line in shown[fit:])  # the fitted total, with an ETA
    # Resumed: the fitted schedule is known from the first step.
    again = train(_cfg(sample_photos, run, epochs=100_000, time_budget=30.0), resume=True, progress=False,
                  stop_after=14)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert again.steps == 14 and all(r["total_steps"] == summary.total_steps for r in records[10:])


def test_fixed_schedule_logs_total_steps_from_the_start(sample_photos, tmp_path):
    run = tmp_path / "run"
    train(_cfg(sample_photos, run, max_steps=3, time_budget=5.0), progress=False)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["total_steps"] for r in records] == [3, 3, 3] and all(r["elapsed_s"] > 0 for r in records)


# ---------------------------------------------------------------------------------------------- the pipeline
@pytest.mark.slow
def test_pipeline_reports_its_stages(sample_photos, tmp_path):
    from app.run.pipeline import run_pipeline

    status = RunStatus(tmp_path / "w")
    said: list[str] = []
    seen: list[dict] = []

    def say(message: str) -> None:
        said.append(message)
        if message.startswith("export:"):
            seen.append(status.snapshot())  # the UI polling mid-run

    out = run_pipeline(sample_photos, tmp_path / "w", train_overrides={**TINY, "max_steps": 2}, say=say,
                       progress=False, status=status)
    snap = status.snapshot()
    assert snap["stage"] == "ready" and snap["index_ready"] and snap["index_path"] == out["index"]
    assert snap["history"] == ["starting", "photos", "training", "export", "indexing", "ready"]
    assert snap["messages"] == said and any(m.startswith("index:") for m in said)
    assert seen[0]["stage"] == "export" and seen[0]["step"] == 2 and seen[0]["total_steps"] == 2
    assert [s for s, _ in seen[0]["loss"]] == [1, 2] and seen[0]["eta_s"] == 0.0
    assert status_markdown(snap) == "**Ready**: search is on"


def test_pipeline_failure_sets_failed(tmp_path):
    from app.run.pipeline import run_pipeline
    from moco.errors import UserError

    status = RunStatus(tmp_path / "w")
    with pytest.raises(UserError, match="photo folder not found"):
        run_pipeline(tmp_path / "missing", tmp_path / "w", say=lambda m: None, progress=False, status=status)
    snap = status.snapshot()
    assert snap["stage"] == "failed" and "photo folder not found" in snap["error"] and not snap["index_ready"]
    assert snap["history"] == ["starting", "photos", "failed"]
    assert status_markdown(snap).startswith("**Failed**: photo folder not found")


def test_pipeline_without_status_is_unchanged(tmp_path):
    from app.run.pipeline import run_pipeline
    from moco.errors import UserError

    with pytest.raises(UserError, match="not both"):
        run_pipeline(tmp_path, tmp_path / "w", checkpoint="a.pth", init="b.pth", say=lambda m: None)
