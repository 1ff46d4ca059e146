"""``python -m moco.training``: train, with the flags of ``moco train`` (the entry point for torchrun)."""

from moco.training.command import main

if __name__ == "__main__":
    raise SystemExit(main())
