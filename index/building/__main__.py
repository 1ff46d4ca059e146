"""``python -m index.building PHOTOS --backbone B -o IDX`` or ``python -m index.building update IDX`` (under torchrun
too)."""

from index.building.runner import main

if __name__ == "__main__":
    raise SystemExit(main())
