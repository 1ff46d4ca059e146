"""The exception types that carry a message for the user: bad input, and storage or a download that failed under us.

Each has the CLI's ``exit_code``: 2 for bad input, 1 for a failure that is not the user's input.
"""

from __future__ import annotations

import errno
import os

__all__ = ["UserError", "NotFoundError", "StorageError", "NetworkError", "storage_error", "quoted", "clipped",
           "plural", "MAX_QUOTED"]

# What a message repeats of a value it was given (a folder, a name, an id from a request) at most, in characters:
# a 20 MB folder string never comes back in a 20 MB message, nor goes into a log.
MAX_QUOTED = 200


class UserError(ValueError):
    """Bad input from the user: the message names the file or value and the fix.

    The CLI turns it into a message on stderr and exit code 2; libraries raise it for anything the
    caller can fix (a path, a flag, a file), never for internal invariants.
    """

    exit_code = 2


class NotFoundError(UserError):
    """The input names something that is not there (a group of the last search for duplicates, an action of the
    journal, a saved search): the JSON API answers 404; the CLI exits 2, as for any bad input."""


class StorageError(UserError):
    """Our own write failed (disk full, read-only, I/O error): the message names the path, the cause and the fix.

    The CLI prints it and exits 1 (not bad input); what was committed before the failure is kept.
    """

    exit_code = 1


class NetworkError(UserError):
    """A download failed (offline, refused, an HTTP error, a damaged or incomplete file): the message names the URL,
    the path and the fix. The CLI prints it and exits 1 (not bad input)."""

    exit_code = 1


def clipped(text: str, limit: int = MAX_QUOTED) -> str:
    """``text`` itself when it has at most ``limit`` characters, else its start and how long it was."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def plural(n: int, word: str, words: str | None = None) -> str:
    """``n`` and the noun for it, as a message counts: ``1 photo``, ``2 photos``, ``0 groups`` (``words``: an
    irregular plural)."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def quoted(value: object, limit: int = MAX_QUOTED) -> str:
    """``repr(value)`` as a message quotes it: at most about ``limit`` characters of it (see :func:`clipped`)."""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} characters)"
    return clipped(repr(value), limit)


def storage_error(err: OSError, path: str | os.PathLike[str], doing: str = "writing") -> StorageError:
    """A :class:`StorageError` for ``err`` raised while ``doing`` ``path``, phrased by its cause."""
    code = err.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        return StorageError(f"no space left on device while {doing} {path}: free space and run the same "
                            "command (nothing saved before this point is lost)")
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return StorageError(f"cannot write {path} ({err.strerror or err}): the location is read-only; make it "
                            "writable or choose another location, then run the same command")
    return StorageError(f"I/O error while {doing} {path} ({err.strerror or err}): check the disk, then run the "
                        "same command (nothing saved before this point is lost)")
