"""index.duplicates: finding a collection's duplicates and acting on them.

    from index import ImageIndex
    from index.duplicates import find_duplicates, move_duplicates
    idx = ImageIndex.open("my_index")
    groups = find_duplicates(idx)                                 # [Group(id, kind, members, keep_id, ...), ...]
    out = move_duplicates(idx, groups, dest="/backup/duplicates")

Rooms: ``groups`` (the typed groups, their members and the saved search, and the kinds: what every reader shares),
``verify`` (the pixel check: is a pair a copy), ``dedup_cache`` (its frames and checked pairs, kept with the
index), ``propose`` (which pairs the pixel check looks at), ``keeper`` (which photo of a group to keep), ``dedup``
(the search for duplicates: its groups and thresholds, saved with the index) and ``resolve`` (acting on the groups:
moves, journalled and undone, keepers chosen, groups said not to be duplicates). The near-duplicate threshold is
measured at build time, by :mod:`index.calibrate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moco._lazy import lazy_face

if TYPE_CHECKING:  # what editors and type checkers see; at run time each name is imported when first used
    from index.duplicates.dedup import find_duplicates as find_duplicates
    from index.duplicates.dedup import load_duplicates as load_duplicates
    from index.duplicates.dedup import search_duplicates as search_duplicates
    from index.duplicates.groups import KINDS as KINDS
    from index.duplicates.groups import Group as Group
    from index.duplicates.groups import Member as Member
    from index.duplicates.groups import SavedSearch as SavedSearch
    from index.duplicates.keeper import suggest_keeper as suggest_keeper
    from index.duplicates.resolve.actions import move_duplicates as move_duplicates
    from index.duplicates.resolve.actions import undo_moves as undo_moves
    from index.duplicates.verify import copy_scores as copy_scores

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "find_duplicates": "dedup", "search_duplicates": "dedup", "load_duplicates": "dedup", "suggest_keeper": "keeper",
    "Group": "groups", "Member": "groups", "SavedSearch": "groups", "KINDS": "groups",
    "copy_scores": "verify", "move_duplicates": "resolve.actions", "undo_moves": "resolve.actions",
})
