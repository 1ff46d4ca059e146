"""index.duplicates.resolve: acting on groups of duplicates, safely: move the photos a group does not keep out of the
collection (journalled, undone by the journal), choose a keeper, say a group is not duplicates.

    from index import ImageIndex, find_duplicates
    from index.duplicates.resolve import move_duplicates, undo_moves
    idx = ImageIndex.open("my_index")
    groups = find_duplicates(idx)
    out = move_duplicates(idx, groups, dest="/backup/duplicates")
    undo_moves(idx)                                                 # every move put back
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moco._lazy import lazy_face

if TYPE_CHECKING:  # what editors and type checkers see; at run time each name is imported when first used
    from index.duplicates.resolve.actions import Outcome as Outcome
    from index.duplicates.resolve.actions import choose_keeper as choose_keeper
    from index.duplicates.resolve.actions import mark_not_duplicates as mark_not_duplicates
    from index.duplicates.resolve.actions import move_duplicates as move_duplicates
    from index.duplicates.resolve.actions import settle as settle
    from index.duplicates.resolve.actions import undo_moves as undo_moves

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "move_duplicates": "actions", "undo_moves": "actions", "settle": "actions", "mark_not_duplicates": "actions",
    "choose_keeper": "actions", "Outcome": "actions",
})
