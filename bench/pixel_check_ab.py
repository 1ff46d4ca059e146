"""The pixel check's cost a pair, this tree's against a peer's, on pairs a real search scored.

Reads an index folder that a duplicate search has left its kept work in (``dedup-frames.bin``, ``dedup-checked.bin``,
see index/duplicates/dedup_cache.py), takes its first ``--pairs`` scored pairs (sorted, as a search checks them: a
photo's
partners together), and scores them with this tree's ``index/duplicates/verify.py`` and with the peer worktree's,
alternating
in one process (the best of ``--rounds`` each). Prints milliseconds a pair for both, their ratio, the copies each
finds (score >= COPY_SCORE) and how many pairs changed side.

    python bench/pixel_check_ab.py --index W/10000.idx-added --peer WORKTREE_OF_AN_OLDER_COMMIT --pairs 6000
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import cpu_model  # noqa: E402
from index.duplicates import verify  # noqa: E402
from index.duplicates.dedup_cache import CHECKED_FILE, FRAMES_FILE, kept_frames, kept_scores  # noqa: E402


def _peer_verify(worktree: Path):  # -> module
    """The peer's index/duplicates/verify.py (index/verify.py before issue 53's move) as a module of its own (it
    imports nothing of ours but moco's errors)."""
    where = next((p for p in (worktree / "index" / "duplicates" / "verify.py", worktree / "index" / "verify.py")
                  if p.is_file()), worktree / "index" / "duplicates" / "verify.py")
    spec = importlib.util.spec_from_file_location("peer_verify", where)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peer_verify"] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, required=True, help="an index folder with a search's kept work")
    p.add_argument("--peer", type=Path, required=True, help="a worktree of the commit to compare with")
    p.add_argument("--pairs", type=int, default=6000, help="scored pairs to check again (default 6000)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each, the best kept (default 2)")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args(argv)
    pairs, _ = kept_scores(args.index / CHECKED_FILE)  # P x 2
    pairs = pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))][: args.pairs]
    frames = kept_frames(args.index / FRAMES_FILE, set(pairs.ravel().tolist()))
    todo = [tuple(x) for x in pairs.tolist() if x[0] in frames and x[1] in frames]
    seconds: dict[str, list[float]] = {"this": [], "peer": []}
    scores: dict[str, np.ndarray] = {}
    for _ in range(args.rounds):
        for name, module in (("peer", _peer_verify(args.peer)), ("this", verify)):
            t0 = time.perf_counter()
            got = module.copy_scores(todo, frames)
            seconds[name].append(time.perf_counter() - t0)
            scores[name] = np.array([got[q] for q in todo])
    copy = {name: s >= verify.COPY_SCORE for name, s in scores.items()}
    peer_commit = subprocess.run(["git", "-C", str(args.peer), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() or None
    out = {"command": "python bench/pixel_check_ab.py --index W/10000.idx-added --peer WORKTREE_OF_PEER --pairs "
                      f"{args.pairs}", "peer_commit": peer_commit, "pairs": len(todo), "cpu": cpu_model(),
           "ms_a_pair": {n: 1000 * min(s) / max(len(todo), 1) for n, s in seconds.items()},
           "ratio": min(seconds["this"]) / min(seconds["peer"]),
           "copies": {n: int(c.sum()) for n, c in copy.items()},
           "changed_side": int((copy["this"] != copy["peer"]).sum()),
           "max_score_difference": float(np.abs(scores["this"] - scores["peer"]).max()) if todo else 0.0}
    print(f"{out['pairs']} pairs: this {out['ms_a_pair']['this']:.3f} ms a pair, peer {out['ms_a_pair']['peer']:.3f} "
          f"({out['ratio']:.3f}x); copies this {out['copies']['this']}, peer {out['copies']['peer']}; "
          f"{out['changed_side']} changed side; scores within {out['max_score_difference']:.1e}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
