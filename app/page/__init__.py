"""app.page: the search page. What it does, as plain methods (:mod:`~app.page.handlers`), what its tabs show
(:mod:`~app.page.views`), its Gradio Blocks (:mod:`~app.page.blocks`), the uploads it takes (:mod:`~app.page.uploads`)
and the Negatives tab's sources (:mod:`~app.page.negatives`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"SearchApp": "handlers", "build_ui": "blocks"})
