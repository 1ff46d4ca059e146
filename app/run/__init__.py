"""app.run: ``moco run``, photos to a served page in one command (:mod:`~app.run.pipeline`), and what it is doing
now, for the Status tab (:mod:`~app.run.status`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"run_pipeline": "pipeline", "RunStatus": "status"})
