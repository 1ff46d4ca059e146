"""app.api: the JSON API beside the page: its routes (:mod:`~app.api.routes`), their models (:mod:`~app.api.models`),
its docs page (:mod:`~app.api.docs`) and the gate of the views of the whole collection (:mod:`~app.api.gate`); its
searches are :mod:`app.search`'s."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"Api": "routes", "api_routes": "routes"})
