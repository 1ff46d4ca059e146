"""Regenerate BENCHMARKS.md from the JSON results the benchmark scripts wrote to bench/results/.

    python bench/report.py          # `make bench` runs every benchmark, then this

Each section shows the exact command, the figures next to the peer's from the same run, the ratio and
whether the target is met; ``bench/NOTES.md`` (hand-written context: how runs came about, what was
tried) is appended as is. A result that is missing is listed as not run, never made up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _load(name: str) -> Any:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def _head(title: str, command: str, level: int = 2) -> list[str]:
    """A section's title (a heading of ``level``) and the command that produced its figures."""
    return [f"{'#' * level} {title}", "", "```", command, "```", ""]


def _section(result: str, title: str, command: str, level: int = 2) -> tuple[Any, list[str]]:
    """A section's result (None when its script has not run) and its first lines ("_not run_" then)."""
    d = _load(result)
    out = _head(title, d.get("command", command) if isinstance(d, dict) else command, level)
    return d, out if d is not None else [*out, "_not run_", ""]


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def _train() -> list[str]:
    d, out = _section("train_throughput.json", "Training throughput", "python bench/train_throughput.py --steps 15")
    if d is None:
        return out
    s = d["setup"]
    rows = {r["name"]: r for r in d["rows"]}
    ours = next(r for n, r in rows.items() if n.startswith("ours"))
    out += [f"{s['arch']}{' small stem' if s['small_stem'] else ''}, {s['image_size']} px, batch {s['batch_size']}, "
            f"queue {s['queue_size']}, {d['images']} images, {d['warmup']} warm-up + {d['steps']} timed steps.", "",
            "| pipeline | img/s | ours / it |", "|---|---|---|"]
    for name, r in rows.items():
        ratio = "" if r is ours else f"{ours['img_s'] / r['img_s']:.2f}x"
        out.append(f"| {name} | {r['img_s']:.1f} | {ratio} |")
    fp32 = next(r for n, r in rows.items() if "fp32" in n)
    out += ["", f"Target (at least 2.5x lightly fp32): {_verdict(ours['img_s'] / fp32['img_s'] >= 2.5)} "
            f"({ours['img_s'] / fp32['img_s']:.2f}x).", ""]
    return out + _train_repeats(d)


def _train_repeats(last: dict) -> list[str]:
    """Every recorded run of the same command (``train_throughput_run*.json`` and the last one)."""
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("train_throughput_run*.json"))]
    runs = [r for r in runs if r["setup"] == last["setup"]] + [last]
    if len(runs) < 2:
        return []
    names = [r["name"] for r in last["rows"]]
    out = [f"The same command, {len(runs)} runs (the last is the table above):", "",
           "| run | " + " | ".join(names) + " | ours / lightly fp32 |", "|---" * (len(names) + 2) + "|"]
    ratios = []
    for i, run in enumerate(runs, 1):
        rows = {r["name"]: r["img_s"] for r in run["rows"]}
        ours = next(v for n, v in rows.items() if n.startswith("ours"))
        ratios.append(ours / next(v for n, v in rows.items() if "fp32" in n))
        cells = " | ".join(f"{rows[n]:.1f}" if n in rows else "-" for n in names)
        out.append(f"| {i} | {cells} | {ratios[-1]:.2f}x |")
    mean = sum(ratios) / len(ratios)
    out += ["", f"Over all {len(runs)} runs: {min(ratios):.2f}x to {max(ratios):.2f}x, mean {mean:.2f}x "
            f"({_verdict(min(ratios) >= 2.5)} in every run).", ""]
    return out


def _layout() -> list[str]:
    d, out = _section("layout.json", "Memory layout: contiguous vs channels_last", "python bench/layout.py")
    if d is None:
        return out
    out += [f"Median seconds per step ({d['steps']} timed steps per layout, each layout built twice, interleaved). "
            "train: a full MoCo v2 step with split BN over 8 chunks; embed: the backbone in eval mode.", "",
            "| what | model | contiguous | channels_last | speed-up |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['what']} | {r['model']} | {r['contiguous_s']:.3f} s | {r['channels_last_s']:.3f} s "
                   f"| {r['speedup']:.2f}x |")
    faster = all(r["speedup"] > 1 for r in d["rows"])
    out += ["", f"channels_last faster in every case (why `--memory-format auto` uses it for CNNs): "
            f"{'yes' if faster else '**no**'}.", ""]
    return out


def _fashion() -> list[str]:
    title, command = "MoCo v2 and lightly in 20 minutes", "python bench/fashion_mnist.py --minutes 20"
    d, out = _section("fashion_mnist.json", title, command)
    if d is None:
        return out
    s = d["setup"]
    out += [f"MoCo v2, {d['minutes']:.0f} minutes of training each, {s['arch']}, {s['image_size']} px, batch "
            f"{s['batch_size']}, queue {s['queue_size']}; kNN top-1 (k=200, T=0.1) on the 10,000 test images.", "",
            "| | kNN top-1 | steps | images seen |", "|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['name']} | {100 * r['knn_top1']:.2f}% | {r.get('steps', '')} | {r.get('images_seen', '')} |")
    ours = next(r for r in d["rows"] if r["name"].startswith("ours"))
    best_other = max(r["knn_top1"] for r in d["rows"] if r is not ours)
    out += ["", f"Target (ours above every peer): {_verdict(ours['knn_top1'] > best_other)}.", ""]
    if (RESULTS / "fashion_mnist.png").is_file():
        out += ["![kNN top-1 over training minutes](bench/results/fashion_mnist.png)", ""]
    return out


def _embed() -> list[str]:
    d, out = _section("embed_throughput.json", "Embedding throughput", "python bench/embed_throughput.py")
    if d is None:
        return out
    r = d["img_s"]
    out += [f"{d['images']} JPEG photos, {d['arch']}, batch {d['batch']}, {d['precision']}.", "",
            "| pipeline | images/s |", "|---|---|", f"| model-only ceiling | {r['ceiling']:.1f} |",
            f"| **ours** (`Embedder.embed_folder`) | **{r['ours']:.1f}** "
            f"({r['ours'] / r['ceiling']:.0%} of the ceiling) |",
            f"| plain ImageFolder + fp32 loop | {r['plain']:.1f} (ours is {r['ours'] / r['plain']:.2f}x) |", "",
            f"Targets (2x the plain loop, 80% of the ceiling): "
            f"{_verdict(r['ours'] >= 2 * r['plain'] and r['ours'] >= 0.8 * r['ceiling'])}.", ""]
    return out


def _search() -> list[str]:
    files = sorted(f for f in RESULTS.glob("search_*.json") if not f.stem.endswith("_quick"))
    out = ["## Vector search", ""]
    if not files:
        return [*out, "_not run_", ""]
    cmds = sorted({json.loads(f.read_text()).get("command", "python bench/search.py") for f in files})
    out += ["```", *cmds, "```", "",
            "| data | N x D | exact: numpy / FAISS Flat, 1 query (ms) | batched 1,000 (QPS) | approximate index "
            "(tuned) | its recall@10 | 1 query (ms) | QPS | vs Flat | bytes/vector (flat / approx) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for f in files:
        d = json.loads(f.read_text())
        npy, flat, ap = d["numpy"], d["flat"], d.get("approx") or {}
        speed = ap.get("qps", 0) / flat["qps"] if ap else 0.0
        data = d["dist"] + (f" (spread {d['spread']:g})" if d["dist"] == "clustered" else "")
        out.append(
            f"| {data} | {d['n']:,} x {d['dim']} | "
            f"{npy['single_ms_median']:.1f} / {flat['single_ms_median']:.1f} "
            f"| {npy['qps']:.0f} / {flat['qps']:.0f} | {ap.get('factory', '-')} {ap.get('param', '')}="
            f"{ap.get('value', '')} | {ap.get('recall', float('nan')):.3f} | "
            f"{ap.get('single_ms_median', float('nan')):.2f} "
            f"| {ap.get('qps', 0):.0f} | {speed:.1f}x | {flat['bytes_per_vector']:.0f} / "
            f"{ap.get('bytes_per_vector', float('nan')):.0f} |"
        )
        single = npy["single_ms_median"] / flat["single_ms_median"]  # > 1: Flat faster
        flat_single = "met" if single >= 1 else ("tie (within 2%)" if single >= 0.98 else "not met")
        ap_single = flat["single_ms_median"] / ap["single_ms_median"] if ap else 0.0
        approx_ok = bool(ap) and ap["recall"] >= 0.95
        verdicts.append(
            f"- {data} {d['n']:,} x {d['dim']}: Flat vs numpy batched {flat['qps'] / npy['qps']:.2f}x "
            f"({_verdict(flat['qps'] >= npy['qps'])}), single query {single:.2f}x (**{flat_single}**); "
            f"approximate vs Flat at recall@10 {ap.get('recall', float('nan')):.3f}: batched {speed:.1f}x "
            f"({_verdict(approx_ok and speed >= 20)}), single query {ap_single:.1f}x "
            f"({_verdict(approx_ok and ap_single >= 20)})"
        )
    return [*out, "", *verdicts, ""]


BEFORE_API = 13.6  # searches/s of the page under 16 clients before the JSON API (issue 32's starting point)


def _ui() -> list[str]:
    d, out = _section("ui_load.json", "Search UI under load", "python bench/ui_load.py")
    if d is None:
        return out
    if "api" not in d:  # a result from before the JSON API: the page only
        return [*out, f"`moco serve` on a {d['images']:,}-image index, {d['clients']} concurrent `gradio_client` "
                f"clients: p50 {d['p50_ms']:.0f} ms, p99 {d['p99_ms']:.0f} ms, {d['searches_per_s']:.1f} searches/s, "
                f"{d['errors']} errors.", ""]
    pins = d.get("pinned", {})
    where = (f"the server pinned to CPU {pins['server'][0]}, the load generator (and the in-process row) to CPU "
             f"{pins['load'][0]}" if pins.get("server") else "server and load generator sharing the CPUs")
    out += [f"`moco serve` on a {d['images']:,}-image index, {d['clients']} concurrent clients each uploading a photo "
            f"of the collection per search (k={d.get('k', 12)}); {d['cpu_model']}, {d['cpus']} CPUs, {where}.", "",
            "| | clients | p50 ms | p99 ms | searches/s | errors | 503 (shed) |", "|---|---|---|---|---|---|---|"]
    browser = "page_gradio_client" in d  # since the page's load is driven as the browser does it
    rows = [("JSON API, `POST /api/v1/search`", d["api"], d["clients"]),
            ("the page, as the browser does it (upload, queue, stream)" if browser else "the page, `gradio_client`",
             d["page"], d["clients"])]
    if browser:
        g = d["page_gradio_client"]
        rows.append((f"the page, `gradio_client` threads (their own CPU: {g['load_generator_cpu_s']:.0f} s of "
                     f"{g['wall_s']:.0f} s)", g, d["clients"]))
    rows.append(("JSON API under overload", d["overload"], d["overload"].get("clients")))
    if "soak" in d:
        rows.append((f"JSON API, {d['soak']['seconds'] / 60:.0f}-minute soak", d["soak"], d["clients"]))
    for name, r, n in rows:
        out.append(f"| {name} | {n} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['searches_per_s']:.1f} | "
                   f"{r['errors']} | {r['shed_503']} |")
    out += [f"| the page's handler in-process, one at a time | 1 | {d['in_process_p50_ms']:.0f} | | "
            f"{d['in_process_searches_per_s']:.1f} | | |", ""]
    api, page, over = d["api"], d["page"], d["overload"]
    out += [f"- JSON API p99 under 250 ms: {api['p99_ms']:.0f} ms, {_verdict(api['p99_ms'] < 250)}; at least 5x the "
            f"{BEFORE_API} searches/s of the page before the API: {api['searches_per_s'] / BEFORE_API:.1f}x, "
            f"{_verdict(api['searches_per_s'] >= 5 * BEFORE_API and api['errors'] == 0)}",
            f"- the page's p99 under 1 s: {page['p99_ms']:.0f} ms, {_verdict(page['p99_ms'] < 1000)}",
            f"- overload shed with 503 + Retry-After and no other errors: {over['shed_503']} shed, {over['errors']} "
            f"errors, {_verdict(over['shed_503'] > 0 and over['errors'] == 0)}"]
    if "soak" in d:
        sk = d["soak"]
        grew = sk["rss_end_mb"] - sk["rss_start_mb"]
        out.append(f"- memory over the {sk['seconds']:.0f} s soak: RSS {sk['rss_start_mb']:.0f} -> "
                   f"{sk['rss_end_mb']:.0f} MB, {_verdict(grew < 0.05 * sk['rss_start_mb'] and sk['errors'] == 0)} "
                   "(flat: under 5% growth; the issue asks for 10 minutes)")
    return [*out, ""]


def _ui_search_room() -> list[str]:
    """Issue 53: the API's and the page's searches through their own room (app/search), against the commit before,
    one after the other on one machine (``bench/ui_load.py --phases api,page`` in each checkout, the same index)."""
    this, peer = _load("ui_load_search_room_this.json"), _load("ui_load_search_room_peer.json")
    out = _head("Searches through the search room, before and after", "python bench/ui_load.py --phases api,page "
                "--out ui_load_search_room_this.json   # then the same in a worktree of the commit before", level=3)
    if this is None or peer is None:
        return [*out, "_not run_", ""]
    out += [f"{this['cpu_model']}; `moco serve` on the {this['images']:,}-image index of the section above, "
            f"{this['clients']} clients, the server pinned to one CPU, the load generator to the other; the peer: "
            "commit c1f65a7, the page before app/search (the API called the page's handlers).", "",
            "| | code | p50 ms | p99 ms | searches/s | errors |", "|---|---|---|---|---|---|"]
    for phase, name in (("api", "JSON API, `POST /api/v1/search`"), ("page", "the page, as the browser does it")):
        for who, d in (("this", this), ("peer", peer)):
            r = d[phase]
            out.append(f"| {name} | {who} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['searches_per_s']:.1f} | "
                       f"{r['errors']} |")
    return [*out, ""]


def _cli() -> list[str]:
    d, out = _section("cli_latency.json", "A one-shot search from the command line",
                      "python bench/cli_latency.py --repeats 7")
    if d is None:
        return out
    out += [f"`moco index search IDX PHOTO` on a {d['photos']}-photo index (a random ResNet-18 at 64 px) against its "
            f"floor, Python importing torch, faiss and PIL, in the same run, the commands interleaved; median of "
            f"{d['repeats']} runs each; {d['cpu']}, {d['cores']} cores.", "",
            "| command | CPU s | wall s |", "|---|---|---|"]
    for name, r in d["rows"].items():
        out.append(f"| {name} | {r['cpu_s']:.2f} | {r['wall_s']:.2f} |")
    over = d["search_over_floor_s"]
    out += ["", f"Aim (a search costs at most {d['aim_s']:.0f} CPU-second beyond the floor): {over:.2f} s, "
            f"{_verdict(over <= d['aim_s'])}. A photo that is no image is refused before torch, the index or the "
            "model loads (`not an image`).", ""]
    return out


CHECKPOINTS = (5, 10, 20)  # minutes of training at which the quality table reads each curve
DATASETS = {"fashion": "Fashion-MNIST (leave-one-out on the 10,000 test images)",
            "backgrounds": "gnome-backgrounds crops (held-out crops against the training crops, by source picture)",
            "photos": "crops of 90 desktop pictures (held-out crops against the training crops, by source picture)"}


def _at(curve: list[list[float]], minute: float) -> float | None:
    """kNN top-1 at ``minute`` of training, linear between the two evaluations around it (None past the run)."""
    for (m0, v0), (m1, v1) in zip(curve, curve[1:]):
        if m0 <= minute <= m1:
            return v0 + (v1 - v0) * (minute - m0) / max(m1 - m0, 1e-9)
    return curve[-1][1] if curve and abs(curve[-1][0] - minute) < 0.05 else None


def _run_at(r: dict[str, Any], minute: float, budget: float, space: str = "") -> float | None:
    """A run's kNN top-1 at ``minute``; at the end of its budget, its last figure (its schedule may end early).
    ``space`` "_whitened": the same features whitened on the collection (runs that recorded it)."""
    if f"curve{space}" not in r:
        return None
    return r[f"knn{space or '_top1'}"] if minute >= budget else _at(r[f"curve{space}"], minute)


def _setup_text(r: dict[str, Any], base: dict[str, Any]) -> str:
    if r["name"] == "lightly":
        return "lightly's example, set up like default (fp32, constant lr)"
    setup = r.get("setup", {})
    changed = {k: v for k, v in setup.items() if k != "preset" and base.get(k) != v}
    preset = f"--preset {setup['preset']}: " if setup.get("preset", "v2") != "v2" else ""
    return preset + (", ".join(f"{k} {v}" for k, v in changed.items()) or "—")


def _quality(level: int = 2) -> list[str]:
    """Every 20-minute comparison (one table per result file and protocol), the kNN spaces and the 5-minute
    screens: the record of every round, headings at ``level``."""
    out: list[str] = []
    for ds, what in DATASETS.items():
        extra = sorted(p.name for p in RESULTS.glob(f"quality_per_minute_{ds}_20min_*.json"))  # other protocols
        for name in [f"quality_per_minute_{ds}_20min.json", *extra]:
            out += _quality_table(ds, what, name, level)
    return out + _spaces(level) + _screens(level)


# The runs of the cpu preset as it is today (the ninth round: stages in the whitened embedding), per set.
CURRENT = {"fashion": ["quality_per_minute_fashion_20min_2threads_stages.json",
                       "quality_per_minute_fashion_20min_2threads_stages_seed1.json"],
           "photos": ["quality_per_minute_photos_20min_stages.json"]}
CURRENT_TITLE = "The cpu preset after 20 minutes, as exported"


def _pct(v: float | None) -> str:
    return "" if v is None else f"{100 * v:.2f}%"


def _current_cpu() -> list[str]:
    """One table: what the cpu preset's export embeds after 20 minutes, on every set it was last measured on."""
    out = [f"## {CURRENT_TITLE}", "",
           "kNN top-1 (k=200, T=0.1) of the `cpu` preset's runs as they are today: the network's features at 5, 10 "
           "and 20 minutes, and what the export embeds after the budget (the run's whitening with mirror images and "
           "the pooled layer1-3 outputs; `--whiten`, `--whiten-stages`). Each run's own table, with its command, is "
           "under [Older rounds](#older-rounds).", "",
           "| set | threads | run | steps | img/s | " + " | ".join(f"{m} min" for m in CHECKPOINTS)
           + " | as exported | centred pixels | whitened pixels |",
           "|---|---|---|---|---|" + "---|" * len(CHECKPOINTS) + "---|---|---|"]
    machines: list[str] = []
    for ds, names in CURRENT.items():
        for name in names:
            d = _load(name)
            if d is None:
                continue
            for r in d["rows"]:
                if r.get("knn_exported") is None:
                    continue
                machines += [] if d["cpu"] in machines else [d["cpu"]]
                pixels = next((x["pixels"] for x in d["rows"] if x.get("pixels") is not None), None)
                white = next((x["pixels_whitened"] for x in d["rows"] if x.get("pixels_whitened") is not None), None)
                cells = " | ".join(_pct(_run_at(r, m, d["minutes"])) for m in CHECKPOINTS)
                out.append(f"| {DATASETS[ds].split(' (')[0]} | {d.get('threads', 2)} | {r['name']} | {r['steps']} | "
                           f"{r['img_s']:.0f} | {cells} | **{_pct(r['knn_exported'])}** | {_pct(pixels)} | "
                           f"{_pct(white)} |")
    return [*out, "", f"Machine: {', '.join(machines)}.", ""] if machines else [*out[:2], "_not run_", ""]


def _summary() -> list[str]:
    """The current figure of each question, one line each, with the section that holds it."""
    rows = []
    for ds, names in CURRENT.items():
        runs = [(r, d) for d in map(_load, names) if d for r in d["rows"] if r.get("knn_exported") is not None]
        if runs:
            figures = " / ".join(_pct(r["knn_exported"]) for r, _ in runs)
            pixels = next((x["pixels"] for _, d in runs for x in d["rows"] if x.get("pixels") is not None), None)
            white = next((x["pixels_whitened"] for _, d in runs for x in d["rows"]
                          if x.get("pixels_whitened") is not None), None)
            rows.append(f"| the `cpu` preset, 20 min, as exported: {DATASETS[ds].split(' (')[0]} "
                        f"({runs[0][1].get('threads', 2)} thread(s); {len(runs)} seed(s)) | {figures} | pixels "
                        f"whitened the same way {_pct(white)}, centred {_pct(pixels)} | "
                        f"[{CURRENT_TITLE}](#the-cpu-preset-after-20-minutes-as-exported) |")
    f = _load("fashion_mnist.json")
    if f:
        by = {r["name"].split(" ")[0]: r["knn_top1"] for r in f["rows"]}
        rows.append(f"| MoCo v2, 20 min, ResNet-18 32 px: Fashion-MNIST | {_pct(by.get('ours'))} | lightly "
                    f"{_pct(by.get('lightly'))}, raw pixels {_pct(by.get('raw'))} | "
                    "[MoCo v2 and lightly](#moco-v2-and-lightly-in-20-minutes) |")
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("train_throughput*.json"))]
    if runs:
        def mean(key: str) -> float:
            return sum(next(r["img_s"] for r in run["rows"] if key in r["name"]) for run in runs) / len(runs)
        ours, fp32 = mean("ours"), mean("fp32")
        rows.append(f"| training throughput, ResNet-18 small stem 32 px (mean of {len(runs)} runs) | {ours:.1f} img/s "
                    f"| lightly fp32 {fp32:.1f} img/s ({ours / fp32:.2f}x) | [Training throughput]"
                    "(#training-throughput) |")
    e = _load("embed_throughput.json")
    if e:
        r = e["img_s"]
        rows.append(f"| embedding {e['images']:,} JPEGs, {e['arch']} | {r['ours']:.1f} img/s | plain loop "
                    f"{r['plain']:.1f} img/s ({r['ours'] / r['plain']:.2f}x) | [Embedding throughput]"
                    "(#embedding-throughput) |")
    s = _load("search_clustered_128.json")
    if s and s.get("approx"):
        a = s["approx"]
        rows.append(f"| tuned approximate search, {s['n']:,} x {s['dim']} clustered | {a['single_ms_median']:.2f} ms, "
                    f"{a['qps']:,.0f} QPS at recall@10 {a['recall']:.3f} | Flat {s['flat']['single_ms_median']:.1f} ms,"
                    f" {s['flat']['qps']:,.0f} QPS | [Vector search](#vector-search) |")
    u = _load("ui_load.json")
    if u and "api" in u:
        a, pg = u["api"], u["page"]
        rows.append(f"| the JSON API, {u['clients']} clients, {u['images']:,} photos | p99 {a['p99_ms']:.0f} ms, "
                    f"{a['searches_per_s']:.1f} searches/s, {a['errors']} errors | the page: p99 "
                    f"{pg['p99_ms']:.0f} ms, {pg['searches_per_s']:.1f} searches/s | "
                    "[Search UI under load](#search-ui-under-load) |")
    t = _load("overview_themes_fashion.json")
    if t:
        r, d = t["report"], t["pixel_dims_chosen"]
        row = r["k"][str(r["auto_k"])]
        rows.append(f"| themes of {r['photos']:,} Fashion-MNIST photos ({r['auto_k']}), purity / NMI | "
                    f"{row['ours']['purity']:.3f} / {row['ours']['nmi']:.3f} | k-means on pixels whitened to {d}: "
                    f"{row[f'pixels_{d}']['purity']:.3f} / {row[f'pixels_{d}']['nmi']:.3f} | "
                    "[The whole collection](#the-whole-collection-map-and-themes) |")
    m = _load("multi_query_trained.json")
    if m:
        t, c = m["report"]["table"], m["chosen"]
        rows.append(f"| search with 3 / 5 photos (+ 3 negatives), precision@10, Fashion-MNIST, the rule kept ({c}) | "
                    f"{t[c]['3+0']:.3f} / {t[c]['5+0']:.3f} ({t[c]['3+3']:.3f} / {t[c]['5+3']:.3f}) | one photo "
                    f"{t['one photo']['1+0']:.3f} | [Search with several photos](#search-with-several-photos) |")
    return ["## Current figures", "", "| question | ours | against | section |", "|---|---|---|---|", *rows, ""]


def _quality_table(ds: str, what: str, name: str, level: int = 2) -> list[str]:
    """One 20-minute comparison: each run's kNN top-1 at 5, 10 and 20 minutes, and the target line."""
    protocol = name.removesuffix(".json").split("_20min")[1].strip("_")  # e.g. "2threads_whitened"
    protocol = protocol.replace("threads", " threads per run").replace("_", ", ")
    title = f"Quality per CPU minute: {what.split(' (')[0]}" + (f" ({protocol})" if protocol else "")
    command = f"python bench/quality_per_minute.py --dataset {ds} --minutes 20 --only cpu,default,lightly --evals 20"
    d, out = _section(name, title, command, level)
    if d is None:
        return out
    rows = {r["name"]: r for r in d["rows"]}
    pixels = next((r["pixels"] for r in d["rows"] if r.get("pixels") is not None), None)
    out += [f"{d['cpu']}, {d.get('threads', 2)} thread(s) per run. {what}; kNN k=200, T=0.1. default: MoCo v2, "
            f"{d['base']['arch']}, {d['base']['image_size']} px, batch {d['base']['batch_size']}, queue "
            f"{d['base']['queue_size']}, lr {d['base']['lr']}. Centred pixels: **{100 * (pixels or 0):.2f}%**.",
            "", "| run | setup | steps | img/s | " + " | ".join(f"{m} min" for m in CHECKPOINTS) + " |",
            "|---|---|---|---|" + "---|" * len(CHECKPOINTS)]
    exported = [r for r in d["rows"] if r.get("knn_exported") is not None]
    if exported:  # runs that fitted their whitening (--whiten): what their export embeds, after the budget
        out[-2] += " as exported |"
        out[-1] += "---|"
    for r in d["rows"]:
        cells = [_run_at(r, m, d["minutes"]) for m in CHECKPOINTS] + ([r.get("knn_exported")] if exported else [])
        out.append(f"| {r['name']} | {_setup_text(r, d['base'])} | {r['steps']} | {r['img_s']:.0f} | "
                   + " | ".join("" if v is None else f"{100 * v:.2f}%" for v in cells) + " |")
    if exported:
        mirror = all(r.get("whitening_mirror") for r in exported)  # fitted on mirror-averaged features
        stages = all(r.get("whitening_stages") for r in exported)  # ... with the pooled earlier stages (ninth round)
        fits = ", ".join(f"{r['whitening_s']:.1f} s ({r['name']})" for r in exported
                         if r.get("whitening_s") is not None)
        out += ["", "*As exported*: the same model's kNN top-1 through the whitening its run fitted on (up to 5,000 "
                "of) the training photos after the budget (`--whiten`), which the export carries and every embedding "
                "applies" + (", each photo's features averaged with its mirror image's (`moco.whiten.mirror_features`)"
                             if mirror else "")
                + (", with the pooled outputs of layer1-3 beside the last stage's (`--whiten-stages`)"
                   if stages else "")
                + f"; the fit took {fits}."]
    out += _target(rows, d["minutes"])
    if all("curve_whitened" in r for r in d["rows"]):
        white = d["rows"][0].get("pixels_whitened")
        out += ["", "The same runs' features whitened on the collection (`moco.whiten`: centred, decorrelated by the "
                "Ledoit-Wolf covariance; fitted without labels, as a search index would fit it). Whitened pixels: "
                + ("n/a (over 4,096 dimensions)" if white is None else f"**{100 * white:.2f}%**") + ".", "",
                "| run | " + " | ".join(f"{m} min" for m in CHECKPOINTS) + " |", "|---|" + "---|" * len(CHECKPOINTS)]
        for r in d["rows"]:
            cells = [_run_at(r, m, d["minutes"], "_whitened") for m in CHECKPOINTS]
            out.append(f"| {r['name']} | " + " | ".join("" if v is None else f"{100 * v:.2f}%" for v in cells) + " |")
        out += _target(rows, d["minutes"], "_whitened")
    png = name.replace(".json", ".png")
    plot = [f"![kNN top-1 over training minutes](bench/results/{png})", ""]
    out += ["", *plot] if (RESULTS / png).is_file() else [""]
    return out


def _target(rows: dict[str, dict[str, Any]], budget: float, space: str = "") -> list[str]:
    """The target line: the cpu preset above default and lightly (and the issue's command where it ran) at every
    checkpoint (in ``space``)."""
    if "cpu" not in rows:
        return []
    others = [rows[n] for n in ("default", "lightly", "issue_cmd") if n in rows]
    if not others:
        return []  # nothing ran beside it: no comparison to judge
    cpu = rows["cpu"]
    wins = all((_run_at(cpu, m, budget, space) or 0) > (_run_at(o, m, budget, space) or 0)
               for o in others for m in CHECKPOINTS)
    at = ", ".join(map(str, CHECKPOINTS))
    names = [o["name"] for o in others]
    peers = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    what = "whitened, " if space else ""
    if {"default", "lightly"} <= set(names):
        return ["", f"Target ({what}the cpu preset above {peers} at {at} min): {_verdict(wins)}."]
    return ["", f"Target ({what}the cpu preset above default and lightly at {at} min): above {peers} in this run: "
            f"{_verdict(wins)}."]


def _spaces(level: int = 2) -> list[str]:
    """kNN of one model and of the pixels, as they are, centred and whitened (``bench/knn_spaces.py``)."""
    paths = sorted(RESULTS.glob("knn_spaces_*.json"))
    if not paths:
        return []
    out = [f"{'#' * level} kNN in three spaces: as they are, centred, whitened", "",
           "One trained model per row (how it was trained: the last column), read by `bench/knn_spaces.py`: kNN top-1 "
           "(k=200, T=0.1) of its features as they are (the monitor's figure), centred on the collection (what the "
           "index searches today) and whitened (`moco.whiten`: Ledoit-Wolf shrinkage, what the monitor reports as "
           "whitened; fixed shrinkages 0.01 and 0.1 beside it), and the same for the eval view's pixels. Nothing is "
           "fitted with labels.", "",
           "| set | vectors | raw | centred | whitened (LW) | shrinkage 0.01 | shrinkage 0.1 | LW shrinkage | model |",
           "|---|---|---|---|---|---|---|---|---|"]
    commands = []
    for path in paths:
        d = json.loads(path.read_text())
        commands.append(d["command"])
        for name, r in d["rows"].items():
            what = f"{d['arch']} ({d['model']})" if name == "model" else "pixels"
            cells = [r["raw"], r["centred"], r["whitened"], r["whitened_shrink0.01"], r["whitened_shrink0.1"]]
            how = d["trained"] if name == "model" else ""
            out.append(f"| {d['dataset']} | {what} | " + " | ".join(f"{100 * v:.2f}%" for v in cells)
                       + f" | {r['ledoit_wolf_shrinkage']:.3f} | {how} |")
    return out + ["", d["cpu"] + ".", "", "```", *commands, "```", ""]


def _screens(level: int = 2) -> list[str]:
    out = [f"{'#' * level} Quality per CPU minute: 5-minute screens", "",
           "Every candidate measured for the cpu preset, including the losers: kNN top-1 at the end of a 5-minute "
           "budget. Each file is one protocol (machine, threads per run); compare rows within a table only.",
           ""]
    for path in sorted(RESULTS.glob("quality_per_minute_*_5min*.json")):
        d = json.loads(path.read_text())
        base = next((r for r in d["rows"] if r["name"] == "default"), None)
        pixels = next((r["pixels"] for r in d["rows"] if r.get("pixels") is not None), 0.0)
        command = d.get("command", f"python bench/quality_per_minute.py --minutes 5 --json {path.name}")
        out += ["```", command, "```", "",
                f"{d.get('dataset', 'fashion')}: {d['cpu']}, {d.get('threads', 2)} thread(s) per run; centred pixels "
                f"{100 * pixels:.2f}%; `{path.name}`.", "",
                "| candidate | change from default | steps | img/s | kNN top-1 | vs default |",
                "|---|---|---|---|---|---|"]
        for r in sorted(d["rows"], key=lambda r: -r["knn_top1"]):
            delta = f"{100 * (r['knn_top1'] - base['knn_top1']):+.2f}" if base else ""
            out.append(f"| {r['name']} | {_setup_text(r, d['base'])} | {r['steps']} | {r['img_s']:.0f} | "
                       f"{100 * r['knn_top1']:.2f}% | {delta} |")
        out.append("")
    return out


def _embedding_space() -> list[str]:
    """Issue 28: whitened vs centred by collection size (``bench/space_by_size.py``, its generated tables),
    near-duplicate groups before and after (``bench/dedup_groups.py``), every door's difference (``bench/doors.py``)."""
    out: list[str] = []
    tables = RESULTS / "space_by_size.md"
    if tables.is_file():
        text = "\n" + tables.read_text().strip()
        out += [text.replace("\n### ", "\n#### ").replace("\n## ", "\n### ").strip(), ""]
    dedup = sorted(RESULTS.glob("dedup_groups_*.json"))
    if dedup:
        out += ["### Near-duplicate groups, before and after", "",
                "`python bench/dedup_groups.py RUN PHOTOS --work W --json F`: the index of a labelled set (class "
                "sub-folders; labels only score the groups). Before: single linkage (connected components) at the "
                "fixed threshold of the backbone's kind, as `moco index dedup` grouped until now; after: groups around "
                "a representative (every member within the threshold of it) at the index's calibrated threshold. A "
                "group is pure when every member has its representative's class.", "",
                "| set | threshold | grouping | groups | photos grouped | largest | pure groups | classes in largest |",
                "|---|---|---|---|---|---|---|---|"]
        for path in dedup:
            d = json.loads(path.read_text())
            name = path.stem.removeprefix("dedup_groups_")
            for key, label in (("old_threshold", "fixed"), ("calibrated_threshold", "calibrated")):
                r = d[key]
                for how in ("single_linkage", "representative"):
                    g = r[how]
                    out.append(f"| {name} ({d['photos']} photos) | {label} {r['threshold']} | "
                               f"{how.replace('_', ' ')} | {g['groups']} | {g['grouped_photos']} | {g['largest']} | "
                               f"{g['pure_groups_pct']}% | {g['mixed_classes_in_largest']} |")
            out.append("")
        out += [f"{d['cpu']}, one thread. Calibration of the last: `{json.dumps(d.get('calibration'))}`.", ""]
    for path in sorted(RESULTS.glob("doors_*.json")):
        d = json.loads(path.read_text())
        out += ["### One vector through every door", "",
                f"`python bench/doors.py INDEX --checkpoint CKPT --json bench/results/{path.name}`: {d['photos']} "
                f"photos of the index, each door's largest absolute difference from `Embedder.load(B, space=INDEX)` "
                f"in fp32 (vectors; scores for the CLI and the page). {d['cpu']}.", "",
                "| door | largest difference |", "|---|---|"]
        out += [f"| {k} | {v:.2e} |" for k, v in d["doors"].items()] + [""]
    return (["## The embedding space", ""] + out) if out else []


def _duplicates() -> list[str]:
    """Issue 42: planted copies found as duplicates (``bench/dedup_copies.py``), per set and collection size; the
    tiny results of a random network (the script's test) are left out."""
    out: list[str] = []
    for path in sorted(RESULTS.glob("dedup_copies_*.json")):
        if "tiny" in path.stem:
            continue
        d = json.loads(path.read_text())
        aim = d["aim"]
        if not out:
            out += ["## Duplicates: planted copies found", "",
                    f"Aim: recall >= {aim['recall']} for every edit, pair precision >= {aim['pair_precision']}, no "
                    f"group of more than {aim['largest_distinct']} distinct photos, at the index's default threshold "
                    "(`moco index dedup` as it runs). Recall of an edit: the share of its copies in their photo's "
                    "group; pair precision: of the pairs of photos in one group, the share that are a photo and its "
                    "copy.", ""]
        edits = d["edits"]
        out += ["```", d.get("command", "python bench/dedup_copies.py --dataset SET --sizes 2000,10000 --backbone B "
                             "--work W --json F"), "```", "",
                f"{d['dataset']} ({d.get('split', 'one')} split), {d['backbone']}, photos of {d['photo_px']} px, "
                f"{d['copies_share']:.1%} given a copy; {d['cpu']}"
                + (f"; a near pair is a copy by its pixels (copy score >= {d['sizes'][0]['copy_score']}, "
                   "index/duplicates/verify.py)" if d["sizes"] and d["sizes"][0].get("copy_score") else
                   "; before the pixel check (a run of an older version)") + ".",
                "",
                "| photos | threshold (rule) | " + " | ".join(f"recall {e}" for e in edits)
                + " | recall | pair precision | largest group (distinct) | the model's pairs the pixel check turned "
                "down | aim |",
                "|---|---|" + "---|" * len(edits) + "---|---|---|---|---|"]
        for r in d["sizes"]:
            ok = (min(r["recall"].values()) >= aim["recall"] and r["pair_precision"] >= aim["pair_precision"]
                  and r["largest_distinct"] <= aim["largest_distinct"])
            out.append(f"| {r['photos']} | {r['threshold']} ({r['rule']}) | "
                       + " | ".join(f"{r['recall'][e]:.3f}" for e in edits)
                       + f" | {r['recall_all']:.3f} | {r['pair_precision']:.3f} ({r['real_pairs']}/{r['pairs']}) | "
                       f"{r['largest_distinct']} | {r.get('turned_down', '-')} | {_verdict(ok)} |")
        out.append("")
    return out


def _dedup_scale() -> list[str]:
    """Issue 52: `moco index dedup` at library sizes (``bench/dedup_scale.py``): time, peak memory, recall per edit,
    beside a peer checkout's search of the same index when the run had one, and the search again after adding 1%."""
    d, out = _section("dedup_scale.json", "Duplicates at library sizes",
                      "python bench/dedup_scale.py --sizes 10000,100000 --work W --json bench/results/dedup_scale.json")
    if d is None:
        return out
    aim = d["aim"]
    peer = f" The peer: commit {d['peer_commit']}, searching the same index." if d.get("peer_commit") else ""
    out += [f"{d['cpu']}, {d['threads']} threads; {d['backbone']}. Small photos of 32 px with planted copies, large "
            "photos of 1024 px with four copies each (the script's docstring); the search in a process of its own, "
            f"cold (nothing kept from an earlier search).{peer} "
            f"Aims: 100,000 photos in {aim['seconds']['100000'] / 60:.0f} minutes, 1,000,000 in "
            f"{aim['seconds']['1000000'] / 60:.0f}; at most {aim['beyond_index_gb']} GB beyond the index; recall >= "
            f"{aim['recall']} for every edit; pair precision >= {aim['pair_precision']}; no group of more than "
            f"{aim['largest_distinct']} distinct photos; after adding 1% of photos, at most a tenth of the full "
            "search's time.", "",
            "| photos | code | seconds | peak GB (beyond the index) | pairs proposed (checked) | pair precision | "
            "largest group | keeper the original | edits under the recall aim |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in d["sizes"]:
        rows = [("this", r), ("peer", r.get("peer"))]
        if r.get("added"):  # against the full search of its own run (base_seconds) where it came from another run
            base = r["added"].get("base_seconds", r["seconds"])
            ratio = r["added"]["seconds"] / base
            rows.append((f"this, {r['added']['photos_added']} photos added, searched again "
                         f"({ratio:.3f} of the full time, {base} s{'' if ratio <= 0.1 else ': aim not met'})",
                         r["added"]))
        for who, x in rows:
            if x is None:
                continue
            low = ", ".join(f"{e} {v:.2f}" for e, v in x["recall"].items() if v < aim["recall"]) or "none"
            out.append(f"| {r['photos']:,} | {who} | {x['seconds']} | {x['peak_gb']} ({x['beyond_index_gb']}) | "
                       f"{x['proposed']:,} ({x.get('checked', x['proposed']):,}) | {x['pair_precision']:.3f} | "
                       f"{x['largest_distinct']} | {x.get('keeper_is_the_original')} | {low} |")
    out += ["", "Recall of every edit (this code; copies planted in brackets):", ""]
    for r in d["sizes"]:
        out.append(f"- {r['photos']:,} photos: " + ", ".join(f"{e} {v:.3f} ({r['copies'][e]})"
                                                             for e, v in r["recall"].items()))
    out.append("")
    return out


def _pixel_check() -> list[str]:
    """Issue 52: the pixel check's cost a pair against a peer's on the pairs a search kept
    (``bench/pixel_check_ab.py``)."""
    d, out = _section("pixel_check_ab.json", "The pixel check's cost a pair",
                      "python bench/pixel_check_ab.py --index W/10000.idx-added --peer WORKTREE_OF_PEER --pairs 6000",
                      level=3)
    if d is None:
        return out
    return out + [f"{d['cpu']}; the first {d['pairs']:,} pairs (sorted, as a search checks them) that the 10,000-photo "
                  f"search of the section above kept, scored again by this code and by commit {d['peer_commit']}, "
                  "alternating in one process (the best of two runs each).", "",
                  "| code | ms a pair | copies found | pairs that changed side | largest score difference |",
                  "|---|---|---|---|---|",
                  f"| this | {d['ms_a_pair']['this']:.3f} ({d['ratio']:.3f}x) | {d['copies']['this']} | "
                  f"{d['changed_side']} | {d['max_score_difference']:.1e} |",
                  f"| peer | {d['ms_a_pair']['peer']:.3f} | {d['copies']['peer']} | | |", ""]


def _overview() -> list[str]:
    """Issue 43: the map's layout and the themes' time (``bench/overview_layout.py``), the themes' purity on a
    labelled set against k-means on whitened pixels (``bench/overview_themes.py``)."""
    out: list[str] = []
    d = _load("overview_layout.json")
    if d:
        out += _head("Time to lay out and cut into themes", d["command"], level=3)
        out += [f"{d['cpu']}, {d['threads']} thread(s); 512-d unit vectors of a seeded mixture of 64 groups (the "
                "script's docstring); what `moco index map` and `themes` compute once per index version, reading "
                "the vectors from the catalog not counted.", "",
                "| photos | PCA layout | themes (k-means) | themes | UMAP | UMAP's first call (numba compiles) |",
                "|---|---|---|---|---|---|"]
        for r in d["sizes"]:
            umap = f"{r['umap_seconds']:.1f} s" if "umap_seconds" in r else "-"
            first = f"{r['umap_first_call_seconds']:.1f} s" if "umap_first_call_seconds" in r else "-"
            out.append(f"| {r['photos']:,} | {r['pca_seconds']:.2f} s | {r['kmeans_seconds']:.2f} s | {r['themes']} | "
                       f"{umap} | {first} |")
        out.append("")
    d = _load("overview_layout_knn.json")
    if d:
        out += _head("The themes' averaging over each photo's closest photos", d["command"], level=3)
        out += [f"{d['cpu']}, {d['threads']} thread(s); the same vectors: a k-NN search of every photo by the store "
                "`auto` picks (its building and training are the index build's), once per index version, before the "
                "k-means.", "", "| photos | store | k-NN of every photo | k-means |", "|---|---|---|---|"]
        out += [f"| {r['photos']:,} | {r['store']} | {r['knn_seconds']:.1f} s | {r['kmeans_seconds']:.2f} s |"
                for r in d["sizes"]] + [""]
    t = _load("overview_themes_fashion.json")
    if t:
        dim = t["pixel_dims_chosen"]
        out += _head("Themes on a labelled set", t["command"], level=3)
        out += [f"{t['cpu']}, {t['threads']} thread(s); backbone: {t['backbone']}. Fashion-MNIST photos indexed as "
                "PNG files in numbered folders (labels only score): purity (the share of photos in their theme's "
                "majority class) and NMI. The pixels' whitening width was chosen on the choose split (the best "
                f"purity at the automatic k: {dim} components), then used on the report split.", "",
                "| split | photos | k | ours (centred features, each averaged with its 10 closest photos): purity / "
                f"NMI | the same in the search space "
                f"(whitened) | k-means on pixels whitened to {dim} |", "|---|---|---|---|---|---|"]
        for split in ("choose", "report"):
            r = t[split]
            for k, row in r["k"].items():
                px = row[f"pixels_{dim}"]
                ws = row.get("search_space") or {"purity": float("nan"), "nmi": float("nan")}
                out.append(f"| {split} | {r['photos']:,} | {k} | {row['ours']['purity']:.3f} / "
                           f"{row['ours']['nmi']:.3f} | {ws['purity']:.3f} / {ws['nmi']:.3f} | {px['purity']:.3f} / "
                           f"{px['nmi']:.3f} |")
        out.append("")
    return (["## The whole collection: map and themes", ""] + out) if out else []


def _multi_query() -> list[str]:
    """Issue 43: precision@10 of a query of several photos, per rule of ``index.search.query``
    (``bench/multi_query.py``)."""
    out: list[str] = []
    for path in sorted(RESULTS.glob("multi_query*.json")):
        d = json.loads(path.read_text())
        keys = [k for k in d["report"]["table"]["one photo"] if k != "mean"]
        out += [f"### {d['backbone']}", "", "```", d.get("command", "python bench/multi_query.py"), "```", "",
                f"{d['photos']} Fashion-MNIST photos per split ({d['size']} px), {d['report']['trials']} queries each; "
                f"{d.get('cpu', '?')}, one thread. Space: {d['report'].get('space', '?')}. Columns: positives + "
                f"negatives. Best mean on the tuning split: **{d['chosen']}**.", "",
                "| rule | split | " + " | ".join(keys) + " | mean |", "|---|---|" + "---|" * (len(keys) + 1)]
        for name in d["report"]["table"]:
            for split in ("tuning", "report"):
                per = d[split]["table"][name]
                bold = "**" if name == d["chosen"] and split == "report" else ""
                out.append(f"| {name} | {split} | " + " | ".join(f"{per[k]:.3f}" for k in keys)
                           + f" | {bold}{per['mean']:.3f}{bold} |")
        out.append("")
    if not out:
        return []
    return ["## Search with several photos", "",
            "`bench/multi_query.py`: a trial draws a class and 5 of its photos (the first 1, 3 or 5 are the "
            "positives); the 3 negatives are what a person would tick, the first 3 results of another class in the "
            "search with the positives alone. Each query is searched through the index with its own photos left out "
            "(the negatives too, so even `mean`, which ignores them, gains from 3 wrong results taken away); "
            "precision@10 is the share of the 10 results of the drawn class; `one photo` is the first positive's own "
            "search. The doors use the best of the trained model's tuning split (`index.search.query.RULE`, "
            "`BETA`).", "",
            *out]


def _gpu() -> list[str]:
    d, out = _section("gpu_check.json", "The device check on a GPU", "python bench/gpu_check.py")
    if d is None:
        return [*out[:-2], "_not run_: no CUDA machine has been lent to this project yet. The script is ready (about 5 "
                "minutes, one command); tests/test_gpu_check.py runs its steps on the CPU, so that it cannot rot.", ""]
    out += [f"{d['device']} (compute capability {d.get('capability', '?')}), torch {d['torch']}, "
            f"{d['seconds']:.0f} s; mismatches: {len(d['mismatches'])}" + "".join(f"\n- {m}" for m in d["mismatches"]),
            "", "| training | precision | img/s | data ms/step | peak GiB |", "|---|---|---|---|---|"]
    for r in d["train"]["rows"]:
        out.append(f"| {r['preset']} {r['arch']} {r['image_size']} px, batch {r['batch']} | {r['precision']} | "
                   f"{r['img_s']:.0f} | {r['data_ms']:.1f} | {r['peak_gib'] or 0:.2f} |")
    run, fa, em = d.get("run", {}), d["faiss"], d.get("embed", {})
    if run:
        out += ["", f"`moco run`: {run['photos']} photos, {run['steps']} steps, served after {run['ready_s']:.0f} s, "
                f"index {run['kind']} on the {'GPU' if run['index_on_gpu'] else 'CPU'}, an API search "
                f"{run['search_ms']:.0f} ms."]
    out += ["", f"FAISS {fa['faiss']}, {fa['vectors']} vectors of {fa['dim']}: flat on the GPU found the CPU's ids for "
            f"{fa['flat_same_ids']:.1%} of the queries; ivf recall@10 against flat {fa['ivf_recall_at_10']:.3f}; "
            f"flat search {fa['flat_device']['search_ms']:.1f} ms (GPU) against {fa['flat_cpu']['search_ms']:.1f} ms."]
    if em:
        out += ["", f"Embedding {em['photos']} photos: " + ", ".join(f"{w} {em[w]['img_s']:.0f} img/s" for w in em
                                                                    if isinstance(em[w], dict))
                + f"; the smallest cosine between a photo's two vectors {em['min_cosine_device_cpu']:.5f}."]
    return out + [""]


def _map_draw() -> list[str]:
    """Issue 43: the Map tab's drawing in Chromium, 10,000 and 100,000 points (``bench/map_draw.py``)."""
    d = _load("map_draw.json")
    if not d:
        return []
    out = _head("Drawing the Map tab", d["command"], level=3)
    out += [f"{d['cpu']}; {d['browser']}. The page's own map component on a static page, fed the payload the server "
            "sends for a synthetic map (32 themes as Gaussian blobs, 12 folders; no index built). First draw: JSON "
            "parse, decode, the hover grid and the pixels; redraw: colour by folder. Medians of "
            f"{d['repeats']}; a phone's screen at 3 device pixels per CSS pixel, on this CPU, not a phone's.", "",
            "| points | screen | payload | server encodes | first draw | redraw | drawn | a box over half |",
            "|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        v = r["viewport"]
        out.append(f"| {r['points']:,} | {r['screen']} {v['width']}x{v['height']} @{r['device_pixel_ratio']}x | "
                   f"{r['payload_bytes'] / 1e6:.2f} MB | {r['encode_ms']:.0f} ms | {r['first_draw_ms']:.0f} ms | "
                   f"{r['redraw_ms']:.0f} ms | {r['drawn']:,} | {r['selected']:,} selected |")
    return [*out, ""]


def main() -> None:
    head = ["# Benchmarks", "",
            "Generated by `python bench/report.py` (`make bench` runs every script under `bench/` first) from "
            "`bench/results/*.json`. Every figure comes from a script that runs ours and the peer side by side in "
            "the same run on the same machine. Machine: 2 CPU cores (avx512_bf16), 24 GiB RAM, no GPU.",
            ""]
    current = (_summary() + _current_cpu() + _fashion() + _embedding_space() + _duplicates() + _dedup_scale()
               + _pixel_check()
               + _overview()
               + _map_draw() + _train() + _layout() + _embed())
    older = ["## Older rounds", "",
             "Every 20-minute comparison and 5-minute screen of the rounds that chose the `cpu` preset, one table per "
             "result file, kept as measured (earlier rounds' presets, other protocols); how each came about is in "
             "the notes below.", "", *_quality(level=3)]
    body = head + current + _search() + _multi_query() + _ui() + _ui_search_room() + _cli() + _gpu() + older
    notes = ROOT / "bench" / "NOTES.md"
    if notes.is_file():
        body += ["## Notes", "", notes.read_text().strip(), ""]
    (ROOT / "BENCHMARKS.md").write_text("\n".join(body).rstrip() + "\n")
    print(f"wrote {ROOT / 'BENCHMARKS.md'}")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    main()
