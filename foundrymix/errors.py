"""The one base of every error foundrymix raises for a person to act on.

Why: the command line turns these into one line naming the file, line or field (exit 2),
and lets every other exception keep its traceback -- a ``ValueError`` from a bug in
foundrymix or a library is a bug to report, not a message to act on. Each class also
keeps the builtin base callers catch (``ValueError``, ``FileNotFoundError``, ...).
"""

from __future__ import annotations


class FoundrymixError(Exception):
    """An error whose message says what is wrong and what to do (printed as one line)."""


class UserError(FoundrymixError, ValueError):
    """Bad input, option or data: the message names it."""


class MissingError(FoundrymixError, FileNotFoundError):
    """A file or directory the user named does not exist (or is not what it should be)."""


class ExistsError(FoundrymixError, FileExistsError):
    """Something the user owns is in the way; the message says how to proceed."""
