"""app/heap.py: a server freezes its startup heap out of the cyclic collector; what it replaces later is still freed."""

from __future__ import annotations

import gc
import shutil
import weakref
from pathlib import Path

import pytest

from app.server import heap
from index.building.runner import build_index
from index.search.image_index import ImageIndex
from tests.conftest import random_backbone


@pytest.fixture
def frozen_heap():
    """heap.freeze() for one test, in a process unfrozen before (a server an earlier test started may have frozen
    it) and afterwards."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    """An object that can sit in a reference cycle and be watched with a weak reference."""

    def __init__(self) -> None:
        self.me = self


def test_freeze_leaves_what_is_alive_out_of_later_collections(frozen_heap) -> None:
    garbage, alive = _Node(), _Node()
    dead_ref, alive_ref = weakref.ref(garbage), weakref.ref(alive)
    del garbage  # a cycle that is garbage already: freeze collects it first
    count = heap.freeze()
    assert count > 1000 and gc.get_freeze_count() > 1000  # (not equal: another thread may free a frozen object)
    assert dead_ref() is None
    del alive  # garbage now, but frozen: no collection walks it
    gc.collect()
    assert alive_ref() is not None
    gc.unfreeze()  # what freezing is undone by: the same cycle is found again
    gc.collect()
    assert alive_ref() is None


def test_an_index_reloaded_in_a_frozen_process_frees_the_old_one(frozen_heap, sample_photos: Path, backbone: Path,
                                                                  tmp_path: Path) -> None:
    """`moco serve` freezes with its index loaded; `moco index update` and a rebuild then replace the store, the
    space and the catalog. They must hold no reference cycle, or every update would leak the old index."""
    photos = tmp_path / "photos"
    shutil.copytree(sample_photos, photos)
    build_index(photos, backbone, tmp_path / "idx", progress=False)
    index = ImageIndex.open(tmp_path / "idx")
    heap.freeze()
    old = [weakref.ref(index.store), weakref.ref(index.space)]
    (photos / "new").mkdir()
    shutil.copy(next(sample_photos.rglob("*.jpg")), photos / "new" / "copy.jpg")
    build_index(photos, backbone, tmp_path / "idx", progress=False)  # an update: new index.faiss and index.json
    assert index.refresh()
    assert [ref() for ref in old] == [None, None]
    old = [weakref.ref(index.store), weakref.ref(index.space), weakref.ref(index.catalog)]
    build_index(photos, random_backbone(tmp_path, seed=1), tmp_path / "idx.new", progress=False)
    (tmp_path / "idx").rename(tmp_path / "idx.old")  # another model: rebuilt beside it and swapped in, as
    (tmp_path / "idx.new").rename(tmp_path / "idx")  # `moco run` does it; a new catalog file too
    assert index.refresh()
    assert [ref() for ref in old] == [None, None, None]
