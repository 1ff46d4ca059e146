"""moco.weights: checkpoints of every layout (ours, official MoCo v1/v2/v3, lightly, solo-learn) read into one form
(:mod:`~moco.weights.layouts`), the backbone they hold (:mod:`~moco.weights.arch`), and the official checkpoints by
name (:mod:`~moco.weights.pretrained`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "read_checkpoint": "layouts", "load_checkpoint": "layouts", "load_init": "layouts", "SplitCheckpoint": "layouts",
    "detect_arch": "arch", "resolve": "pretrained", "fetch": "pretrained", "REGISTRY": "pretrained",
    "moco_home": "pretrained",
})
