"""app.search: a search for every door (the page, the JSON API): its values checked once into a scope and the query
ranked within it (:mod:`~app.search.scope`), the uploads it takes (:mod:`~app.search.uploads`) and the batched
service that embeds searches arriving together as one batch (:mod:`~app.search.service`, :mod:`~app.search.batcher`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"Searcher": "scope", "Scope": "scope",
                                                     "SearchService": "service", "read_upload": "uploads"})
