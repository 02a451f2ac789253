"""Claims on the paths live runs use, so that concurrent runs cannot destroy each other's files.

``EXCLUSIVE``: one run (all processes of one job), e.g. a ``save_folder`` or a conversion's output;
``SHARED``: any number of readers, e.g. the stream directories a run reads. Each is refused while
the other is held by another run.

Per path, files in ``<tmp>/foundrymix-claims`` named by its hash (never in the user's directory)
carry ``flock`` locks, which the kernel drops when a holder dies (even SIGKILL), so a claim never
goes stale; record files only name holders. A job's processes share the run id
``MASTER_ADDR:MASTER_PORT`` (else the pid). Claims are per machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

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
    """An ``flock`` on one file (made if absent): exclusive, or shared with other shared holders.

    The one lock of the node's files. It belongs to the open file, so threads and processes
    exclude each other alike, and it never goes stale. Opening raises ``OSError`` before anything
    is locked. ``with FileLock(path):`` holds it exclusively for the block."""

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
    """A process holding a claim, as recorded in its ``.owner`` / ``.reader-<pid>`` file."""

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


@dataclass
class _Held:
    locks: list[FileLock]
    count: int = 1


#: claims this process holds: (path, mode) -> open lock files and reference count
_held: dict[tuple[str, str], _Held] = {}


@dataclass
class Claim:
    """One claim of this process; ``fresh`` when no live run held the path before."""

    path: str
    mode: str
    fresh: bool
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            _release(self.path, self.mode)


def _me() -> Holder:
    cmd = shlex.join(getattr(sys, 'orig_argv', None) or [sys.executable, *sys.argv])
    return Holder(run=run_id(), pid=os.getpid(), cmd=cmd[:_CMD_CHARS])


@contextlib.contextmanager
def guard(path: str, suffix: str = '.guard') -> Iterator[None]:
    """Hold ``path``'s guard lock (``suffix`` ``.group``: a caller's lock over several claims),
    removing its file when no claim of ``path`` is left (safe: a locker re-checks the file it locked)."""
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
        stem = name[:-len(suffix)]
        if suffix != '.guard' or not _any_claim_file(stem):
            _remove(name)
        lock.close()


def _any_claim_file(h: str) -> bool:
    return (any(os.path.exists(h + s) for s in ('.inuse', '.excl', '.owner'))
            or bool(glob.glob(glob.escape(h) + '.reader-*')))


def _open_existing(name: str) -> Optional[FileLock]:
    try:
        return FileLock(name, create=False)
    except FileNotFoundError:
        return None


def _read(name: str) -> Optional[Holder]:
    try:
        with open(name, encoding='utf-8') as f:
            d = json.load(f)
        return Holder(run=str(d['run']), pid=int(d['pid']), cmd=str(d.get('cmd', '')))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(name: str, holder: Holder) -> None:
    tmp = f'{name}.part-{os.getpid()}'
    with open(tmp, 'w', encoding='utf-8') as f:
        json.dump(asdict(holder), f)
    os.replace(tmp, name)


def _remove(*names: str) -> None:
    for name in names:
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


def _readers(h: str) -> list[Holder]:
    found = (_read(n) for n in sorted(glob.glob(glob.escape(h) + '.reader-*')))
    return [r for r in found if r is not None and pid_alive(r.pid)]


def _state(h: str) -> tuple[bool, Optional[Holder]]:
    """(anyone holds the path, its live exclusive owner); call under the guard. Creates no
    file: a holder keeps ``.inuse`` open (and ``.excl``, if exclusive), so a missing one is
    not held."""
    lock = _open_existing(h + '.inuse')
    if lock is None:
        return False, None
    try:
        if lock.lock(wait=False):
            return False, None
    finally:
        lock.close()
    lock = _open_existing(h + '.excl')
    if lock is None:
        return True, None
    try:
        if lock.lock(wait=False):
            return True, None
        return True, _read(h + '.owner') or Holder(run='unknown', pid=0)
    finally:
        lock.close()


def exclusive_owner(path: str) -> Optional[Holder]:
    """The live run holding ``path`` exclusively, if any (``path`` normalized)."""
    with guard(path):
        return _state(os.path.join(claims_dir(), key(path)))[1]


def try_claim(path: str, mode: str) -> Claim:
    """Claim ``path`` (normalized) for this run, or raise :class:`Busy` naming who holds it.

    ``EXCLUSIVE`` is granted when nobody holds the path or this run holds it exclusively
    (another rank of the job joins); ``SHARED`` unless another run holds it exclusively.
    """
    held = _held.get((path, mode))
    if held is not None:  # this process holds it already: its users share the claim
        held.count += 1
        return Claim(path, mode, fresh=False)
    me = _me()
    h = os.path.join(claims_dir(), key(path))
    with guard(path):
        busy, owner = _state(h)
        if not busy:  # records left by dead holders
            _remove(h + '.owner', h + '.inuse', h + '.excl', *glob.glob(glob.escape(h) + '.reader-*'))
        mine = owner is not None and owner.run == me.run
        if mode == EXCLUSIVE and busy and not mine:
            raise Busy(path, mode, [owner] if owner is not None else _readers(h))
        if mode == SHARED and owner is not None and not mine:
            raise Busy(path, mode, [owner])
        locks = [FileLock(h + '.inuse')]
        if mode == EXCLUSIVE:
            locks.append(FileLock(h + '.excl'))
            if not busy:
                _write(h + '.owner', me)
        else:
            _write(f'{h}.reader-{me.pid}', me)
        for lock in locks:
            lock.lock(shared=True)
        _held[(path, mode)] = _Held(locks)
        return Claim(path, mode, fresh=not busy)


def _release(path: str, mode: str) -> None:
    held = _held.get((path, mode))
    if held is None:
        return
    held.count -= 1
    if held.count > 0:
        return
    del _held[(path, mode)]
    h = os.path.join(claims_dir(), key(path))
    with guard(path):
        if mode == SHARED:
            _remove(f'{h}.reader-{os.getpid()}')
        for lock in held.locks:
            lock.close()
        if not _state(h)[0]:  # nobody else holds it: its files go (claimers open them under the guard)
            _remove(h + '.owner', h + '.inuse', h + '.excl', *glob.glob(glob.escape(h) + '.reader-*'))


@dataclass
class ClaimSet:
    """Claims held together (one run's) and released together."""

    held: list[Claim] = field(default_factory=list)

    def release(self) -> None:
        while self.held:
            self.held.pop().release()
