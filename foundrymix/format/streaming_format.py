"""streaming's MDS format as foundrymix reads shards: hashes, codecs, the row reader.

The one module that imports streaming's modules below its top level (``streaming.base.
hashing``, ``.compression``, ``.format``: private paths in 0.13 and in the fork); everything
else imports only ``streaming``'s top-level names (``tests/test_layout.py`` checks).
Reading shards exactly as streaming does -- same hashes, codecs and row reader -- keeps
files written by streaming's tools readable and ``verify`` in step with training.

Imports are lazy (``import streaming`` pulls in torch) and made under one lock: the loader
opens shards from several threads, and two threads importing ``streaming`` and one of its
submodules at once is a cycle of import locks that CPython breaks with ``_DeadlockError``.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any, Optional

_LOADING = threading.Lock()
_loaded: Optional[SimpleNamespace] = None


def _fresh_lock() -> None:
    global _LOADING
    _LOADING = threading.Lock()  # a child forked while a thread imported must not wait on it


os.register_at_fork(after_in_child=_fresh_lock)


def _streaming() -> SimpleNamespace:
    """streaming's four functions, imported once by one thread at a time."""
    global _loaded
    if _loaded is None:
        with _LOADING:
            if _loaded is None:
                from streaming.base.compression import decompress
                from streaming.base.format import reader_from_json
                from streaming.base.hashing import get_hash, is_hash
                _loaded = SimpleNamespace(decompress=decompress, reader_from_json=reader_from_json,
                                          get_hash=get_hash, is_hash=is_hash)
    return _loaded


def load() -> None:
    """Import streaming's modules now. A loader calls it before its DataLoader workers fork:
    they inherit the modules instead of each importing streaming again, at every epoch and
    stage."""
    _streaming()


def is_hash(algorithm: str) -> bool:
    """Whether streaming knows hash ``algorithm`` (for ``validate_hash`` / ``--hash``)."""
    return _streaming().is_hash(algorithm)


def get_hash(algorithm: str, data: Any) -> str:
    """``data``'s hash as streaming computes it for ``validate_hash``."""
    return _streaming().get_hash(algorithm, data)


def reader_from_json(dirname: str, split: Any, shard: dict[str, Any]) -> Any:
    """streaming's reader of one shard of an index (the one training uses)."""
    return _streaming().reader_from_json(dirname, split, shard)


def decompress(algorithm: str, data: bytes) -> bytes:
    """Bytes of a compressed shard, with streaming's codec for ``algorithm``."""
    return _streaming().decompress(algorithm, data)
