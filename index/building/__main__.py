"""``python -m index.building PHOTOS --backbone B -o IDX`` or ``python -m index.building update IDX`` (under torchrun
too)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """``torchrun ... -m index.building PHOTOS --backbone B -o IDX`` or ``-m index.building update IDX``; 2 on bad
    input. The flags are read before torch loads: ``--help`` and a bad flag answer at once."""
    from index.building import args as a

    argv = list(sys.argv[1:] if argv is None else argv)
    update = bool(argv) and argv[0] == "update"
    if update:
        parser = argparse.ArgumentParser(prog="python -m index.building update", description=a.UPDATE_DESCRIPTION)
        a.add_update_arguments(parser)
    else:
        parser = argparse.ArgumentParser(prog="python -m index.building", description=a.BUILD_DESCRIPTION,
                                         epilog=f"python -m index.building update IDX: {a.UPDATE_HELP}")
        a.add_build_arguments(parser)
    args = parser.parse_args(argv[1:] if update else argv)
    from index.building.runner import run_cli
    from moco.errors import UserError
    from moco.runtime import setup_logging

    setup_logging()
    try:
        return run_cli(args, update)
    except UserError as e:  # StorageError (disk full, read-only) exits 1: not bad input
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
