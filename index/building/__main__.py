"""``python -m index.build PHOTOS --backbone B -o IDX`` or ``python -m index.build update IDX`` (under torchrun too)."""

from index.build.runner import main

if __name__ == "__main__":
    raise SystemExit(main())
