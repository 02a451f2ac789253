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


class ParsedIndexShards:
    """A local ``streaming.Stream``'s ``get_shards``, from the ``index.json`` the catalog
    already read and validated, instead of streaming's second read of the file.

    Why: at 1,000 streams the second read (open + ``json.load`` per stream in streaming
    0.13's ``Stream.get_shards``) was ~0.03 s of a 0.73 s dataset build (issue 22), and it
    also keeps the dataset on exactly the index the plan was made from. The body is
    streaming 0.13's own after its read: a reader per shard, validated. A class rather
    than a closure so that a dataset still pickles (DataLoader workers started with
    ``spawn``).
    """

    def __init__(self, stream: Any, index: dict[str, Any]) -> None:
        self.local, self.split, self.index = stream.local, stream.split, index

    def __call__(self, world: Any, allow_unsafe_types: bool) -> list[Any]:
        if self.index.get('version') != 2:  # streaming's own check, same message
            raise ValueError(f'Unsupported streaming data version: {self.index.get("version")}. '
                             f'Expected version 2.')
        shards = []
        for info in self.index['shards']:
            shard = reader_from_json(self.local, self.split, info)
            shard.validate(allow_unsafe_types)
            shards.append(shard)
        return shards


def with_parsed_index(stream: Any, index: dict[str, Any]) -> Any:
    """``stream``, reading its shards from ``index`` (:class:`ParsedIndexShards`) when it has
    no remote (a remote stream's index is fetched and compared by the catalog, and streaming
    may download it again into its cache: left as it is)."""
    if not stream.remote:
        stream.get_shards = ParsedIndexShards(stream, index)
    return stream


def decompress(algorithm: str, data: bytes) -> bytes:
    """Bytes of a compressed shard, with streaming's codec for ``algorithm``."""
    from streaming.base.compression import decompress as codec
    return codec(algorithm, data)
