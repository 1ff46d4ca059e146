"""moco.model: the network. Backbones by name (:mod:`~moco.model.backbones`), the MoCo module with its encoders,
heads and queue (:mod:`~moco.model.builder`), its losses (:mod:`~moco.model.loss`) and synchronized batch norm for
v3 under torchrun (:mod:`~moco.model.sync_bn`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "build_backbone": "backbones", "MoCo": "builder", "momentum_schedule": "builder", "info_nce": "loss",
    "in_batch_loss": "loss", "convert_sync_bn": "sync_bn",
})
