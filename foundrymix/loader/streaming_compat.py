"""The one module that touches streaming's private runtime internals (version-checked).

Why one place: foundrymix works around streaming 0.13 behaviours that its public API does
not reach -- shard states when naming a failed shard, shared-memory segments a dropped
dataset would keep until exit, the filelocks a killed run leaves, the prefix scan that
leaks descriptors and tests every dead prefix's filelocks 18 times. Each touch is here,
named after what it does, so a new streaming (or the ``streaming-community`` fork, same
import name) is checked in one module; everything else imports streaming's public names only (``tests/test_layout.py`` fails otherwise).
Besides this module, ``format/streaming_format.py`` and ``s3/remote.py`` use its hashing,
codecs and downloaders. The sample order is foundrymix's own (``plan/order.py``).

Tested with mosaicml-streaming 0.13.0 (see docs/streaming-community.md for the fork).
On import, a streaming version outside :data:`TESTED` is logged once, naming this module.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from typing import Any, Iterator, Optional

log = logging.getLogger(__name__)

#: streaming versions (prefixes) these workarounds were written and tested against
TESTED = ('0.13.', '0.14.')  # 0.14: streaming-community (docs/streaming-community.md)


def check_version() -> Optional[str]:
    """A warning when the installed streaming is not a tested version (None if it is)."""
    import streaming
    version = getattr(streaming, '__version__', 'unknown')
    if version.startswith(TESTED):
        return None
    return (f'streaming {version} is installed; {__name__} ({__file__}) holds foundrymix\'s uses '
            f'of streaming\'s private internals and was tested with {", ".join(t + "x" for t in TESTED)}: '
            f'if the loader misbehaves, start there')


_warned = False


def warn_if_untested() -> None:
    global _warned
    if not _warned:
        _warned = True
        text = check_version()
        if text:
            log.warning(text)


def shard_state() -> Any:
    """streaming's ``_ShardState`` enum (a shard's slot in the dataset's shared state array)."""
    from streaming.base.dataset import _ShardState
    return _ShardState


def cache_lock(dataset: Any) -> Any:
    """A dataset's cache filelock (download, evict and ``cache_usage`` under one lock).

    Why two paths: mosaicml-streaming 0.13 never sets ``_cache_filelock`` in ``__init__``
    (each ``prepare_shard`` creates a new one), while streaming-community 0.14 sets it to
    ``None`` there and hands out a per-process lock from ``_get_cache_filelock()``; a
    ``hasattr`` test then took ``None`` for the lock (every download under a
    ``cache_limit`` failed with a ``TypeError``).
    """
    get = getattr(dataset, '_get_cache_filelock', None)
    if get is not None:
        return get()
    if getattr(dataset, '_cache_filelock', None) is None:
        from filelock import FileLock
        dataset._cache_filelock = FileLock(dataset._cache_filelock_path)
    return dataset._cache_filelock


def world_size() -> int:
    """The ranks of this job as streaming reads them from the launcher's environment."""
    from streaming.base.distributed import get_world_size
    return get_world_size()


def global_rank() -> int:
    """This process's rank as streaming reads it from the launcher's environment."""
    from streaming.base.distributed import get_rank
    return get_rank()


def filelock_names() -> tuple[str, str]:
    """The names of the barrier and cache filelocks streaming keeps per shared-memory prefix."""
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK
    return BARRIER_FILELOCK, CACHE_FILELOCK


def shm_names_to_clean() -> list[str]:
    """The shared-memory segment names streaming creates per prefix (``SHM_TO_CLEAN``)."""
    from streaming.base.constant import SHM_TO_CLEAN
    return list(SHM_TO_CLEAN)


def bytes_to_int(text: Any) -> int:
    """streaming's reading of a size such as ``cache_limit: 10gb``."""
    from streaming.base.util import bytes_to_int as convert
    return convert(text)


@contextlib.contextmanager
def choosing_prefix() -> Iterator[None]:
    """Build a ``StreamingDataset`` inside this: streaming's shared-memory prefix choice
    with the workarounds below (:func:`prefix_scan_without_leaks`,
    :func:`prefix_scan_skips_locked`, :func:`ranks_take_leaders_prefix`). The one wiring
    point (``MixedDataset.__init__``)."""
    with prefix_scan_without_leaks(), prefix_scan_skips_locked(), ranks_take_leaders_prefix():
        yield


@contextlib.contextmanager
def ranks_take_leaders_prefix() -> Iterator[None]:
    """Every rank of a node uses the prefix its local leader registers.

    Why: in streaming 0.13 (and streaming-community 0.14.2) ``get_shm_prefix`` has every
    rank pick "the first free prefix" by scanning ``/dev/shm`` on its own, before the
    first barrier; only the local leader then creates ``<prefix>_locals``, and the others
    check that it is theirs. Another job on the machine that registers or releases a
    prefix between two ranks' scans makes them disagree, and the job dies at start with
    ``shared memory prefix=N was not registered by local leader`` (a 2-rank CI test beside
    other jobs; ``tests/loader/test_shm_prefix.py`` makes it happen on every try) -- as
    does the job's own leader releasing the previous dataset while another rank already
    scans for the next (a stage switch; 13 failures in 13 tries of that test). The
    machine-wide lock (``cache.registering_prefix``) cannot close that window: it is held
    by the leader only, as the non-leaders scan while their leader may still wait for it.

    How: only the local leader scans (streaming's own scan, ``_check_and_find_retrying``
    per segment name, the maximum as ``get_shm_prefix`` takes it; the others skip it: no
    wall time saved, as they wait for the leader's, measured 340-363 ms per dataset on 2
    ranks before and after with ~12,000 filelocks in ``/tmp``, but no CPU spent); the process
    group's store hands the other ranks of its node its result (a scan error too, e.g.
    ``Reused local directory``: they raise it rather than wait for a leader that failed;
    :func:`_leaders_choice`); then streaming's ``get_shm_prefix`` runs as before -- the
    leader registers, the others check -- with that prefix in place of its scan. "Local
    leader" is streaming's: the ``World`` it passes (``RANK``, ``LOCAL_WORLD_SIZE``).
    With one rank per node, or without an initialised ``torch.distributed``, streaming's
    own choice is kept: streaming initialises it itself whenever ``WORLD_SIZE`` > 1
    (``maybe_init_dist``), so that is a torch built without it, where streaming's check
    has no barrier to wait on either.
    """
    from streaming.base import dataset
    from streaming.base.constant import SHM_TO_CLEAN
    from streaming.base.shared import prefix
    from torch import distributed as dist

    original = dataset.get_shm_prefix

    def get_shm_prefix(streams_local: list[str], streams_remote: list[Optional[str]], world: Any,
                       retry: int = 100) -> Any:
        if world.ranks_per_node <= 1 or not (dist.is_available() and dist.is_initialized()):
            return original(streams_local, streams_remote, world, retry)
        scan = prefix._check_and_find_retrying
        chosen = _leaders_choice(world, lambda: max(
            scan(streams_local, streams_remote, shm_name=name, retry=retry) for name in SHM_TO_CLEAN))
        prefix._check_and_find_retrying = lambda *args, **kwargs: chosen
        try:
            return original(streams_local, streams_remote, world, retry)
        finally:
            prefix._check_and_find_retrying = scan

    dataset.get_shm_prefix = get_shm_prefix
    try:
        yield
    finally:
        dataset.get_shm_prefix = original


#: how many prefixes this process chose: the same count on every rank of a job, as every
#: rank builds the same datasets in the same order (streaming's barriers require it)
_choices = itertools.count()


def _leaders_choice(world: Any, scan: Any) -> int:
    """``scan()`` on the local leader; every rank of its node gets the result (or its error).

    Through the process group's key-value store (torch 2.7: ``_get_default_store``), not a
    collective: one path for gloo and NCCL, with no CUDA device involved (an object
    collective over NCCL uses the current device, which the ranks have not set when
    streaming initialised the group itself, as for foundrymix's train loader, built before
    Composer's ``Trainer``), and nothing to create or destroy per dataset (a gloo group
    made and destroyed per dataset hung a rank in its destructor: 2 runs in 6 of 30
    datasets built back to back). The key names the node and the count of choices.
    """
    import pickle

    from torch.distributed import distributed_c10d
    store = distributed_c10d._get_default_store()
    key = f'foundrymix/shm_prefix/{next(_choices)}/node{world.node}'
    if world.is_local_leader:
        try:
            mine = scan()
        except Exception as e:  # handed on, so that the other ranks raise it rather than wait
            try:
                store.set(key, pickle.dumps(e))
            except Exception:
                store.set(key, pickle.dumps(RuntimeError(f'{type(e).__name__}: {e}')))
            raise
        store.set(key, pickle.dumps(int(mine)))
        return int(mine)
    got = pickle.loads(store.get(key))
    if isinstance(got, BaseException):
        raise got
    return int(got)


@contextlib.contextmanager
def prefix_scan_without_leaks() -> Iterator[None]:
    """Let streaming's shared-memory prefix scan close what it only peeks at.

    Why: to pick a prefix, streaming 0.13 opens the ``<prefix>_locals`` segment of every
    live dataset in this machine's ``/dev/shm`` (``shared/prefix.py:_check_and_find``) with
    ``auto_cleanup=True``, which registers each with ``atexit`` and so keeps its file
    descriptors open until the process exits. Each new dataset thus leaks a descriptor or
    two per dataset already alive -- quadratic in a process that builds many (a staged
    run, a notebook, the test suite hit the 20,000-descriptor limit). Segments opened
    without creating them are only read, so they need no cleanup at exit: they are closed
    when dropped. Segments streaming creates keep their cleanup.
    """
    from streaming.base.shared import prefix

    original = prefix.SharedMemory
    prefix.SharedMemory = _peeked_class()
    try:
        yield
    finally:
        prefix.SharedMemory = original


@contextlib.contextmanager
def prefix_scan_skips_locked() -> Iterator[None]:
    """Let streaming's prefix scan skip, from one listing of the temporary directory, the
    prefixes whose filelocks exist.

    Why: streaming 0.13 (and streaming-community 0.14) leaves ``<tmp>/NNNNNN_barrier_filelock``
    and ``NNNNNN_cache_filelock`` behind for every dataset that ever ran on the machine and
    skips a prefix while either exists; to pick a prefix, ``get_shm_prefix`` walks the
    prefixes from 0 once per segment name (9 names), testing both filelocks with
    ``os.path.exists`` at each -- 18 ``stat`` s per dead prefix. With ~11,000 dead
    prefixes in this machine's ``/tmp`` that took 1.06 s of a 1.86 s restart over 1,000
    streams (cProfile, 180,504 ``exists``), on foundrymix's side and raw streaming's alike,
    and again at every stage switch; it grows with every run the machine has made.

    How: one ``os.listdir`` of ``tempfile.gettempdir()`` (streaming's own directory for
    them) per prefix choice, made when the scan first asks for candidates (a rank that
    takes its leader's prefix, :func:`ranks_take_leaders_prefix`, lists nothing);
    ``_each_prefix_int`` (the scan's source of candidates) then
    yields only the prefixes with no filelock in that listing. Everything else is
    streaming's scan unchanged: it still tests both filelocks of every prefix it is given
    (a filelock made after the listing is seen) and attaches to the segments. A filelock
    removed after the listing only makes the choice a higher free prefix, never a taken
    one. Where the directory cannot be listed, streaming's own candidates are used.
    """
    from streaming.base.shared import prefix

    original = prefix._each_prefix_int
    listed: list[Optional[frozenset[int]]] = []  # the listing, once made

    def each_prefix_int() -> Iterator[int]:
        if not listed:
            listed.append(_locked_prefixes())
        locked = listed[0]
        if locked is None:
            yield from original()
            return
        for prefix_int in original():
            if prefix_int not in locked:
                yield prefix_int

    prefix._each_prefix_int = each_prefix_int
    try:
        yield
    finally:
        prefix._each_prefix_int = original


def _locked_prefixes() -> Optional[frozenset[int]]:
    """The prefixes with a streaming filelock in the temporary directory (None if it cannot
    be listed)."""
    import os
    import tempfile

    from streaming.base.shared.prefix import _get_path
    names = filelock_names()
    try:
        listing = os.listdir(tempfile.gettempdir())
    except OSError:
        return None
    found = set()
    for entry in listing:
        if not entry.endswith(names):
            continue
        head, _, tail = entry.partition('_')
        if tail in names and head.isdigit() and entry == _get_path(int(head), tail):
            found.add(int(head))
    return frozenset(found)


def _peeked_class() -> type:
    """streaming's ``SharedMemory`` with cleanup at exit only for segments it creates.

    A module attribute (made on first use, :func:`__getattr__`), not a class local to
    :func:`prefix_scan_without_leaks`: the dataset keeps the ``_locals`` segment it
    created, and a local class made the dataset unpicklable -- a DataLoader worker started
    with ``spawn`` failed with ``Can't pickle local object``.
    """
    cls = globals().get('PeekedSharedMemory')
    if cls is None:
        from streaming.base.shared.memory import SharedMemory

        def __init__(self: Any, name: Optional[str] = None, create: Optional[bool] = None,
                     size: int = 0, auto_cleanup: bool = True) -> None:
            SharedMemory.__init__(self, name, create, size, auto_cleanup and bool(create))

        cls = type('PeekedSharedMemory', (SharedMemory,), {'__init__': __init__,
                                                            '__module__': __name__})
        globals()['PeekedSharedMemory'] = cls
    return cls


def __getattr__(name: str) -> Any:
    if name == 'PeekedSharedMemory':  # unpickling a dataset in a spawned worker
        return _peeked_class()
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def shared_memories(root: Any, depth: int = 3) -> Iterator[Any]:
    """streaming ``SharedMemory`` objects reachable from ``root``'s attributes (its shared
    arrays, scalars and barriers hold them one or two levels down)."""
    from streaming.base.shared.memory import SharedMemory

    seen: set[int] = set()
    level = [root]
    for _ in range(depth):
        nxt = []
        for obj in level:
            for value in vars(obj).values():
                if id(value) in seen:
                    continue
                seen.add(id(value))
                if isinstance(value, SharedMemory):
                    yield value
                elif type(value).__module__.startswith('streaming.base.shared') and hasattr(value, '__dict__'):
                    nxt.append(value)
        level = nxt
