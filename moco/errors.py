"""The one exception type that means "the user gave us something we cannot use"."""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(ValueError):
    """Bad input from the user: the message names the file or value and the fix.

    The CLI turns it into a message on stderr and exit code 2; libraries raise it for anything the
    caller can fix (a path, a flag, a file), never for internal invariants.
    """
