"""app.server: the one server of a collection, the page and its JSON API on one port behind the guard
(:mod:`~app.server.launch`), and the serving process's heap kept out of the garbage collector
(:mod:`~app.server.heap`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"serve": "launch", "serve_pending": "launch"})
