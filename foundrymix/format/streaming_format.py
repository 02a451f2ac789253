"""streaming's MDS format as foundrymix reads shards: hashes, codecs, and the one MDS row reader.

The one module that imports streaming below its top level (``tests/test_layout.py`` checks), so
shards read exactly as streaming reads them. Imports are lazy (streaming pulls in torch) and under
one lock: two loader threads importing streaming at once deadlock on CPython's import locks.
"""

from __future__ import annotations

import functools
import os
import threading
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np

_LOADING = threading.Lock()


# a child forked while a thread imported must not wait on the parent's lock
os.register_at_fork(after_in_child=lambda: globals().update(_LOADING=threading.Lock()))


@functools.cache
def _streaming() -> SimpleNamespace:
    """streaming's four functions, imported by one thread at a time (then cached)."""
    with _LOADING:
        from streaming.base.compression import decompress
        from streaming.base.format import reader_from_json
        from streaming.base.hashing import get_hash, is_hash
        return SimpleNamespace(decompress=decompress, reader_from_json=reader_from_json,
                               get_hash=get_hash, is_hash=is_hash)


def load() -> None:
    """Import streaming's modules now, before DataLoader workers fork, so they inherit them."""
    _streaming()


def is_hash(algorithm: str) -> bool:
    """Whether streaming knows hash ``algorithm`` (for ``validate_hash`` / ``--hash``)."""
    return _streaming().is_hash(algorithm)


def get_hash(algorithm: str, data: Any) -> str:
    """``data``'s hash as streaming computes it for ``validate_hash``."""
    return _streaming().get_hash(algorithm, data)


class RowBoundsError(ValueError):
    """A row's offsets point outside the shard's row data (corrupt offsets or a cut file)."""


class ShardRows:
    """Rows of one uncompressed MDS shard by index: every reader of an MDS row in foundrymix.

    A row equals streaming's ``get_item(i)`` bitwise (its offsets and decoder); offsets outside
    the row data raise :class:`RowBoundsError`. Reads ``data`` (bytes or mmap) or, given ``path``,
    the file at each read, holding no descriptor between reads (an evicted file raises
    ``FileNotFoundError``)."""

    def __init__(self, shard: dict[str, Any], data: Any = None, path: Optional[str] = None) -> None:
        self._decode: Callable[[bytes], dict[str, Any]] = \
            _streaming().reader_from_json('', None, shard).decode_sample
        self.samples = int(shard['samples'])
        self._data, self._path = data, path

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._decode(self.row_bytes(i))

    def row_bytes(self, i: int) -> bytes:
        """Row ``i``'s stored bytes."""
        if not 0 <= i < self.samples:
            raise IndexError(f'row {i} of a shard of {self.samples} rows')
        if self._path is None:
            data = self._data
            return self._span(i, len(data), lambda at, n: data[at:at + n])
        fd = os.open(self._path, os.O_RDONLY)
        try:
            return self._span(i, os.fstat(fd).st_size, lambda at, n: os.pread(fd, n, at))
        finally:
            os.close(fd)

    def _span(self, i: int, size: int, read: Callable[[int, int], bytes]) -> bytes:
        at = 4 * (1 + i)
        if at + 8 > size:
            raise RowBoundsError(f'its offsets are past the end of the shard ({size:,} bytes: truncated)')
        begin, end = (int(x) for x in np.frombuffer(read(at, 8), np.uint32))
        table_end = 4 + 4 * (self.samples + 1)
        if not table_end <= begin <= end <= size:
            raise RowBoundsError(f'offsets [{begin:,}, {end:,}) are not inside the row data '
                                 f'[{table_end:,}, {size:,}) (corrupt offsets or truncated shard)')
        return bytes(read(begin, end - begin))


def decompress(algorithm: str, data: bytes) -> bytes:
    """Bytes of a compressed shard, with streaming's codec for ``algorithm``."""
    return _streaming().decompress(algorithm, data)
