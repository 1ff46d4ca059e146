"""index.building: an index directory built and kept in step with its folder, crash-safe: a plan from a scan diffed
against the catalog (:mod:`~index.building.plan`), photos decoded, embedded and committed
(:mod:`~index.building.prepare`),
the collection's space and FAISS index synced with the catalog (:mod:`~index.building.sync`), the run of it all
(:mod:`~index.building.runner`) and its flags (:mod:`~index.building.args`). ``python -m index.building`` runs under
torchrun."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"build_index": "runner", "update_index": "runner"})
