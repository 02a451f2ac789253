"""The node-local cache of remote streams: which run uses a directory, what a killed run
left there, whether the shards fit, and which files are verified.

* **A run claims its cache directories** for as long as it reads them (:func:`claim`): two
  live runs never share one, as each evicts under its own ``cache_limit`` and cleans what
  dead runs left. A run that finds the default directory (one per remote URL) claimed by
  another live run uses the next free sibling (``<dir>-run2``, ...): sequential runs -- the
  usual case, and every resumption -- reuse the shards already fetched. A directory the
  user named (``local:`` with a ``remote:``) is never swapped: a second live run over it is
  refused, naming the run that holds it. Claims are ``flock`` s (:mod:`foundrymix.claims`),
  released by the kernel when a process dies, even by SIGKILL. The ranks of one job on a
  node share the run id ``MASTER_ADDR:MASTER_PORT`` and so the same directory.
* A freshly claimed directory loses the partial files dead runs left (:func:`clean_stale`).
* ``cache_limit`` below the minimum, or a cache disk too small for what the run fetches,
  are refused before the first batch (:func:`check_space`); during the run the budget
  keeps the cache under the limit (:mod:`~foundrymix.loader.cache.budget`).
* Shard files are hashed when first opened (:mod:`~foundrymix.loader.cache.hashes`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Optional

from foundrymix import claims
from foundrymix.loader.cache.directories import MAX_CANDIDATES, Claims, candidate, claim  # noqa: F401
from foundrymix.loader.cache.hashes import CorruptLocalShardError  # noqa: F401
from foundrymix.loader.cache.space import (check_space, disk_full_hint, min_cache_limit,  # noqa: F401
                                           remove_plain_file)
from foundrymix.loader.cache.stale import clean_stale  # noqa: F401


def prepare(config: Any, infos: list[Any], where: str) -> tuple[list[Any], Claims]:
    """Claim the cache directory of every remote stream, clean what dead runs left there and
    check the space: the infos to build the store from (``local`` may now be a sibling of
    the configured directory) and the claims to release with the store."""
    held = Claims()
    out = []
    try:
        for info in infos:
            if not info.remote_dir:
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
            out.append(info)
        check_space(config, out, where)
    except BaseException:
        held.release()
        raise
    return out, held


def budget_for(config: Any, infos: list[Any], where: str) -> Optional[Any]:
    """The :class:`~foundrymix.loader.cache.budget.CacheBudget` of the remote streams under
    ``cache_limit`` (None without a limit); its lock is named by the directories it covers."""
    from foundrymix.format.mds import size_limit_bytes
    from foundrymix.loader.cache.budget import CacheBudget
    from foundrymix.plan.config import cache_base
    if not config.cache_limit:
        return None
    remote = [i for i in infos if i.remote_dir]
    dirs = sorted(os.path.realpath(i.directory) for i in remote)
    key = hashlib.blake2s('\n'.join(dirs).encode('utf-8'), digest_size=10).hexdigest()
    return CacheBudget(size_limit_bytes(config.cache_limit),
                       [(i.directory, i.index['shards']) for i in remote],
                       os.path.join(cache_base(config.cache_root), 'budgets', f'{key}.lock'))


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
