"""Search with several photos: index.search.query's rules against numpy, and ImageIndex.search with a combined query,
its own
photos left out and near-copies hidden, on generated photos with a real backbone and a real FAISS index."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from index.building.plan import file_hash
from index.building.runner import build_index
from index.search.image_index import ImageIndex
from index.search.query import RULES, check_query_vector, combine
from moco.data.sample import make_sample_collection
from moco.errors import UserError


def _unit_rows(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.normal(size=(n, d)).astype(np.float32)  # n x d
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_the_rules_against_numpy():
    rng = np.random.default_rng(0)
    pos, neg, bg = _unit_rows(rng, 3, 16), _unit_rows(rng, 2, 16), _unit_rows(rng, 64, 16)
    one = combine(pos[:1])
    assert one.dtype == np.float32 and np.array_equal(one, pos[0])  # one photo: itself, bit for bit
    for rule in ("mean", "difference", "rocchio"):
        assert np.array_equal(combine(pos[:1], rule=rule), pos[0])
    m = pos.mean(0)
    np.testing.assert_allclose(combine(pos, rule="mean"), m / np.linalg.norm(m), atol=1e-6)
    np.testing.assert_allclose(combine(pos, neg, rule="mean"), m / np.linalg.norm(m), atol=1e-6)  # ignores them
    d = m - 0.5 * neg.mean(0)
    np.testing.assert_allclose(combine(pos, neg, rule="difference", beta=0.5), d / np.linalg.norm(d), atol=1e-6)
    u = m / np.linalg.norm(m) - 0.25 * neg.mean(0) / np.linalg.norm(neg.mean(0))
    np.testing.assert_allclose(combine(pos, neg, rule="rocchio", beta=0.25), u / np.linalg.norm(u), atol=1e-6)
    w = combine(pos, neg, rule="logistic", background=bg)
    assert w.shape == (16,) and np.linalg.norm(w) == pytest.approx(1.0, abs=1e-5)
    # the fitted direction separates: every positive scores above every negative and the background's median
    assert (pos @ w).min() > (neg @ w).max() and (pos @ w).min() > np.median(bg @ w)
    for rule in RULES:
        for q in (combine(pos, neg, rule=rule, background=bg), combine(pos, None, rule=rule, background=bg)):
            assert np.isfinite(q).all() and np.linalg.norm(q) == pytest.approx(1.0, abs=1e-5)


def test_bad_queries_are_refused_with_the_fix():
    with pytest.raises(UserError, match="at least one positive"):
        combine(np.zeros((0, 4), np.float32))
    with pytest.raises(UserError, match="unknown query rule 'max'"):
        combine(np.ones((1, 4), np.float32), rule="max")
    with pytest.raises(UserError, match="background"):
        combine(np.ones((2, 4), np.float32), rule="logistic")
    np.testing.assert_allclose(check_query_vector([3, 0, 4], 3), [0.6, 0, 0.8], atol=1e-7)
    for bad, says in (([1, 2], "has 2 numbers.*give 3"), ([0, 0, 0], "all zeros"), ([1, float("nan"), 0], "NaN"),
                      ([1, float("inf"), 0], "NaN or an infinity"), ("abc", "list of 3 numbers"),
                      ([[1, 2, 3]], "give 3")):
        with pytest.raises(UserError, match=says):
            check_query_vector(bad, 3)


@pytest.fixture(scope="module")
def collection(tmp_path_factory, backbone) -> dict[str, object]:
    """6 families x 8 generated photos (48 px) with one byte-identical copy, indexed with the random backbone."""
    tmp = tmp_path_factory.mktemp("query")
    photos = tmp / "photos"
    make_sample_collection(photos, per_family=8, size=48, seed=5)
    first = sorted((photos / sorted(p.name for p in photos.iterdir())[0]).iterdir())[0]
    shutil.copyfile(first, first.with_name("copy_" + first.name))
    build_index(photos, backbone, tmp / "idx", progress=False, device="cpu", kind="flat")
    idx = ImageIndex.open(tmp / "idx")
    ids = idx.catalog.ok_ids()
    rows = idx.catalog.rows_by_id(ids)
    return {"idx": idx, "photos": photos, "copy": first, "family": {int(i): rows[int(i)].path.split("/")[0]
                                                                   for i in ids}}


def test_one_positive_is_todays_search_bit_for_bit(collection):
    idx: ImageIndex = collection["idx"]
    ids = idx.catalog.ok_ids()
    f = idx.vectors(ids[[3, 17]])  # 2 x D: features, as the embedder gives them
    q = idx.query_vector(f[:1])
    assert np.array_equal(q, idx.to_space(f[:1])[0])
    today, multi = idx.search(f[:1], k=12), idx.search(q, k=12, centred=True)
    assert np.array_equal(today.ids, multi.ids) and np.array_equal(today.scores, multi.scores)


def test_each_query_of_a_batch_leaves_out_its_own_photos(collection):
    """exclude_each: one collection of ids per query vector, left out of that query's results only (the JSON API's
    batch of searches, each without its own photo); k results still, as each query alone."""
    idx: ImageIndex = collection["idx"]
    ids = idx.catalog.ok_ids()
    f = idx.vectors(ids[[3, 3, 30]])  # 3 x D: one photo twice, leaving it out once
    own = [[int(ids[3])], [int(ids[17]), int(ids[5])], []]
    batch = idx.search(f, k=9, exclude_each=own, exclude_ids=[int(ids[40])])
    for n in range(3):
        alone = idx.search(f[n : n + 1], k=9, exclude_ids=[*own[n], int(ids[40])])
        np.testing.assert_array_equal(batch.ids[n], alone.ids[0])
        assert (batch.ids[n] >= 0).all() and not {*own[n], int(ids[40])} & set(batch.ids[n].tolist())
    assert batch.ids[1][0] == ids[3] and batch.ids[2][0] == ids[30]  # another query's photo stays: first here
    with pytest.raises(ValueError, match="one per query"):
        idx.search(f, k=3, exclude_each=own[:2])


def test_three_positives_of_a_family_and_a_negative_of_another(collection):
    idx: ImageIndex = collection["idx"]
    family = collection["family"]
    names = sorted(set(family.values()))
    by = {n: sorted(i for i, f in family.items() if f == n) for n in names}
    a, b = names[1], names[2]
    pos, neg = by[a][:3], by[b][:1]
    q = idx.query_vector(idx.vectors(np.array(pos)), idx.vectors(np.array(neg)))
    hits = idx.search(q, k=len(family), centred=True, exclude_ids=pos + neg)
    ranked = [int(i) for i in hits.ids[0] if i >= 0]
    assert not set(ranked) & set(pos + neg)  # the query photos are never results
    rank_a = [r for r, i in enumerate(ranked) if family[i] == a]
    rank_b = [r for r, i in enumerate(ranked) if family[i] == b]
    assert len(rank_a) == len(by[a]) - 3 and len(rank_b) == len(by[b]) - 1
    assert max(rank_a) < min(rank_b)  # every photo of the first family ahead of every photo of the second
    # the same ranking from numpy: the centred collection against the combined query
    x = idx.to_space(idx.vectors(np.array(ranked)))  # N x D
    assert np.all(np.diff(x @ q) <= 1e-6)
    np.testing.assert_allclose(hits.scores[0][: len(ranked)], x @ q, atol=1e-5)


def test_near_copies_hidden_and_uploads_matched_by_their_bytes(collection):
    idx: ImageIndex = collection["idx"]
    copy: Path = collection["copy"]
    twins = idx.ids_of_files([file_hash(copy)])
    assert len(twins) == 2  # the photo and its byte-identical copy
    f = idx.vectors(np.array(twins[:1]))  # 1 x D
    plain = idx.search(f, k=10)
    assert set(twins) <= set(plain.ids[0].tolist())
    left_out = idx.search(f, k=10, exclude_ids=twins)
    assert not set(twins) & set(left_out.ids[0].tolist()) and (left_out.ids[0] >= 0).all()
    np.testing.assert_array_equal(left_out.ids[0][:8], [i for i in plain.ids[0] if i not in twins][:8])
    # deduplicate: greedy over the full ranking in numpy, no kept result within the threshold of a better one
    ids = idx.catalog.ok_ids()
    x = idx.to_space(idx.vectors(ids))  # N x D
    order = ids[np.argsort(-(x @ idx.to_space(f)[0]), kind="stable")]
    near, kept = idx.dedup_threshold, []
    xs = dict(zip(ids.tolist(), x))
    for i in order.tolist():
        if all(float(xs[i] @ xs[j]) < near for j in kept):
            kept.append(i)
    got = idx.search(f, k=10, deduplicate=True).ids[0].tolist()
    # the twins tie (the same vector): either one comes first, the other is hidden, the rest follow as numpy's
    assert got[0] in twins and kept[0] in twins and got[1:] == kept[1:10] and not set(twins) & set(got[1:])
    page2 = idx.search(f, k=5, offset=5, deduplicate=True)
    assert page2.ids[0].tolist() == kept[5:10]


def test_the_page_searches_again_with_ticked_results_and_added_photos(collection, tmp_path):
    from app.page.handlers import SearchApp

    idx: ImageIndex = collection["idx"]
    family = collection["family"]
    app = SearchApp(idx, idx.load_embedder(device="cpu"))
    photos: Path = collection["photos"]
    q = sorted(photos.rglob("*.jpg"))[9]
    _, _, state = app.search(str(q), k=12)
    assert app.tick_choices(state)[0] == (f"1. {state.paths[0].rsplit('/', 1)[-1]}", state.ids[0])
    mine = q.parent.name
    more = [i for i in state.ids if family[i] == mine][:2]
    less = [i for i in state.ids if family[i] != mine][:1] or [next(i for i in family if family[i] != mine)]
    extra = sorted(p for p in photos.rglob("*.png") if p.parent.name == mine)[0]
    gallery, info, again = app.search_again(state, more, less, [str(extra)], [], k=12)
    # the same query from the library: the upload's features, the ticked photos', the added photo's
    emb = app.embedder
    pos = np.concatenate([emb.embed(str(q)), idx.vectors(np.array(more)), emb.embed(str(extra))])  # P x D
    query = idx.query_vector(pos, idx.vectors(np.array(less)))
    left_out = sorted({*more, *less, *idx.ids_of_files([file_hash(extra), file_hash(q)])})  # q is indexed too
    assert state.photo_ids and state.photo_ids == tuple(idx.ids_of_files([file_hash(q)]))
    assert set(state.photo_ids) <= set(left_out)
    ref = idx.search(query, k=12, centred=True, exclude_ids=left_out)
    assert again.ids == ref.ids[0].tolist() and len(gallery) == 12 and "4 photos, less like 1" in info
    np.testing.assert_allclose(again.scores, ref.scores[0], atol=1e-6)
    assert not set(left_out) & set(again.ids) and again.centred and again.query_ids == tuple(left_out)
    _, _, further = app.more(again)  # More continues that ranking, the query photos still left out
    assert further.ids == idx.search(query, k=24, centred=True, exclude_ids=left_out).ids[0].tolist()
    _, _, narrower = app.rerun(again, 5, None)  # a new k keeps the query
    assert narrower.ids == again.ids[:5]
    # a second round adds to the first: its photos stay in the query
    _, _, round2 = app.search_again(again, [], [again.ids[-1]], [], [], k=12)
    assert len(round2.positives) == 4 and len(round2.negatives) == 2 and again.ids[-1] in round2.query_ids
    for ticks, says in (((), "tick results"), (([more[0]], [more[0]]), "both")):
        with pytest.raises(UserError, match=says):
            app.search_again(state, *ticks)
    with pytest.raises(UserError, match="search with a photo first"):
        app.search_again(None, more)


def _primal_logistic(pos, neg, bg, l2):
    """The logistic rule's weights by Newton's method over the D weights and the bias: the reference."""
    x = np.concatenate([pos, neg, bg]).astype(np.float64)
    x = np.concatenate([x, np.ones((len(x), 1))], axis=1)  # M x (D+1)
    y = np.concatenate([np.ones(len(pos)), np.zeros(len(neg) + len(bg))])
    s = np.concatenate([np.full(len(pos), 1 / len(pos)), np.full(len(neg), 0.5 / len(neg)),
                        np.full(len(bg), 0.5 / len(bg))])
    reg = np.full(x.shape[1], l2)
    reg[-1] = 0.0
    w = np.zeros(x.shape[1])
    for _ in range(100):
        p = 1 / (1 + np.exp(-(x @ w)))
        hess = (x * (s * p * (1 - p))[:, None]).T @ x + np.diag(reg)
        w -= np.linalg.solve(hess, x.T @ (s * (p - y)) + reg * w)
    return w[:-1]


@pytest.mark.parametrize(("d", "n_bg", "l2"), [(16, 64, 1.0), (48, 20, 0.1), (8, 40, 0.01)])
def test_the_logistic_rule_is_the_primal_optimum(d, n_bg, l2):
    rng = np.random.default_rng(d)
    pos, neg, bg = _unit_rows(rng, 4, d), _unit_rows(rng, 3, d), _unit_rows(rng, n_bg, d)
    ref = _primal_logistic(pos, neg, bg, l2)
    got = combine(pos, neg, "logistic", background=bg, l2=l2)
    np.testing.assert_allclose(got, ref / np.linalg.norm(ref), atol=1e-5)
