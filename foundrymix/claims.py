"""Claims on the paths live runs use, so that concurrent runs cannot destroy each other's files.

``EXCLUSIVE``: one run (all processes of one job) -- a ``save_folder``, a conversion's output, a
cache directory the user named; ``SHARED``: any number of readers -- the stream directories a run
reads. Each is refused while the other is held by another run.

How: a process holding claims keeps one file, ``<tmp>/foundrymix-claims/<pid>-<nonce>.run`` (never
in the user's directory), ``flock``-ed while it holds any and listing who it is and every path it
claims: one open file however many paths. The kernel releases ``flock`` when a process dies, even
by SIGKILL, so a claim never goes stale: a run file nobody locks is a dead process's, removed by
the next claimer. Deciding or releasing a claim holds ``decide.lock``, so two never interleave.

The processes of one job share the run id ``MASTER_ADDR:MASTER_PORT`` (the launcher's rendezvous)
and so one exclusive claim; a single process's run id is its pid. Claims are per machine (the
claims directory is local). A forked child inherits its parent's locked file (its claims live
while the child does) but starts with no claims of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator, Optional

from foundrymix.errors import FoundrymixError

EXCLUSIVE = 'exclusive'
SHARED = 'shared'
#: longest command line recorded for a holder
_CMD_CHARS = 200


def claims_dir() -> str:
    return os.path.join(tempfile.gettempdir(), 'foundrymix-claims')


def run_id() -> str:
    """What the processes of one run on this node share: the launcher's rendezvous, or the pid."""
    if int(os.environ.get('WORLD_SIZE', '1') or 1) > 1 and os.environ.get('MASTER_PORT'):
        return f"job {os.environ.get('MASTER_ADDR', '')}:{os.environ['MASTER_PORT']}"
    return f'pid {os.getpid()}'


def normalize(path: str) -> str:
    """The path a claim is about: symbolic links resolved (``s3://...`` URLs as given)."""
    return path if '://' in path else os.path.realpath(os.path.expanduser(path))


def key(path: str) -> str:
    """File-name stem of ``path``'s claim files (``path`` already normalized)."""
    return hashlib.blake2s(path.encode('utf-8'), digest_size=10).hexdigest()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FileLock:
    """An ``flock`` on one file (made if absent), the one lock of the node's files: it belongs to
    the open file, so threads and processes exclude each other alike, and it never goes stale.
    ``with FileLock(path):`` holds it exclusively for the block."""

    def __init__(self, path: str, create: bool = True) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o666)

    def lock(self, shared: bool = False, wait: bool = True) -> bool:
        """Take the lock (waiting unless ``wait`` is False); whether it was taken."""
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
            return True
        except BlockingIOError:
            return False

    def is_current(self) -> bool:
        """The locked file is still the one at ``path`` (not removed or replaced meanwhile)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return False

    def close(self) -> None:
        """Release the lock and the file."""
        os.close(self.fd)

    def __enter__(self) -> 'FileLock':
        self.lock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Holder:
    """A process holding claims, as its run file records it."""

    run: str
    pid: int
    cmd: str = ''

    def who(self) -> str:
        return self.run if self.run.startswith('pid ') else f'{self.run} (pid {self.pid})'

    def describe(self) -> str:
        return f'{self.who()}: {self.cmd}' if self.cmd else self.who()


class Busy(FoundrymixError, ValueError):
    """``path`` is held by other live runs (``holders``; empty when none could be named)."""

    def __init__(self, path: str, mode: str, holders: list[Holder]) -> None:
        self.path, self.mode, self.holders = path, mode, holders
        super().__init__(f'{path} is in use by another live run, {describe(holders)}')


def describe(holders: list[Holder]) -> str:
    return '; '.join(h.describe() for h in holders) or 'a run that could not be named'


#: this process's claims: (path, mode) -> how many users share it
_held: dict[tuple[str, str], int] = {}
#: this process's run file, open and locked while ``_held`` is not empty
_mine: Optional[FileLock] = None


# a forked child keeps the inherited descriptor open (the parent's lock), with no claims of its own
os.register_at_fork(after_in_child=lambda: globals().update(_held={}, _mine=None))


@dataclass
class Claim:
    """One claim of this process; ``fresh`` when no live run held the path before."""

    path: str
    mode: str
    fresh: bool
    released: bool = False

    def release(self) -> None:
        release_all([self])


def _me() -> Holder:
    cmd = shlex.join(getattr(sys, 'orig_argv', None) or [sys.executable, *sys.argv])
    return Holder(run=run_id(), pid=os.getpid(), cmd=cmd[:_CMD_CHARS])


@contextlib.contextmanager
def guard(path: str, suffix: str = '.guard') -> Iterator[None]:
    """Hold a lock named by ``path`` (a caller's lock over several claims of it), removing its
    file on the way out (safe: a locker re-checks that the file it locked is still the one at the path)."""
    root = claims_dir()
    os.makedirs(root, exist_ok=True)
    name = os.path.join(root, key(path) + suffix)
    while True:
        lock = FileLock(name)
        lock.lock()
        if lock.is_current():
            break
        lock.close()  # removed (or replaced) while we waited: lock the current one
    try:
        yield
    finally:
        _remove(name)
        lock.close()


@contextlib.contextmanager
def _deciding() -> Iterator[str]:
    """The claims directory, held against every other process deciding or releasing a claim."""
    root = claims_dir()
    os.makedirs(root, exist_ok=True)
    with FileLock(os.path.join(root, 'decide.lock')):
        yield root


def _remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)


def _live(root: str) -> Iterator[tuple[Holder, list[list[str]]]]:
    """Every live process's claims but this one's (call while deciding); removes dead ones' files."""
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not name.endswith('.run') or (_mine is not None and path == _mine.path):
            continue
        try:
            lock = FileLock(path, create=False)
        except FileNotFoundError:
            continue
        try:
            if lock.lock(shared=True, wait=False):  # nobody holds it: its process is gone
                _remove(path)
                continue
            d = json.loads(os.pread(lock.fd, os.fstat(lock.fd).st_size, 0))
            yield Holder(run=str(d['run']), pid=int(d['pid']), cmd=str(d.get('cmd', ''))), d['claims']
        except (ValueError, KeyError, TypeError):
            continue  # not a run file of this version: names nothing
        finally:
            lock.close()


def _holders(root: str) -> dict[str, list[tuple[Holder, str]]]:
    """path -> the live processes holding it and how (this one included; call while deciding)."""
    index: dict[str, list[tuple[Holder, str]]] = {}
    for holder, held in _live(root):
        for path, mode in held:
            index.setdefault(path, []).append((holder, mode))
    me = _me()
    for path, mode in _held:
        index.setdefault(path, []).append((me, mode))
    return index


def _owner(held: list[tuple[Holder, str]]) -> Optional[Holder]:
    return next((h for h, mode in held if mode == EXCLUSIVE), None)


def _save(root: str) -> None:
    """Write this process's claims into its run file (made and locked at the first), or remove
    the file when none is left (call while deciding)."""
    global _mine
    if not _held:
        if _mine is not None:
            _remove(_mine.path)
            _mine.close()
            _mine = None
        return
    if _mine is None:
        _mine = FileLock(os.path.join(root, f'{os.getpid()}-{secrets.token_hex(4)}.run'))
        _mine.lock()
    data = json.dumps({**asdict(_me()), 'claims': [list(k) for k in _held]}).encode('utf-8')
    os.ftruncate(_mine.fd, 0)
    os.pwrite(_mine.fd, data, 0)


def exclusive_owner(path: str) -> Optional[Holder]:
    """The live run holding ``path`` exclusively, if any (``path`` normalized)."""
    with _deciding() as root:
        return _owner(_holders(root).get(path, []))


def try_claim(path: str, mode: str) -> Claim:
    """Claim ``path`` (normalized) for this run, or raise :class:`Busy` naming who holds it."""
    return claim_all([(path, mode)])[0]


def claim_all(wanted: Iterable[tuple[str, str]]) -> list[Claim]:
    """Claim every ``(path, mode)`` (paths normalized) for this run, all or none: the first
    refused raises :class:`Busy` naming who holds it, and nothing is claimed.

    ``EXCLUSIVE`` is granted when nobody holds the path or this run holds it exclusively
    (another rank of the job joins); ``SHARED`` unless another run holds it exclusively.
    A path this process holds already is shared by its users (counted, released by the last).
    """
    wanted = list(wanted)
    new = [k for k in dict.fromkeys(wanted) if k not in _held]
    fresh: dict[tuple[str, str], bool] = {}
    if new:
        me = _me()
        with _deciding() as root:
            index = _holders(root)
            for path, mode in new:
                held = index.setdefault(path, [])
                owner = _owner(held)
                mine = owner is not None and owner.run == me.run
                if mode == EXCLUSIVE and held and not mine:
                    raise Busy(path, mode, [owner] if owner is not None else
                               list({h.pid: h for h, _ in held}.values()))
                if mode == SHARED and owner is not None and not mine:
                    raise Busy(path, mode, [owner])
                fresh[(path, mode)] = not held
                held.append((me, mode))
            for k in new:
                _held[k] = 0
            _save(root)
    out = []
    for k in wanted:
        _held[k] += 1
        out.append(Claim(*k, fresh=fresh.pop(k, False)))
    return out


def release_all(done: Iterable[Claim]) -> None:
    """Release claims of this process (each once; a path goes when its last user releases it)."""
    gone = False
    for claim in done:
        k = (claim.path, claim.mode)
        if claim.released or k not in _held:
            continue
        claim.released = True
        _held[k] -= 1
        if _held[k] <= 0:
            del _held[k]
            gone = True
    if gone:
        with _deciding() as root:
            _save(root)


@dataclass
class ClaimSet:
    """Claims held together (one run's) and released together."""

    held: list[Claim] = field(default_factory=list)

    def release(self) -> None:
        done, self.held = self.held, []
        release_all(done)
