"""The micro-batcher (app.search.batcher): batch forming, the window, admission and errors, with deterministic inputs
(no wall-clock asserts), and batched results against one-at-a-time numpy brute force."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from app.search.batcher import Batcher, Overloaded


def _doubler(sizes: list[int]):
    def fn(items: list[int]) -> list[int]:
        sizes.append(len(items))
        return [2 * x for x in items]

    return fn


@pytest.mark.parametrize("n, max_batch, expected", [(10, 4, [4, 4, 2]), (3, 16, [3]), (5, 1, [1] * 5)])
def test_items_waiting_together_share_batches_up_to_the_cap(n, max_batch, expected):
    sizes: list[int] = []
    b = Batcher(_doubler(sizes), window_ms=0, max_batch=max_batch)

    async def go() -> list[int]:
        return await asyncio.gather(*(b.submit(i) for i in range(n)))  # all queued before the collector runs

    try:
        assert asyncio.run(go()) == [2 * i for i in range(n)]
    finally:
        b.close()
    assert sizes == expected and b.batch_sizes == expected


def test_the_window_waits_for_company_and_a_past_deadline_does_not():
    sizes: list[int] = []
    b = Batcher(_doubler(sizes), window_ms=3_600_000, max_batch=3)  # an hour: only the cap can close the batch

    async def staggered() -> list[int]:
        first = asyncio.ensure_future(b.submit(1))
        for _ in range(5):
            await asyncio.sleep(0)  # the collector holds the first item and waits in its window
        rest = [asyncio.ensure_future(b.submit(x)) for x in (2, 3)]
        return await asyncio.gather(first, *rest)

    try:
        assert asyncio.run(staggered()) == [2, 4, 6] and sizes == [3]
    finally:
        b.close()

    ticks = iter(range(0, 10_000, 100))  # a synthetic clock: 100 s pass between two looks at it
    sizes2: list[int] = []
    b2 = Batcher(_doubler(sizes2), window_ms=5, max_batch=8, clock=lambda: float(next(ticks)))

    async def one_then_one() -> list[int]:
        a = await b2.submit(1)  # the deadline has passed at the next look: the batch goes alone
        return [a, await b2.submit(2)]

    try:
        assert asyncio.run(one_then_one()) == [2, 4] and sizes2 == [1, 1]
    finally:
        b2.close()


def test_past_max_pending_requests_are_shed_with_a_retry_after():
    gate = threading.Event()

    def slow(items: list[int]) -> list[int]:
        gate.wait(30)
        return items

    b = Batcher(slow, window_ms=0, max_batch=4, max_pending=2)

    async def one(x: int) -> int:
        async with b.admit():
            return await b.submit(x)

    async def go() -> tuple[list[int], Overloaded, int]:
        held = [asyncio.ensure_future(one(x)) for x in (1, 2)]
        await asyncio.sleep(0)
        assert b.pending == 2
        with pytest.raises(Overloaded) as shed:
            async with b.admit():
                raise AssertionError("admitted past max_pending")  # admit() must refuse before the body runs
        gate.set()
        done = await asyncio.gather(*held)
        return done, shed.value, await one(3)  # a place is free again

    try:
        done, shed, later = asyncio.run(go())
    finally:
        b.close()
    assert done == [1, 2] and later == 3 and b.pending == 0
    assert shed.retry_after >= 1 and shed.pending == 2 and "try again in" in str(shed)


def test_errors_reach_only_their_own_callers_and_the_next_batch_runs():
    def fn(items: list[int]) -> list[int | BaseException]:
        if 99 in items:
            raise RuntimeError("the whole batch failed")
        return [ValueError(f"bad {x}") if x < 0 else x for x in items]

    b = Batcher(fn, window_ms=0, max_batch=8)

    async def go() -> list:
        first = await asyncio.gather(b.submit(1), b.submit(-2), b.submit(3), return_exceptions=True)
        second = await asyncio.gather(b.submit(99), b.submit(4), return_exceptions=True)
        return [first, second, await b.submit(5)]

    try:
        first, second, third = asyncio.run(go())
    finally:
        b.close()
    assert first[0] == 1 and first[2] == 3 and isinstance(first[1], ValueError) and str(first[1]) == "bad -2"
    assert isinstance(second[0], RuntimeError) and second[1] == 4 and third == 5  # 4 ran again alone: its own result


def test_one_poisoned_item_fails_alone_and_the_others_of_its_batch_get_their_results():
    """A function that raises for a whole batch because of one item (SQLite's OverflowError for an id past 2^63 did):
    the batch's items run again one by one, so only the poisoned one fails, with its own error."""
    calls: list[list[int]] = []

    def fn(items: list[int]) -> list[int]:
        calls.append(list(items))
        if any(x >= 2**63 for x in items):
            raise OverflowError("Python int too large to convert to SQLite INTEGER")
        return [x + 1 for x in items]

    b = Batcher(fn, window_ms=0, max_batch=32)
    items = [*range(10), 2**63, *range(10, 20)]

    async def go() -> list:
        return await asyncio.gather(*(b.submit(x) for x in items), return_exceptions=True)

    try:
        got = asyncio.run(go())
    finally:
        b.close()
    assert calls[0] == items  # one batch first (all were waiting together) ...
    assert [c for c in calls[1:]] == [[x] for x in items]  # ... then each item alone
    assert isinstance(got[10], OverflowError)
    assert [g for n, g in enumerate(got) if n != 10] == [x + 1 for x in items if x != 2**63]


@pytest.mark.parametrize("max_batch", [1, 3, 16])
def test_batched_top_k_equals_one_query_at_a_time(max_batch):
    rng = np.random.default_rng(max_batch)
    base = rng.standard_normal((500, 32)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)  # N x D
    queries = rng.standard_normal((40, 32)).astype(np.float32)

    def top_k(q: np.ndarray, k: int = 7) -> tuple[np.ndarray, np.ndarray]:
        scores = q @ base.T  # Q x N
        ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return ids, np.take_along_axis(scores, ids, 1)

    def fn(items: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        ids, scores = top_k(np.stack(items))  # B x k
        return list(zip(ids, scores))

    b = Batcher(fn, window_ms=0, max_batch=max_batch)

    async def go() -> list:
        return await asyncio.gather(*(b.submit(q) for q in queries))

    try:
        got = asyncio.run(go())
    finally:
        b.close()
    for q, (ids, scores) in zip(queries, got):
        ref_ids, ref_scores = top_k(q[None])
        assert list(ids) == list(ref_ids[0])
        np.testing.assert_allclose(scores, ref_scores[0], atol=1e-5)
    assert max(b.batch_sizes) <= max_batch and sum(b.batch_sizes) == len(queries)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_batch=0"):
        Batcher(lambda items: items, max_batch=0)
