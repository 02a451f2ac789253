"""The one base of every error foundrymix raises for a person to act on: the command line prints
these as one line (exit 2), every other exception keeps its traceback (a bug to report). Each
class keeps the builtin base callers catch (``ValueError``, ``FileNotFoundError``, ...). Also the
one ``ConfigError`` and the check of a mapping's keys, with the nearest valid key or LLM-Foundry's
rename in every error.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
import select
import sys
from typing import Any, Mapping, Optional, Sequence


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


class ConfigError(FoundrymixError, ValueError):
    """A config cannot run; the message names the key path (and file). ``path``: that key path
    (default: the message's ``path:`` prefix), to blame the ``key=value`` override that set it."""

    def __init__(self, message: str, path: Optional[str] = None) -> None:
        super().__init__(message)
        if path is None:
            m = _PATH_PREFIX.match(message)
            path = m.group(1) if m else None
        self.path = path


_PATH_PREFIX = re.compile(r'^([A-Za-z_][\w.\[\]-]*): ')


class ConfigErrors(UserErrors, ConfigError):
    """Every problem of a config found in one reading (not one refusal per run), one
    :class:`ConfigError` per line."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors = list(errors)
        UserErrors.__init__(self, [str(e) for e in self.errors])
        self.path = None


def errors_of(e: ConfigError) -> list[ConfigError]:
    """The single errors inside ``e`` (itself, unless it is a :class:`ConfigErrors`)."""
    return list(e.errors) if isinstance(e, ConfigErrors) else [e]


class Gather:
    """``with gather: ...`` records a :class:`ConfigError` raised inside and goes on; :meth:`raise_any`
    raises the one error unchanged (its class kept) or a :class:`ConfigErrors` of all of them."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def __enter__(self) -> 'Gather':
        return self

    def __exit__(self, tp: Any, e: Any, tb: Any) -> bool:
        if isinstance(e, ConfigError):
            self.add(e)
        return isinstance(e, ConfigError)

    def add(self, e: ConfigError) -> None:
        self.errors.extend(errors_of(e))

    def raise_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigErrors(self.errors)


#: LLM-Foundry keys (key path; ``*`` matches one name) and what a foundrymix YAML says
#: instead, or why there is nothing to say. An unknown key found here gets this advice
#: instead of the nearest allowed key (``fsdp_config`` is not a typo of anything).
FOUNDRY_RENAMES: dict[str, str] = {
    'fsdp_config': "LLM-Foundry's fsdp_config is 'fsdp' here (same keys)",
    'console_log_interval': "LLM-Foundry's console_log_interval is 'log_interval' here",
    'global_seed': "LLM-Foundry's global_seed is 'seed' here",
    'log_to_console': "LLM-Foundry's log_to_console: the console logger is on unless loggers leaves "
                      "it out (loggers: {console: {}}); delete the key",
    'python_log_level': "LLM-Foundry's python_log_level has no equivalent; delete it",
    'dist_timeout': "LLM-Foundry's dist_timeout has no equivalent; delete it",
    'icl_tasks': "LLM-Foundry's in-context-learning evaluation (icl_tasks) is not supported; "
                 "delete it (see docs/train.md)",
    'icl_subset_num_batches': "LLM-Foundry's in-context-learning evaluation is not supported; delete it",
    'icl_seq_len': "LLM-Foundry's in-context-learning evaluation is not supported; delete it",
    'eval_gauntlet': "LLM-Foundry's eval gauntlet is not supported; delete it (see docs/train.md)",
    'save_weights_only': "LLM-Foundry's save_weights_only has no equivalent (checkpoints hold the "
                         "optimizer and loader state, for resuming); delete it",
    '*_loader.name': "LLM-Foundry's loader name (text, finetuning) has no equivalent: each stream's "
                     "converted format decides; delete it",
    '*_loader.dataset': "LLM-Foundry's {loader}.dataset: its keys go directly under {loader} "
                        "(dataset.streams -> {loader}.streams; dataset.local/remote/split -> "
                        "{loader}.streams.NAME.local/remote/split; dataset.shuffle, shuffle_seed, ... -> "
                        "{loader}.shuffle, ...; dataset.max_seq_len -> the top-level max_seq_len)",
    '*_loader.streams.*.weight': "LLM-Foundry has no stream 'weight'; give repeat, proportion or choose",
    'model.name': "LLM-Foundry's model.name (hf_causal_lm, mpt_causal_lm) is model.type here: a "
                  "transformers model_type (llama, gpt2, mpt, ...)",
    'model.init_device': "LLM-Foundry's model.init_device has no equivalent (fsdp builds the model); "
                         "delete it",
    'model.loss_fn': "LLM-Foundry's model.loss_fn has no equivalent (the loss is transformers' "
                     "cross-entropy on the labels); delete it",
}


def foundry_advice(path: str) -> Optional[str]:
    """The :data:`FOUNDRY_RENAMES` advice for key path ``path``, or None."""
    for pattern, advice in FOUNDRY_RENAMES.items():
        if fnmatch.fnmatchcase(path, pattern) and path.count('.') == pattern.count('.'):
            return advice.replace('{loader}', path.split('.')[0])
    return None


def did_you_mean(key: str, allowed: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` for the allowed key nearest to ``key``, or ``''``."""
    near = difflib.get_close_matches(key, list(allowed), n=1)
    return f'; did you mean {near[0]!r}?' if near else ''


def check_keys(d: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    """Refuse keys not in ``allowed`` (every one of them, one error each), naming the key, every
    allowed one and the nearest (or LLM-Foundry's spelling's equivalent)."""
    gather = Gather()
    for key in d:
        if key not in allowed:
            path = join(where, str(key))
            advice = foundry_advice(path)
            hint = f'; {advice}' if advice else did_you_mean(str(key), allowed)
            gather.add(ConfigError(f'{where or "config"}: unknown key {key!r}; allowed: '
                                   f'{", ".join(allowed)}{hint}', path=path))
    gather.raise_any()


def join(where: str, key: str) -> str:
    """The key path of ``key`` inside section ``where`` (``''`` is the top level)."""
    return f'{where}.{key}' if where else key


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
