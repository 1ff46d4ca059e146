"""VectorStore against numpy brute force: exact search, tuned approximate kinds, removals, save/load."""

from __future__ import annotations

import numpy as np
import pytest

from index.search.store import VectorStore, choose_kind, exact_topk, factory_for, recall_at


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _clustered(n: int, dim: int, seed: int = 0, centers: int = 300) -> np.ndarray:
    """Points around 300 fixed centers (the same for every seed): like image embeddings, unlike uniform noise."""
    c = np.random.default_rng(1234).standard_normal((centers, dim))
    rng = np.random.default_rng(seed)
    return _unit(c[rng.integers(0, centers, n)] + 0.3 * rng.standard_normal((n, dim)))


def _numpy_topk(x: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    s = q @ x.T  # Q x N
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, order, 1), order


def test_flat_equals_numpy_brute_force_with_ties():
    rng = np.random.default_rng(1)
    x = _unit(rng.standard_normal((3000, 32)))
    x[100] = x[7]  # exact ties: same score under two ids
    x[2000] = x[7]
    q = _unit(rng.standard_normal((40, 32)))
    q[0] = x[7]
    ids = np.arange(3000, dtype=np.int64) * 3 + 5  # stable ids need not be 0..N-1
    store = VectorStore.create("flat", 32, 3000, use_gpu="no")
    store.add(ids, x)
    scores, found = store.search(q, 10)
    ref_s, ref_i = _numpy_topk(x, q, 10)
    np.testing.assert_allclose(scores, ref_s, atol=1e-5)
    for row_s, row_found, row_ref in zip(scores, found, ids[ref_i]):
        # same ids, except that tied scores may come in either order
        for score in np.unique(np.round(row_s, 5)):
            same = np.round(row_s, 5) == score
            if same.all() or not same[-1]:
                assert set(row_found[same]) == set(row_ref[same])
    assert set(found[0, :3]) == {ids[7], ids[100], ids[2000]}


def test_choose_kind_by_size_and_budget():
    assert choose_kind(10_000, 128, 1 << 30) == "flat"
    assert choose_kind(1_000_000, 128, 1 << 30) == "ivf"  # 512 MB fits
    assert choose_kind(1_000_000, 2048, 1 << 30) == "ivfpq"  # 8 GB does not
    assert factory_for("ivf", 1_000_000, 128) == "IVF4096,Flat"
    assert factory_for("ivf", 1000, 128) == "IVF25,Flat"  # >= 39 training points per list


@pytest.mark.parametrize("kind", ["ivf", "ivfpq", "hnsw"])
def test_approximate_kinds_reach_their_tuned_recall(kind):
    x = _clustered(6000, 32)
    ids = np.arange(len(x), dtype=np.int64)
    rng = np.random.default_rng(0)
    held = rng.choice(ids, 200, replace=False)
    store = VectorStore.create(kind, 32, len(x), use_gpu="no")
    rest = ~np.isin(ids, held)
    store.train(x[rest])
    store.add(ids[rest], x[rest])
    tuning = store.tune(x, ids, x[held], held, k=10, target=0.95)  # held-out queries, not in the index yet
    assert tuning.recall >= 0.95, tuning
    if tuning.value > (1 if kind != "hnsw" else 10):  # the smallest value that reaches the target
        store.set_param(tuning.param, tuning.value // 2)
        assert recall_at(store.search(x[held], 10)[1], exact_topk(x, ids, x[held], held, 10)) < 0.95
        store.set_param(tuning.param, tuning.value)
    store.add(held, x[held])
    # fresh queries from the same distribution reach (about) the stored recall against numpy truth
    q = _clustered(300, 32, seed=5)
    _, truth = _numpy_topk(x, q, 10)
    _, found = store.search(q, 10)
    assert recall_at(found, truth) >= tuning.recall - 0.03


def test_remove_and_readd_are_idempotent(tmp_path):
    rng = np.random.default_rng(2)
    x = _unit(rng.standard_normal((500, 16)))
    ids = np.arange(500, dtype=np.int64) + 1000
    for kind in ("flat", "ivf"):
        store = VectorStore.create(kind, 16, 500, use_gpu="no")
        store.train(x)
        store.add(ids, x)
        for _ in range(2):  # a re-run after a crash repeats remove-then-add
            store.remove(ids[:50])
            store.add(ids[:50], x[:50])
        assert store.ntotal == 500
        store.remove(np.array([ids[3], 99999]))  # unknown ids are ignored
        assert store.ntotal == 499
        store.save(tmp_path / f"{kind}.faiss")
        import faiss

        from index.search.index_dir import kind_of

        again = faiss.read_index(str(tmp_path / f"{kind}.faiss"))
        assert kind_of(again) == kind and again.ntotal == 499


def test_hnsw_cannot_remove_but_rebuilds_from_an_emptied_copy():
    rng = np.random.default_rng(3)
    x = _unit(rng.standard_normal((300, 16)))
    ids = np.arange(300, dtype=np.int64)
    store = VectorStore.create("hnsw", 16, 300, use_gpu="no")
    store.add(ids, x)
    assert not store.can_remove() and store.contains_any(np.array([5])) and not store.contains_any(np.array([999]))
    fresh = store.emptied()
    assert fresh.ntotal == 0 and fresh.kind == "hnsw"
    fresh.add(ids[1:], x[1:])
    assert not fresh.contains_any(np.array([0]))


def test_query_dimension_mismatch_is_a_clear_error():
    from moco.errors import UserError

    store = VectorStore.create("flat", 8, 10, use_gpu="no")
    store.add(np.arange(3), _unit(np.ones((3, 8))))
    with pytest.raises(UserError, match="dimension 4"):
        store.search(np.ones((1, 4), np.float32), 2)


def test_few_query_sharded_flat_search_equals_numpy():
    """Single queries on a large flat index take the sharded path; it must equal numpy exactly."""
    from index.search import store as store_mod

    rng = np.random.default_rng(7)
    n = store_mod._SHARD_FROM + 1234
    x = _unit(rng.standard_normal((n, 24)))
    ids = rng.permutation(n).astype(np.int64) + 10  # ids unrelated to positions
    s = VectorStore.create("flat", 24, n, use_gpu="no")
    s.add(ids, x)
    s.remove(ids[:5])  # positions shift after a removal: labels must follow
    q = _unit(rng.standard_normal((3, 24)))
    scores, found = s.search(q, 15)  # 3 < _FEW_QUERIES: sharded
    ref_s, ref_i = _numpy_topk(x[5:], q, 15)
    np.testing.assert_allclose(scores, ref_s, atol=1e-5)
    np.testing.assert_array_equal(found, ids[5:][ref_i])
    batched_s, batched_i = s.search(np.repeat(q, 10, axis=0), 15)  # 30 queries: FAISS's own path
    np.testing.assert_array_equal(batched_i[::10], found)
