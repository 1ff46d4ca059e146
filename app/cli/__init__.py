"""app.cli: the ``moco`` command line. The parser and the small commands (:mod:`~app.cli.commands`), ``moco index``
(:mod:`~app.cli.index`), ``moco serve`` and ``moco run`` (:mod:`~app.cli.serve`), ``moco embed``
(:mod:`~app.cli.embed`)."""

from moco._lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"main": "commands", "build_parser": "commands"})
