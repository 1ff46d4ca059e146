"""Names the command line's parser needs, kept free of torch so that ``moco --help`` or ``moco index stats`` starts
in a fraction of a second: the export formats and the ViT family's names."""

from __future__ import annotations

__all__ = ["FORMATS", "is_vit"]

FORMATS = ("safetensors", "timm", "onnx", "pt2")  # what `moco export --format` writes (moco.export_writers)


def is_vit(arch: str) -> bool:
    """True for the Vision Transformer family (timm ``vit_*`` / ``deit*``), which v3 trains with AdamW."""
    name = arch.removeprefix("timm/").lower()
    return name.startswith(("vit_", "deit"))
