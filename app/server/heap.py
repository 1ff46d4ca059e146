"""A serving process's long-lived heap, kept out of Python's cyclic garbage collector.

Once a server has started, most of its objects live as long as it does: torch, Gradio, FastAPI and their modules,
the model, the index. Python's full (oldest-generation) collection still walks them all, about 300 ms on one core
with a 10,000-photo index loaded, and under load it runs every few seconds: every request in flight waits that
long. That pause was the JSON API's p99 under load (bench/ui_load.py: 315-395 ms, against about 160 ms frozen).

:func:`freeze` collects once, then moves every object alive into the collector's permanent generation
(:func:`gc.freeze`): later collections walk only what was made afterwards. A frozen object is still freed by
reference counting when its last reference goes; only a reference cycle among frozen objects would never be
freed. An index reloaded after ``moco index update`` holds none: its old store, catalog and space are freed as
the new ones replace them (tests/test_heap.py checks it). Only the ``moco serve`` and ``moco run`` servers
freeze, once started; a library user's process (and a test's) is left as it is.
"""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["freeze"]

logger = logging.getLogger(__name__)


def freeze() -> int:
    """Collect, then freeze every object alive out of later collections; how many objects are frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    logger.debug("heap frozen: %d long-lived objects left out of garbage collection (%.0f ms)", count,
                (time.perf_counter() - t0) * 1000)
    return count
