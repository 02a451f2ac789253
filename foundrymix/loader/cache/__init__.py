"""The node-local cache of remote streams. A run claims its cache directories while it reads them
(two live runs never share one: each evicts under its own ``cache_limit``), cleans what dead runs
left in a freshly claimed one, and refuses a cache too small -- all before the first batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from typing import Any, Optional

from foundrymix import claims
from foundrymix.loader.cache.directories import claim
from foundrymix.loader.cache.hashes import CorruptLocalShardError  # noqa: F401 (re-exported)
from foundrymix.loader.cache.space import check_space, disk_full_hint  # noqa: F401 (re-exported)
from foundrymix.loader.cache.stale import clean_stale
from foundrymix.loader.cache.budget import CacheBudget
from foundrymix.plan.config import cache_base
from foundrymix.plan.window import cache_window, limit_bytes, record_bytes, window_bytes


def prepare(config: Any, infos: list[Any], where: str) -> tuple[list[Any], claims.ClaimSet]:
    """Claim, clean and check the cache directory of every remote stream: the infos to build the
    store from (``local`` may now be a sibling of the configured one) and the claims."""
    held = claims.ClaimSet()
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
    """The remote streams' :class:`~.budget.CacheBudget` (None without ``cache_limit``): each
    stream may keep its shuffle window, the files kept beside the shards counted; its lock named
    by the directories it covers."""
    if not config.cache_limit:
        return None
    remote = [i for i in infos if i.remote_dir]
    rows = cache_window(config, infos) if config.shuffle else 1  # unshuffled: a shard at a time
    dirs = sorted(os.path.realpath(i.directory) for i in remote)
    key = hashlib.blake2s('\n'.join(dirs).encode('utf-8'), digest_size=10).hexdigest()
    return CacheBudget(limit_bytes(config, where),
                       [(i.directory, i.index['shards'], window_bytes(i.index['shards'], rows)) for i in remote],
                       sum(record_bytes(i.index['shards']) + _metadata_bytes(i.directory) for i in remote),
                       os.path.join(cache_base(config.cache_root), 'budgets', f'{key}.lock'))


def _metadata_bytes(directory: str) -> int:
    """The bytes of a cached stream's ``index.json`` and ``foundrymix.json`` (written at start)."""
    out = 0
    for name in ('index.json', 'foundrymix.json'):
        with contextlib.suppress(OSError):
            out += os.stat(os.path.join(directory, name)).st_size
    return out


def _moved(info: Any, local: str) -> Any:
    """``info`` read from another directory, its metadata copied there; shard files an earlier
    run left there under another index are removed first (the directory is ours, claimed)."""
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
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(os.path.join(directory, shard[key]['basename']))
        if not same:
            tmp = f'{dst}.part-{os.getpid()}'
            with open(tmp, 'wb') as f:
                f.write(data)
            os.replace(tmp, dst)
    return dataclasses.replace(info, local=local, directory=directory)
