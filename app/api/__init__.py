"""app.api: the JSON API beside the page: its routes (:mod:`~app.api.routes`), their models (:mod:`~app.api.models`),
its docs page (:mod:`~app.api.docs`) and the batcher that embeds searches arriving together as one batch
(:mod:`~app.api.batcher`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"SearchService": "routes", "api_routes": "routes"})
