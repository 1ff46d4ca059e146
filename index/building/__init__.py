"""index.build: an index directory built and kept in step with its folder, crash-safe: a plan from a scan diffed
against the catalog (:mod:`~index.build.plan`), photos decoded, embedded and committed (:mod:`~index.build.prepare`),
the collection's space and FAISS index synced with the catalog (:mod:`~index.build.sync`), the run of it all
(:mod:`~index.build.runner`) and its flags (:mod:`~index.build.args`). ``python -m index.build`` runs under
torchrun."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"build_index": "runner", "update_index": "runner"})
