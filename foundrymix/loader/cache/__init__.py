"""The node-local cache of remote streams: which run uses a directory, what a killed run
left behind, and whether the shards will fit -- all settled before the first batch.

Why this module exists. streaming (0.13) registers the local directory of every live
``StreamingDataset`` in machine-global shared memory (``/dev/shm/NNNNNN_locals``) and
refuses a second live dataset over the same directory *of a remote stream* with
``Reused local directory``. So:

* Two runs over one remote with the default cache (one directory per remote URL) died
  one time in two. **A run claims its cache directories** for as long as its dataset
  lives (:func:`claim`); a run that finds the default directory claimed by another live
  run uses the next free sibling (``<dir>-run2``, ``-run3``, ...). Why not a fresh
  directory per run: sequential runs -- the usual case, and every resumption -- then
  reuse the shards already downloaded; only runs that overlap in time download twice
  (the cost: one extra copy of what the overlapping run reads, on the same disk). A
  directory the user named (``local:`` with a ``remote:``) is never swapped: a second
  live run over it gets a :class:`ConfigError` naming the directory and the run that
  holds it.
* A run killed by SIGKILL (its process group, as a scheduler or the OOM killer does)
  never runs its ``atexit`` cleanup, so its shared memory stays and names its directory;
  killed before its first download, the next run over that directory got the same
  ``Reused local directory`` error until someone cleaned ``/dev/shm``. See
  :func:`clean_stale` for what is cleaned here and what streaming's own
  ``clean_stale_shared_memory`` covers.
* ``cache_limit`` below streaming's minimum, or a cache disk too small for what the run
  downloads, are refused with the stream, shard and directory named
  (:func:`check_space`) -- not found out mid-run.

How a claim works: each candidate directory is claimed ``EXCLUSIVE`` for the run with
:mod:`foundrymix.claims` (flock files in ``<tmp>/foundrymix-claims``, outside the cache,
so nothing is added to a directory the user named; released by the kernel when a process
dies, even by SIGKILL, so a claim can never go stale). While candidates are tried, the
configured directory's ``<h>.group`` lock is held, so two runs starting at once never
pick the same directory. The ranks of one job on a node share the run id
``MASTER_ADDR:MASTER_PORT`` and so the same directory, which streaming requires.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from foundrymix import claims
# The package's surface (what the loader and the tests use), one module per job:
# directories (which directory a run uses), stale (what killed runs left), space (whether
# the shards fit and are whole), local_hashes (local shards against their recorded hashes).
from foundrymix.loader.cache.directories import (MAX_CANDIDATES, Claims, candidate, claim,  # noqa: F401
                                                 registering_prefix)
from foundrymix.loader.cache.local_hashes import (CorruptLocalShardError, check_local_shards,  # noqa: F401
                                                  check_local_streams)
from foundrymix.loader.cache.space import (check_cached, check_space, disk_full_hint,  # noqa: F401
                                           min_cache_limit, remove_shard_files)
from foundrymix.loader.cache.stale import _LOCALS_SHM, _read_locals, clean_stale  # noqa: F401


def prepare(config: Any, infos: list[Any], where: str) -> tuple[list[Any], Claims]:
    """Hash the shards of every local stream not verified yet (:func:`check_local_shards`),
    claim the cache directory of every remote stream, clean what dead runs left there,
    remove cached shards that do not match ``index.json`` (:func:`check_cached`; in the
    node's first process only, as streaming's local leader alone sets up the cache and
    the others wait for it), and check the space: the infos to build streams from (``local`` may now be a sibling
    of the configured directory) and the claims to release with the dataset."""
    held = Claims()
    out = []
    try:
        for info in infos:
            if not info.remote_dir:
                check_local_shards(info.name, info.directory, info.index, config)
                out.append(info)
                continue
            shared_default = not info.spec.local
            got = claim(info.local, shared_default, f'{where}.streams.{info.name}')
            held.held.append(got)
            local = got.path if os.path.normpath(got.path) != os.path.normpath(claims.normalize(info.local)) \
                else info.local
            if local != info.local:
                info = _moved(info, local)
            if got.fresh:
                clean_stale(local, [(info.directory, info.index)])
            if int(os.environ.get('LOCAL_RANK', '0') or 0) == 0:  # streaming's local leader
                check_cached(info.name, info.directory, info.index, config.validate_hash)
            out.append(info)
        check_space(config, out, where)
    except BaseException:
        held.release()
        raise
    return out, held


def _moved(info: Any, local: str) -> Any:
    """``info`` read from another directory: its metadata copied there (index and manifest).

    A sibling directory left by an earlier run may hold another version of the stream:
    its shard files named by its old index are removed first (the directory is ours, the
    default cache, claimed by this run).
    """
    split = info.spec.split
    directory = os.path.join(local, split) if split else local
    os.makedirs(directory, exist_ok=True)
    for name in ('foundrymix.json', 'index.json'):
        src, dst = os.path.join(info.directory, name), os.path.join(directory, name)
        with open(src, 'rb') as f:
            data = f.read()
        try:
            with open(dst, 'rb') as f:
                same = f.read() == data
        except FileNotFoundError:
            same = None
        if same is False and name == 'index.json':
            old = json.loads(open(dst, encoding='utf-8').read())
            for shard in old.get('shards', []):
                for key in ('raw_data', 'zip_data'):
                    if shard.get(key):
                        try:
                            os.remove(os.path.join(directory, shard[key]['basename']))
                        except FileNotFoundError:
                            pass
        if not same:
            tmp = f'{dst}.part-{os.getpid()}'
            with open(tmp, 'wb') as f:
                f.write(data)
            os.replace(tmp, dst)
    return dataclasses.replace(info, local=local, directory=directory)
