"""Work done in worker processes, its results in order (:func:`in_workers`): the photo-decoding workers of the
training cache (:mod:`moco.data.cache`) and the pixel check of a search for duplicates
(:mod:`index.duplicates.dedup`).

The workers are started with "spawn" (never fork a process that may hold torch/CUDA or OpenMP threads). They die with
their parent even if it is killed (Linux: ``PR_SET_PDEATHSIG``) and leave Ctrl+C to it; however the caller stops
(an interrupt, an error, a generator closed early), the workers are stopped at once, not waited for.

Spawn imports the parent's main script again in each worker, as ``__mp_main__``: a script that trains at its top
level, without ``if __name__ == "__main__":``, would train again in every worker. Such a worker exits at once with
:data:`REIMPORTED_MAIN_EXIT` (:func:`exit_if_importing_main`), and the parent says what happened and how to fix it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import concurrent.futures.process
import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from moco.errors import UserError

__all__ = ["in_workers", "ordered_window", "chunks", "exit_if_importing_main", "REIMPORTED_MAIN_EXIT", "ONE_THREAD"]

_T = TypeVar("_T")
_R = TypeVar("_R")

REIMPORTED_MAIN_EXIT = 86
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # workers sharing the cores
INLINE_ARGS = 16384  # bytes: larger init arguments go to the workers through a file, not spawn's pipe. The parent
# writes a new worker's arguments into a pipe whose reading end it holds open itself, so past the pipe's buffer (64 kB)
# a worker that exits before reading them all (one importing the parent's main script again) would leave the parent
# waiting forever.


def exit_if_importing_main() -> None:
    """Exit this process quietly (``REIMPORTED_MAIN_EXIT``) when it is a worker still importing its parent's main
    script: training there is the script's top-level code run again, not a call meant for this process. (The
    spawn and forkserver start methods set ``_inheriting`` while a new process prepares, before it runs its task;
    multiprocessing itself checks it to refuse starting processes then.)"""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(REIMPORTED_MAIN_EXIT)


def ordered_window(submit: Callable[[_T], concurrent.futures.Future[_R]], items: Iterable[_T],
                   window: int) -> Iterator[_R]:
    """Results of ``submit(item)`` in input order, with at most ``window`` tasks in flight."""
    pending: collections.deque[concurrent.futures.Future[_R]] = collections.deque()
    try:
        for item in items:
            pending.append(submit(item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for fut in pending:
            fut.cancel()


def chunks(items: Sequence[_T], n: int) -> Iterator[list[_T]]:
    """``items`` ``n`` at a time (the last chunk shorter)."""
    for i in range(0, len(items), n):
        yield list(items[i : i + n])


def _noop() -> None:
    """A process that only starts (and so imports the parent's main script, as a worker does)."""


def _broken_pool_error(ctx: Any, workers: int, what: str) -> UserError:
    """Why the workers stopped: one probe process, started as they were, tells whether importing the main script
    trains (the script lacks ``if __name__ == "__main__":``)."""
    probe = ctx.Process(target=_noop)
    probe.start()
    probe.join()
    if probe.exitcode == REIMPORTED_MAIN_EXIT:
        main = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
        return UserError(f"{main} does its work when it is imported: the {what} worker processes (workers={workers}) "
                         "each import it again, as Python's spawn start method does. Put that work (the call to train "
                         'or to search) under `if __name__ == "__main__":` (or pass workers=0 to work in this process)')
    return UserError(f"the {what} worker processes (workers={workers}) stopped abruptly (killed, e.g. for "
                     "memory?): run again with fewer workers, or workers=0 to work in this process")


def _worker_start(parent: int, init: Callable[..., object] | None, args: tuple, args_file: str | None = None) -> None:
    """A worker's first step: it dies with its parent (Linux: the kernel sends SIGKILL when the parent exits, however
    it exits), and leaves Ctrl+C to the parent, which stops it; then ``init(*args)`` (the args read from
    ``args_file`` where the parent wrote them there: :data:`INLINE_ARGS`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent was gone before the line above: nothing to work for
        os._exit(1)
    if args_file is not None:
        with open(args_file, "rb") as f:
            args = pickle.load(f)
    if init is not None:
        init(*args)


def in_workers(fn: Callable[[_T], _R], items: Iterable[_T], workers: int, what: str,
               init: Callable[..., object] | None = None, init_args: tuple = (),
               window: int | None = None, env: Mapping[str, str] | None = None) -> Iterator[_R]:
    """``fn(item)`` of each item, in input order, computed in ``workers`` spawned processes (each first runs
    ``init(*init_args)``; ``fn`` and ``init`` must be module-level functions), at most ``window`` items in flight
    (default three a worker). ``what`` names the workers in errors ("photo-decoding"). ``env``: variables the workers
    start with (``{"OPENBLAS_NUM_THREADS": "1"}``: one thread each, where the workers share the cores), set in this
    process while its workers start, as they are read when a worker's libraries load.

    Called by a worker that is importing its parent's main script again (the script's top-level call), it exits that
    worker at once (:func:`exit_if_importing_main`), and the parent says so."""
    exit_if_importing_main()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield from _in_pool(fn, items, workers, what, init, init_args, window)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _in_pool(fn: Callable[[_T], _R], items: Iterable[_T], workers: int, what: str,
             init: Callable[..., object] | None, init_args: tuple, window: int | None) -> Iterator[_R]:
    ctx = multiprocessing.get_context("spawn")
    before = set(multiprocessing.active_children())
    args_file = None
    payload = pickle.dumps(init_args)
    if len(payload) > INLINE_ARGS:
        with tempfile.NamedTemporaryFile("wb", prefix="moco-workers-", suffix=".pickle", delete=False) as f:
            f.write(payload)
        args_file, init_args = f.name, ()
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_start,
                                                  initargs=(os.getpid(), init, init_args, args_file))
    finished = False
    try:
        yield from ordered_window(lambda item: pool.submit(fn, item), items, window or workers * 3)
        finished = True
    except concurrent.futures.process.BrokenProcessPool:
        raise _broken_pool_error(ctx, workers, what) from None
    finally:
        if not finished:  # the pool's workers are this process's children it did not have before
            for proc in set(multiprocessing.active_children()) - before:
                proc.kill()
        pool.shutdown(wait=finished, cancel_futures=True)
        if args_file is not None:
            with contextlib.suppress(OSError):
                os.remove(args_file)
