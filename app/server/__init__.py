"""app.server: the one server of a collection, page and JSON API on one port (:mod:`~app.server.launch`), behind
one access rule (:mod:`~app.server.access`: the login or the token, failed logins counted once), the names and
origins it answers (:mod:`~app.server.origins`), bounds on what clients may cost it
(:mod:`~app.server.connections`, :mod:`~app.server.log_limits`) and its heap kept out of the garbage collector
(:mod:`~app.server.heap`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"serve": "launch", "serve_pending": "launch"})
