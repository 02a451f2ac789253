"""``cache_limit``: the node's cache of one run's remote streams never holds more than the limit.
The account is on disk under one :class:`~foundrymix.claims.FileLock`, shared by every process of the node: the shard files
present plus each live process's reservation for a fetch in flight. A fetch reserves its bytes
first, evicting the least recently opened shards (file ``mtime``) until they fit.
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
    """The shards of ``sources`` ((directory, index shards) of each remote stream) kept under
    ``limit`` bytes in all; ``lock`` names the account's lock file (the reservations beside it)."""

    def __init__(self, limit: int, sources: list[tuple[str, list[dict[str, Any]]]], lock: str) -> None:
        self.limit = int(limit)
        self.files = [[os.path.join(d, f['basename']) for f in (s['raw_data'], s.get('zip_data')) if f]
                      for d, shards in sources for s in shards]
        #: counted, never evicted: each stream's index.json
        self.fixed = [os.path.join(d, 'index.json') for d, _ in sources]
        self.lock = lock
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

    def _present(self) -> list[tuple[float, int, list[str]]]:
        """(oldest mtime, bytes, files) of every shard with a file in the cache, and one entry
        for the index files (which ``reserved`` never evicts)."""
        out = [(float('inf'), sum(os.stat(p).st_size for p in self.fixed if os.path.exists(p)), [])]
        for files in self.files:
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
                out.append((float(mtime or 0), size, here))
        return out

    @contextlib.contextmanager
    def reserved(self, key: str, need: int, keep: Optional[str] = None) -> Iterator[None]:
        """Hold ``need`` bytes for the fetch of shard file ``key`` (evicting the coldest
        shards other than ``keep`` as needed) until the block ends."""
        while True:
            with FileLock(self.lock):
                held = self._reservations()
                held.pop(key, None)
                everything = self._present()
                usage = sum(s for _, s, _ in everything) + sum(v[1] for v in held.values())
                present = sorted(p for p in everything if p[2] and keep not in p[2] and key not in p[2])
                while usage + need > self.limit and present:
                    _, size, files = present.pop(0)
                    for path in files:
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(path)
                    usage -= size
                if usage + need <= self.limit:
                    held[key] = [os.getpid(), int(need)]
                    self._write(held)
                    break
                if not held:
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
