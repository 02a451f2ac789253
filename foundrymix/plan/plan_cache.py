"""The trainer's run plan, recorded once per set of inputs and re-read while none changed.

Why (issue 22): at 1,000 local streams the trainer's start read 2,000 metadata files
(0.145 s: manifest, ``index.json``, a ``stat`` per shard and the checks) and planned the
run (0.12 s, most of it the py1e prefix of the first batches) before streaming's own
start-up of ~0.68 s: 1.6x a raw ``StreamingDataset``, where the target is 1.1x. A resumed
or restarted run plans the same inputs again. Here the planned run and its catalogs are
pickled under the foundrymix cache directory (``<cache_root or $FOUNDRYMIX_CACHE or
<tmp>/foundrymix-cache>/plans/``, never in a dataset directory), and a later start with
the same inputs reads that record instead.

What "the same inputs" means -- everything :func:`~foundrymix.plan.stages.plan_run` reads:

* the loader config, the device batch, ``max_duration``, the topology and the config
  key path, pickled (a config that pickles differently is a miss, never a false hit),
  and the working directory (relative stream paths resolve against it);
* the code that plans: the source of ``foundrymix.plan``, ``foundrymix.format`` and the
  modules they import from foundrymix, and the versions of Python, numpy and streaming
  (the plan replays streaming's shuffles);
* every file the catalogs looked at -- each stream's ``foundrymix.json`` and
  ``index.json`` and every shard file the index names (raw and compressed, present or
  not) -- by size, ``mtime_ns``, ``ctime_ns``, inode and device, as the shard-hash
  records are (:mod:`foundrymix.loader.cache.local_hashes`): any write, copy or rename
  onto a file changes its ``ctime``, which no tool can set back.

Not recorded (planned afresh every time): runs with a stream that has a ``remote`` (its
metadata is fetched and compared on every start, :meth:`Catalog.sync_remote`), adaptive
stages (decided during the run), and any plan that raised. ``foundrymix plan`` never
reads the records: it always plans afresh.

Proof that a record equals a fresh plan: with ``FOUNDRYMIX_PLAN_CACHE=verify`` a hit is
planned afresh as well and compared field by field (:func:`first_difference`); a
difference stops the start naming the field. The test suite runs with ``verify`` on, so
every start it makes twice over the same inputs (resumes, restarts, plan-then-train) is
compared. ``FOUNDRYMIX_PLAN_CACHE=off`` plans afresh and records nothing.

Safety: a record is a pickle, and loading a pickle runs code, so a record is read only
from a directory and file owned by this user and writable by no one else (the directory
is made ``0700``); anything else is ignored (planned afresh). The newest
:data:`KEEP_RECORDS` records are kept; older ones are removed when one is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import pickle
import stat as stat_mod
import sys
import tempfile
from typing import IO, Any, Callable, Optional

from foundrymix.errors import FoundrymixError
from foundrymix.format.schema import MANIFEST_NAME
from foundrymix.format.shards import INDEX_NAME
from foundrymix.plan.catalog import Catalog
from foundrymix.plan.config import LoaderConfig, cache_base
from foundrymix.plan.simulate import Topology
from foundrymix.plan.stages import RunPlan, plan_run

logger = logging.getLogger(__name__)

#: ``on`` (default), ``verify`` (a hit is also planned afresh and compared) or ``off``
MODE_ENV = 'FOUNDRYMIX_PLAN_CACHE'
#: the folder of the records under the cache directory
RECORD_DIR = 'plans'
#: records kept (the newest by modification time); one record is one run's inputs
KEEP_RECORDS = 64
_MODES = ('on', 'verify', 'off')
#: bump when the record's layout changes
_FORMAT = 1
_code_digest: Optional[str] = None


class PlanRecordMismatch(FoundrymixError, RuntimeError):
    """A recorded plan differs from a fresh plan of the same inputs (``verify`` mode)."""


def planned_run(config: LoaderConfig, batch_size: int, max_duration: Optional[str],
                topology: Topology, where: str = 'train_loader'
                ) -> tuple[RunPlan, list[Catalog]]:
    """:func:`~foundrymix.plan.stages.plan_run`, read from its record when every input is
    unchanged (see the module docstring), else planned and recorded."""
    mode = record_mode()
    try:
        skip = mode == 'off' or _has_remote(config, where)
        key = None if skip else _key(config, batch_size, max_duration, topology, where)
    except Exception:  # a config plan_run refuses (it says why) or one that cannot pickle
        key = None
    if key is None:
        return plan_run(config, batch_size, max_duration, topology, where)
    folder = os.path.join(cache_base(config.cache_root), RECORD_DIR)
    path = os.path.join(folder, key + '.pkl')
    recorded = _read_record(path, folder)
    if recorded is not None and mode == 'verify':
        fresh = plan_run(config, batch_size, max_duration, topology, where)
        where_diff = first_difference(recorded, fresh)
        if where_diff is not None:
            raise PlanRecordMismatch(f'the plan recorded in {path} differs from a fresh plan of '
                                     f'the same inputs at {where_diff}; remove the record '
                                     f'(or set {MODE_ENV}=off) and report this')
    if recorded is not None:
        logger.info('plan: read from %s (the metadata and shard files it was made from are '
                    'unchanged)', path)
        return recorded
    run, catalogs = plan_run(config, batch_size, max_duration, topology, where)
    if not run.decided_during_run and not _adaptive(run):
        _write_record(path, folder, run, catalogs)
    return run, catalogs


def record_mode() -> str:
    """``$FOUNDRYMIX_PLAN_CACHE``: ``on``, ``verify`` or ``off`` (the plan records and the
    loader's shuffle records, :mod:`foundrymix.loader.shuffle_cache`)."""
    mode = os.environ.get(MODE_ENV, 'on').strip().lower() or 'on'
    if mode not in _MODES:
        raise FoundrymixError(f'{MODE_ENV}={mode!r}: expected one of {", ".join(_MODES)}')
    return mode


# ------------------------------------------------------------------------ inputs
def _has_remote(config: LoaderConfig, where: str) -> bool:
    return any(cfg.stream_remote_dir(n) is not None
               for cfg in config.stage_configs(where) for n in cfg.streams)


def _adaptive(run: RunPlan) -> bool:
    return any(getattr(s.config, 'adaptive', None) is not None for s in run.stages)


def _key(config: LoaderConfig, batch_size: int, max_duration: Optional[str], topology: Topology,
         where: str) -> str:
    h = hashlib.sha256()
    h.update(pickle.dumps((_FORMAT, config, batch_size, max_duration, topology, where,
                           os.getcwd()), protocol=4))
    h.update(_code().encode())
    return h.hexdigest()


def _code() -> str:
    """The planning code and the libraries it replays: a record of other code is a miss."""
    global _code_digest
    if _code_digest is None:
        import numpy
        import streaming
        import foundrymix
        root = os.path.dirname(os.path.abspath(foundrymix.__file__))
        h = hashlib.sha256(f'{sys.version}|{numpy.__version__}|{streaming.__version__}'.encode())
        files = [os.path.join(root, n) for n in ('config.py', 'errors.py', 'claims.py',
                                                 'tokenizer.py')]
        for package in ('plan', 'format'):
            folder = os.path.join(root, package)
            files += sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith('.py'))
        for name in files:
            with open(name, 'rb') as f:
                h.update(name.encode() + b'\0' + f.read())
        _code_digest = h.hexdigest()
    return _code_digest


def _files_of(catalogs: list[Catalog]) -> list[str]:
    """Every file the catalogs' checks looked at, each once, in a fixed order."""
    seen: dict[str, None] = {}
    for catalog in catalogs:
        for info in catalog._infos.values():
            seen[os.path.join(info.directory, MANIFEST_NAME)] = None
            seen[os.path.join(info.directory, INDEX_NAME)] = None
            for shard in info.index.get('shards', ()):
                for part in ('raw_data', 'zip_data'):
                    if shard.get(part):
                        seen[os.path.join(info.directory, shard[part]['basename'])] = None
    return list(seen)


def _identity(path: str) -> Optional[tuple[int, int, int, int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


# ------------------------------------------------------------------------ records
def is_private(st: os.stat_result) -> bool:
    """Owned by this user and writable by no one else: safe to read a record from."""
    return st.st_uid == os.getuid() and not st.st_mode & (stat_mod.S_IWGRP | stat_mod.S_IWOTH)


def _read_record(path: str, folder: str) -> Optional[tuple[RunPlan, list[Catalog]]]:
    try:
        with open(path, 'rb') as f:
            if not (is_private(os.fstat(f.fileno())) and is_private(os.stat(folder))):
                return None
            record = _load(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # a truncated or foreign record is a miss, planned afresh
        logger.warning('plan: ignoring the unreadable record %s (%s)', path, e)
        return None
    if not isinstance(record, dict) or record.get('format') != _FORMAT:
        return None
    files = record['files']
    if any(_identity(p) != ident for p, ident in files):
        return None
    return record['run'], record['catalogs']


def _load(f: Any) -> Any:
    """``pickle.load`` with the cyclic collector paused: a 1,000-stream record (2.0 MB) took
    0.20 s to unpickle with it on and 0.024 s paused, in a process already holding a
    large heap (CPython 3.11: every object allocated counts towards a collection)."""
    import gc
    enabled = gc.isenabled()
    gc.disable()
    try:
        return pickle.load(f)
    finally:
        if enabled:
            gc.enable()


def _still_as_read(catalogs: list[Catalog], idents: list[Any]) -> bool:
    """Whether the files still hold what the catalogs read, as of ``idents``.

    The identities are taken after planning, so a file changed between the catalog's read
    and that ``stat`` would be recorded with its new identity and the old plan -- a later
    start would read a stale plan. So, once, when a record is written: every manifest and
    index is read again and compared with what the plan used, the shard files pass the
    catalog's size check again, and the identities are taken again and must not have
    moved. A first start pays one more read of its metadata: 0.12-0.14 s at 1,000 streams
    (the plan itself 0.29 s there; one test process running beside it).
    """
    from foundrymix.format.schema import Manifest
    from foundrymix.format.shards import check_shard_files, read_index
    try:
        for catalog in catalogs:
            for info in catalog._infos.values():
                if Manifest.read(info.directory) != info.manifest \
                        or read_index(os.path.join(info.directory, INDEX_NAME)) != info.index \
                        or check_shard_files(info.directory, info.index):
                    return False
    except Exception:
        return False
    return [(p, _identity(p)) for p, _ in idents] == idents


def _write_record(path: str, folder: str, run: RunPlan, catalogs: list[Catalog]) -> None:
    files = [(p, _identity(p)) for p in _files_of(catalogs)]
    if not _still_as_read(catalogs, files):
        logger.info('plan: not recorded (a stream file changed while the run was planned)')
        return
    record = {'format': _FORMAT, 'files': files, 'run': run, 'catalogs': catalogs}
    try:
        if write_private(path, folder, lambda f: pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL)):
            _prune(folder)
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
        logger.info('plan: not recorded in %s (%s)', folder, e)


def write_private(path: str, folder: str, write: Callable[[IO[bytes]], None]) -> bool:
    """Write a record to ``path`` in ``folder`` (made ``0700``) through ``write(file)``,
    renamed into place whole; False, writing nothing, if the folder is not private
    (:func:`is_private`). Ranks and jobs write at once: each its own file, renamed."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if not is_private(os.stat(folder)):
        return False
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f'.{os.path.basename(folder)}-', suffix='.tmp')
    try:
        with os.fdopen(fd, 'wb') as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with _quiet():
            os.unlink(tmp)
        raise
    return True


def _prune(folder: str) -> None:
    entries = []
    for entry in os.scandir(folder):
        if entry.name.endswith('.pkl'):
            with _quiet():
                entries.append((entry.stat().st_mtime_ns, entry.path))
    for _, path in sorted(entries, reverse=True)[KEEP_RECORDS:]:
        with _quiet():
            os.unlink(path)


class _quiet:
    """Ignore a file that another process removed or replaced first."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, value: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, OSError)


# ------------------------------------------------------------------------ comparison
def first_difference(a: Any, b: Any, path: str = 'plan') -> Optional[str]:
    """The first place where ``a`` and ``b`` differ (a path such as
    ``plan[0].stages[1].plan.duration.rows_per_stream['web']``), or None: dataclasses and
    objects field by field, containers item by item, arrays by dtype, shape and values."""
    if type(a) is not type(b):
        return f'{path} (type {type(a).__name__} vs {type(b).__name__})'
    if dataclasses.is_dataclass(a) or hasattr(a, '__dict__') and not isinstance(a, type):
        fields = vars(a)
        other = vars(b)
        if list(fields) != list(other):
            return f'{path} (attributes {sorted(fields)} vs {sorted(other)})'
        for name in fields:
            found = first_difference(fields[name], other[name], f'{path}.{name}')
            if found:
                return found
        return None
    if isinstance(a, dict):
        if list(a) != list(b):
            return f'{path} (keys {list(a)[:5]}... vs {list(b)[:5]}...)'
        for k in a:
            found = first_difference(a[k], b[k], f'{path}[{k!r}]')
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f'{path} (length {len(a)} vs {len(b)})'
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f'{path}[{i}]')
            if found:
                return found
        return None
    if type(a).__module__ == 'numpy' and hasattr(a, 'dtype'):
        import numpy as np
        if a.dtype != b.dtype or np.shape(a) != np.shape(b) or \
                not np.array_equal(a, b, equal_nan=a.dtype.kind in 'fc'):
            return f'{path} (array values)'
        return None
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    if isinstance(a, (set, frozenset)):
        return None if a == b else f'{path} ({sorted(map(repr, a ^ b))[:3]} in one only)'
    return None if a == b else f'{path} ({a!r} vs {b!r})'
