"""moco.training: a run. The command and its flags (:mod:`~moco.training.command`), what a run trains with
(:mod:`~moco.training.setup`, :mod:`~moco.training.memory`), the loop (:mod:`~moco.training.loop`) with its schedule
and optimizers (:mod:`~moco.training.optim`), signals (:mod:`~moco.training.stop`), checkpoints
(:mod:`~moco.training.checkpoints`), metrics (:mod:`~moco.training.metrics`), kNN monitor
(:mod:`~moco.training.knn`) and end-of-run whitening (:mod:`~moco.training.whitening`).
``python -m moco.training`` is torchrun's entry point."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "train": "loop", "train_from_args": "command", "resume_config": "checkpoints", "run_state": "checkpoints",
    "run_end": "checkpoints", "build_model": "setup", "KnnMonitor": "knn",
})
