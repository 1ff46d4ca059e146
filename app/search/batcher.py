"""A micro-batcher: requests that arrive together share one call of the model.

Each request ``submit``s one item from the event loop and awaits its result. A collector task takes the first
waiting item, then whatever else arrives within a short window (``window_ms``), up to ``max_batch`` items, and
hands the batch to ``fn`` in one worker thread (the event loop never runs the model); items that arrive while a
batch runs form the next one. At most ``max_pending`` requests are admitted at a time (waiting, decoding or in
a batch): one more gets :class:`Overloaded` at once (the API answers 503 with ``Retry-After``), so a burst is
shed instead of queued without bound.

``fn`` takes a list of items and returns one result per item, in order; a result that is an exception is raised
to that item's caller only. One request's failure is its own: when ``fn`` itself raises for a batch of several
items (one bad item can poison a whole call), each of them is run again alone, so only the items that fail alone
get an exception (each its own); the next batch runs as usual.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["Batcher", "Overloaded"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Overloaded(Exception):
    """More requests are in flight than the server admits; ``retry_after`` is a polite wait in seconds."""

    def __init__(self, pending: int, retry_after: int, what: str = "searches") -> None:
        super().__init__(f"the server is busy ({pending} {what} in flight, its limit): try again in {retry_after} s")
        self.pending, self.retry_after = pending, retry_after


class Batcher(Generic[T, R]):
    """Batch ``fn`` over items submitted from one event loop (see the module docstring).

    Args:
        fn: items -> results (same length, same order), run in the batcher's one worker thread.
        window_ms: how long a batch waits for company after its first item (0: only what is already waiting).
        max_batch: items per call of ``fn`` at most.
        max_pending: requests admitted at once (:meth:`admit`) at most; past it, :class:`Overloaded`.
        clock: seconds, monotonic (the window's deadline; tests pass a synthetic one).
    """

    def __init__(self, fn: Callable[[list[T]], Sequence[R | BaseException]], window_ms: float = 2.0,
                 max_batch: int = 16, max_pending: int = 32,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_batch < 1 or max_pending < 1 or window_ms < 0:
            raise ValueError(f"Batcher(max_batch={max_batch}, max_pending={max_pending}, window_ms={window_ms}): "
                             "both limits must be at least 1 and the window at least 0")
        self.fn, self.window_s, self.max_batch, self.max_pending = fn, window_ms / 1000, max_batch, max_pending
        self.clock = clock
        self.pending = 0  # admitted requests not finished yet
        self.batch_sizes: list[int] = []  # the sizes of the last batches run (at most 1000 kept)
        self._queue: asyncio.Queue[tuple[T, asyncio.Future]] | None = None
        self._task: asyncio.Task | None = None
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batcher")
        self._last_s = 0.01  # the last batch's duration: what Retry-After is computed from

    # ---------------------------------------------------------------------------------- admission
    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Hold one of ``max_pending`` places while a request is decoded and searched; Overloaded when none is free."""
        if self.pending >= self.max_pending:
            raise Overloaded(self.pending, self.retry_after())
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1

    def retry_after(self) -> int:
        """Seconds after which a shed request may find a place: the queue's drain time, at least 1."""
        batches = math.ceil(self.pending / self.max_batch)
        return max(1, math.ceil(batches * self._last_s))

    # ------------------------------------------------------------------------------------ batches
    async def submit(self, item: T) -> R:
        """The result of ``fn`` for ``item``, computed in a batch with the items that arrive with it."""
        if self._task is None or self._task.done():
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._collect())
        assert self._queue is not None
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((item, future))
        return await future

    async def _take(self) -> list[tuple[T, asyncio.Future]]:
        """The next batch: the first waiting item, then the others waiting or arriving within the window."""
        assert self._queue is not None
        batch = [await self._queue.get()]
        deadline = self.clock() + self.window_s
        while len(batch) < self.max_batch:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            left = deadline - self.clock()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), left))
            except asyncio.TimeoutError:
                break
        return batch

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [(item, fut) for item, fut in await self._take() if not fut.done()]  # a caller that left: skip
            if not batch:
                continue
            t0 = time.perf_counter()
            results = await loop.run_in_executor(self._worker, self._run, [item for item, _ in batch])
            self._last_s = time.perf_counter() - t0
            self.batch_sizes = [*self.batch_sizes[-999:], len(batch)]
            for (_, fut), result in zip(batch, results):
                if fut.done():
                    continue
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)

    def _run(self, items: list[T]) -> list[R | BaseException]:
        """``fn`` over ``items`` (in the worker thread); when it raises for several items, each item alone."""
        try:
            return self._checked(items)
        except Exception as e:  # noqa: BLE001 - the collector goes on; the items are tried one by one
            if len(items) == 1:
                logger.exception("a search failed")
                return [e]
            logger.warning("a batch of %d failed (%s: %s): running its items one by one", len(items),
                           type(e).__name__, str(e)[:200])
        out: list[R | BaseException] = []
        for item in items:
            try:
                out += self._checked([item])
            except Exception as e:  # noqa: BLE001 - this item's caller gets it, and no other
                logger.exception("a search failed")
                out.append(e)
        return out

    def _checked(self, items: list[T]) -> list[R | BaseException]:
        results = list(self.fn(items))
        if len(results) != len(items):
            raise RuntimeError(f"the batch function returned {len(results)} results for {len(items)} items")
        return results

    def close(self) -> None:
        """Stop the collector and the worker thread (a batch running finishes first)."""
        if self._task is not None and not self._task.done():
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)
        self._worker.shutdown(wait=False, cancel_futures=True)
