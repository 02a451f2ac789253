"""The one base of every error foundrymix raises for a person to act on: the command line prints
these as one line (exit 2), every other exception keeps its traceback (a bug to report). Each
class keeps the builtin base callers catch (``ValueError``, ``FileNotFoundError``, ...).
"""

from __future__ import annotations

import os
import select
import sys
from typing import Any, Sequence


class FoundrymixError(Exception):
    """An error whose message says what is wrong and what to do (printed as one line)."""


class WorkerError(FoundrymixError, ValueError):
    """An error raised in a DataLoader worker that keeps its one line in the main process.

    torch re-raises a worker's exception as ``type(text of the worker's traceback)``; the
    traceback is dropped here, keeping the message after the last ``<Class>: ``.
    """

    def __init__(self, text: str = '') -> None:
        marker = f'{type(self).__name__}: '
        if 'Original Traceback' in text and marker in text:
            text = text.rsplit(marker, 1)[1].strip()
        super().__init__(text)


class UserError(FoundrymixError, ValueError):
    """Bad input, option or data: the message names it."""


class UserErrors(UserError):
    """Several problems found in one pass; the command line prints one line for each."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.lines = list(lines)
        super().__init__('\n'.join(self.lines))


class MissingError(FoundrymixError, FileNotFoundError):
    """A file or directory the user named does not exist (or is not what it should be)."""


class ExistsError(FoundrymixError, FileExistsError):
    """Something the user owns is in the way; the message says how to proceed."""


class Interrupted(FoundrymixError):
    """A run stopped by a signal: the message says where and how to resume (empty: nothing to
    say, another rank says it); the command exits ``128 + signal``, as a shell reports one."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.code = 128 + signum


def run_command(args: Any) -> int:
    """Run a parsed subcommand (``args.func``); a user-facing error becomes one line per problem,
    exit 2. Here, not in ``cli.py``, because ``train.py`` runs through it too."""
    try:
        return int(args.func(args) or 0)
    except Interrupted as e:
        if str(e):
            print(f'foundrymix {args.command}: {e}', file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print('interrupted', file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe (a worker's): a bug to report
        return 141  # the reader of our output left (`| head`): exit as a shell's SIGPIPE does
    except (FoundrymixError, FileNotFoundError, FileExistsError, PermissionError) as e:
        # An OS error about a file names it. Any other exception -- a ValueError included --
        # is a bug, and keeps its traceback.
        for line in getattr(e, 'lines', None) or [str(e)]:
            print(f'foundrymix {args.command}: error: {line}', file=sys.stderr)
        return 2


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (``poll`` reports an error on
    it); if so it is pointed at ``/dev/null``, so Python's flush at exit does not fail too."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return gone
