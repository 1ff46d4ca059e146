"""moco.export: a clean backbone from any supported MoCo checkpoint (:mod:`~moco.export.exporter`), written in each
format by its writer (:mod:`~moco.export.writers`) with its metadata (:mod:`~moco.export.meta`), and read back with
that metadata checked (:mod:`~moco.export.reader`)."""

from moco._lazy import lazy_face

FORMATS = ("safetensors", "timm", "onnx", "pt2")  # what `moco export --format` writes (moco.export.writers)

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "export_backbone": "exporter", "load_exported": "reader", "build_exported": "reader", "embedding_dim": "reader",
    "BackboneMeta": "meta",
})
__all__ = ["FORMATS", *__all__]
