"""streaming's MDS format as foundrymix reads shards: hashes, codecs, the row reader.

The one module that imports streaming's modules below its top level (``streaming.base.
hashing``, ``.compression``, ``.format``: private paths in 0.13 and in the fork); everything
else imports only ``streaming``'s top-level names (``tests/test_layout.py`` checks).
Reading shards exactly as streaming does -- same hashes, codecs and row reader -- keeps
files written by streaming's tools readable and ``verify`` in step with training. Imports
are lazy: ``import streaming`` pulls in torch.
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
