"""``python -m app.cli``: the ``moco`` command."""

from app.cli.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
