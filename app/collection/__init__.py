"""app.collection: the collection a server serves, below the page and the JSON API alike: the index and its embedder
once attached, an indexed photo's original (:mod:`~app.collection.library`) and the review of groups of duplicates,
a page at a time (:mod:`~app.collection.review`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"Library": "library", "DuplicateReview": "review",
                                                     "ReviewPage": "review"})
