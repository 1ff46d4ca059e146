"""The catalog's vectors read a few thousand rows at a time: the same ids and vectors as the rows put, in id order,
deleted and failed photos left out, over several reads and with ids asked for."""

from __future__ import annotations

import numpy as np

from index.catalog import Catalog, Row


def test_vectors_read_in_parts_equal_the_rows_put(tmp_path):
    cat = Catalog(tmp_path / "catalog.sqlite", create=True)
    rng = np.random.default_rng(0)
    n = 9000  # more than two reads of 4096 rows
    vecs = rng.standard_normal((n, 6)).astype(np.float32)
    ids = rng.permutation(np.arange(10, 10 + n))  # put out of order
    with cat.transaction() as db:
        for k, i in enumerate(ids.tolist()):
            status, deleted = ("error", 0) if k % 97 == 0 else ("ok", int(k % 89 == 0))
            cat.put(db, Row(i, f"p{i}.jpg", 1, 1, None, status, deleted=deleted), vecs[k])
    live = {int(i): vecs[k] for k, i in enumerate(ids.tolist()) if k % 97 and k % 89}
    got_ids, got = cat.vectors(dim=6)
    assert got_ids.tolist() == sorted(live) and got.flags.writeable and got.flags.c_contiguous
    assert np.array_equal(got, np.stack([live[i] for i in sorted(live)]))
    asked = sorted(rng.choice(sorted(live), 2000, replace=False).tolist()) + [5, 2**70]  # two unknown ids
    some_ids, some = cat.vectors(asked, dim=6)
    assert some_ids.tolist() == asked[:-2] and np.array_equal(some, np.stack([live[i] for i in asked[:-2]]))
    empty_ids, empty = cat.vectors([5], dim=6)
    assert empty_ids.shape == (0,) and empty.shape == (0, 6)
