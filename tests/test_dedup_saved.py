"""The typed values of a search for duplicates (index.duplicates.groups) and their JSON form: a group read back from
its JSON is the same group, and a dedup.json written as the search wrote it before typed groups loads into the same
groups and is written back byte for byte."""

from __future__ import annotations

import json

from index.duplicates.dedup import load_duplicates, write_duplicates
from index.duplicates.groups import OLD_REASON, Group, Member, Ref, SavedSearch, group_id


def _member(i: int, path: str, sim: float) -> dict:
    return {"id": i, "path": path, "thumb": f"thumbs/{i}.jpg", "hash": f"h{i}", "similarity": sim,
            "copy_score": 0.99 if sim < 1 else 1.0, "best_similarity": 0.97, "width": 64, "height": 48,
            "bytes": 1234, "taken": None, "mtime": 1700000000.123}


# as index/duplicates/dedup.py wrote it before the groups were typed (save_duplicates, _group)
TODAY = {"threshold": 0.9, "similar_threshold": 0.8, "rule": "calibrated", "threshold_source": "calibrated on 42",
         "decision": {"threshold": 0.9, "similar_threshold": 0.8, "rule": "calibrated", "kinds": ["exact", "near"],
                      "given": {"threshold": None, "similar_threshold": None, "exclude_folders": []}},
         "kinds": ["exact", "near"], "grouping": "every member within the threshold of its representative",
         "groups": [{"id": group_id("near", [3, 7]), "kind": "near", "size": 2,
                     "representative": {"id": 3, "path": "a/3.jpg"}, "tightest": 0.95, "loosest": 0.95,
                     "keep": "a/3.jpg", "keep_id": 3, "reason": "most pixels (64 x 48)",
                     "members": [_member(3, "a/3.jpg", 1.0), _member(7, "b/7.png", 0.95)]}],
         "images": 10, "created": "2024-01-01T00:00:00+00:00"}


def test_a_group_round_trips_through_its_json():
    g = Group(id="exact-1-abcdef", kind="exact", size=2, representative=Ref(1, "x.jpg"), tightest=1.0, loosest=1.0,
              keep="x.jpg", keep_id=1, reason="oldest file", members=(Member(1, "x.jpg", hash="h", similarity=1.0),
                                                                       Member(2, "y.jpg", hash="h", similarity=1.0)))
    assert Group.from_json(json.loads(json.dumps(g.to_json()))) == g
    assert g.identical(g.members[1]) and not g.identical(g.members[0])
    assert g.with_keeper(2, "chosen by you").keep == "y.jpg"


def test_a_dedup_json_of_today_loads_into_the_same_groups_and_writes_back_the_same(tmp_path):
    text = json.dumps(TODAY, indent=1) + "\n"
    (tmp_path / "dedup.json").write_text(text)
    saved = load_duplicates(tmp_path)
    assert saved is not None and saved.kinds == ("exact", "near") and saved.threshold == 0.9
    g = saved.groups[0]
    assert (g.id, g.kind, g.size, g.representative, g.keep_id, g.ids) == (TODAY["groups"][0]["id"], "near", 2,
                                                                          Ref(3, "a/3.jpg"), 3, [3, 7])
    assert g.members[1] == Member(**_member(7, "b/7.png", 0.95))
    assert saved.to_json() == TODAY
    write_duplicates(tmp_path, saved)
    assert (tmp_path / "dedup.json").read_text() == text


def test_a_dedup_json_of_an_older_version_loads():
    old = {"threshold": 0.9, "created": None, "groups": [
        {"size": 2, "members": [{"id": 5, "path": "p5.jpg", "best_similarity": 0.93},
                                {"id": 2, "path": "p2.jpg", "best_similarity": 0.93}]}]}
    saved = SavedSearch.from_json(old)
    g = saved.groups[0]
    assert (g.kind, g.id, g.keep_id, g.keep, g.reason) == ("near", group_id("near", [2, 5]), 5, "p5.jpg", OLD_REASON)
    assert g.members[0].similarity == 0.93 and saved.kinds is None
