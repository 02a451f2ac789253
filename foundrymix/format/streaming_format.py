"""streaming's MDS format helpers foundrymix reads shards with: hashes, codecs, readers.

Why a module of its own: these live in streaming's private modules (``streaming.base.
hashing``, ``.compression``, ``.format``) in 0.13; reading shards exactly as streaming
does -- same hash functions, same codecs, same row reader -- is what makes ``verify`` and
the integrity checks agree with training. Runtime internals are in
``foundrymix/loader/streaming_compat.py``. Imports are lazy: ``import streaming`` pulls in
torch (about 1.6 s of one core).
"""

from __future__ import annotations

from typing import Any


def is_hash(algorithm: str) -> bool:
    """Whether streaming knows hash ``algorithm`` (for ``validate_hash`` / ``--hash``)."""
    from streaming.base.hashing import is_hash as known
    return known(algorithm)


def get_hash(algorithm: str, data: Any) -> str:
    """``data``'s hash as streaming computes it for ``validate_hash``."""
    from streaming.base.hashing import get_hash as compute
    return compute(algorithm, data)


def reader_from_json(dirname: str, split: Any, shard: dict[str, Any]) -> Any:
    """streaming's reader of one shard of an index (the one training uses)."""
    from streaming.base.format import reader_from_json as reader
    return reader(dirname, split, shard)


def decompress(algorithm: str, data: bytes) -> bytes:
    """Bytes of a compressed shard, with streaming's codec for ``algorithm``."""
    from streaming.base.compression import decompress as codec
    return codec(algorithm, data)
