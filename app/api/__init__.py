"""app.api: the JSON API beside the page: one router per resource (:mod:`~app.api.search`, :mod:`~app.api.photos`,
:mod:`~app.api.duplicates`, :mod:`~app.api.collection`) composed by :mod:`~app.api.routes`, what they serve from
(:mod:`~app.api.state`), how they answer errors (:mod:`~app.api.errors`), their models (:mod:`~app.api.models`), its
docs page (:mod:`~app.api.docs`) and the gate of the views of the whole collection (:mod:`~app.api.gate`); its
searches are :mod:`app.search`'s, its collection :mod:`app.collection`'s."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"Api": "state", "api_routes": "routes"})
