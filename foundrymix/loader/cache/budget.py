"""``cache_limit``: the node's cache of one run's remote streams never holds more than the limit.
The account is on disk under one :class:`~foundrymix.claims.FileLock`, shared by every process of
the node: the shard files present, each live process's reservation for a fetch in flight, and the
bound of the files kept beside them. A fetch reserves its bytes first, evicting shards of streams
holding more than their shuffle window (least recently opened, file ``mtime``, first) until they
fit, so each shard is fetched about once per pass (plan/window.py sizes the windows).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Iterator, Optional

from foundrymix.claims import FileLock, pid_alive
from foundrymix.errors import FoundrymixError


class CacheFullError(FoundrymixError, ValueError):
    """No shard can be evicted and nothing in flight will free room: the limit is too small."""


class CacheBudget:
    """The shards of ``sources`` ((directory, index shards, window bytes) of each remote stream)
    kept under ``limit`` bytes in all with ``fixed`` bytes (index files, hash records) counted
    as held; ``lock`` names the account's lock file (the reservations beside it)."""

    def __init__(self, limit: int, sources: list[tuple[str, list[dict[str, Any]], int]], fixed: int,
                 lock: str) -> None:
        self.limit, self.fixed, self.lock = int(limit), int(fixed), lock
        self.files = [[os.path.join(d, f['basename']) for f in (s['raw_data'], s.get('zip_data')) if f]
                      for d, shards, _ in sources for s in shards]
        #: the stream of each shard, and each stream's window (what it may keep before its own are evicted)
        self.stream = [k for k, (_, shards, _) in enumerate(sources) for _ in shards]
        self.quota = [int(q) for _, _, q in sources]
        self._of = {f: k for files, k in zip(self.files, self.stream) for f in files}
        os.makedirs(os.path.dirname(lock), exist_ok=True)

    def _reservations(self) -> dict[str, list[int]]:
        try:
            with open(self.lock + '.json', encoding='utf-8') as f:
                got = json.load(f)
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in got.items() if isinstance(v, list) and pid_alive(int(v[0]))}

    def _write(self, reservations: dict[str, list[int]]) -> None:
        tmp = f'{self.lock}.json.part-{os.getpid()}'
        with open(tmp, 'w', encoding='utf-8') as f:
            json.dump(reservations, f)
        os.replace(tmp, self.lock + '.json')

    def _present(self) -> list[tuple[float, int, list[str], int]]:
        """(oldest mtime, bytes, files, stream) of every shard with a file in the cache."""
        out = []
        for files, k in zip(self.files, self.stream):
            size, mtime, here = 0, None, []
            for path in files:
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                size += st.st_size
                mtime = st.st_mtime if mtime is None else min(mtime, st.st_mtime)
                here.append(path)
            if here:
                out.append((float(mtime or 0), size, here, k))
        return out

    def usage(self, held: dict[str, list[int]], present: Optional[list[tuple[float, int, list[str], int]]] = None
              ) -> int:
        """Bytes counted now: shards present, reservations, the fixed files and the account
        itself (twice: it is rewritten through a copy)."""
        shards = sum(p[1] for p in (self._present() if present is None else present))
        return shards + sum(v[1] for v in held.values()) + self.fixed + 2 * len(json.dumps(held))

    @contextlib.contextmanager
    def reserved(self, key: str, need: int, keep: Optional[str] = None) -> Iterator[None]:
        """Hold ``need`` bytes for the fetch of shard file ``key`` until the block ends, evicting
        first the least recently opened shard of a stream holding more than its window (the
        fetching one's included): a window in use is never evicted while an old one is cached."""
        while True:
            with FileLock(self.lock):
                held = self._reservations()
                held.pop(key, None)
                held[key] = [os.getpid(), int(need)]
                everything = self._present()
                usage = self.usage(held, everything)
                by = [0] * len(self.quota)  # each stream's bytes: its evictable shards and fetches
                for path, (_, size) in held.items():
                    if path in self._of:
                        by[self._of[path]] += size
                present = sorted(p for p in everything if keep not in p[2] and key not in p[2])
                for _, size, _, k in present:
                    by[k] += size
                while usage > self.limit and present:
                    over = [k for k in range(len(by)) if by[k] > self.quota[k]]
                    k = max(over, key=lambda k: by[k] - self.quota[k]) if over else None
                    _, size, files, k = present.pop(next(
                        (j for j, p in enumerate(present) if p[3] == k), 0))
                    for path in files:
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(path)
                    usage -= size
                    by[k] -= size
                if usage <= self.limit:
                    self._write(held)
                    break
                if len(held) == 1:
                    raise CacheFullError(
                        f'cache_limit {self.limit:,} bytes: no room for {key} ({need:,} bytes) '
                        f'with nothing left to evict; raise cache_limit')
            time.sleep(0.01)  # only fetches in flight fill the cache: wait for one to end
        try:
            yield
        finally:
            with FileLock(self.lock):
                held = self._reservations()
                held.pop(key, None)
                self._write(held)
