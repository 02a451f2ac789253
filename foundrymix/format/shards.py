"""Shard integrity, cheapest layer first, each catching what the previous cannot.

1. :func:`read_index`: ``index.json`` is streaming's version 2 MDS index with every field streaming reads.
2. :func:`check_shard_files`: every shard file exists with its recorded size (one ``stat``, nothing read).
3. :func:`shard_hash_checks`: recorded hashes against the bytes, the only layer that sees bit flips
   that leave every token id valid.
4. :func:`iter_shard_rows`: every row decodes and keeps the schema.

``foundrymix verify`` runs all four; the loader runs 2 at start, 3 per shard opened, 4 per row. Torch-free.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional, Sequence

import numpy as np

from foundrymix.errors import FoundrymixError
from foundrymix.format.schema import check_row
from foundrymix.format.streaming_format import RowBoundsError, ShardRows, decompress, get_hash, is_hash

INDEX_NAME = 'index.json'
#: the only streaming index version (streaming 0.13 reads only this one)
INDEX_VERSION = 2


class IndexFileError(FoundrymixError, ValueError):
    """``index.json`` is missing, not JSON, or not a streaming MDS index; names the file."""


def read_index(path: str) -> dict[str, Any]:
    """Read and validate an ``index.json`` (``path`` is the file or its directory).

    Always :class:`IndexFileError` naming the file, never ``FileNotFoundError``: a missing index
    beside a manifest is damage, not a typo."""
    if os.path.isdir(path):
        path = os.path.join(path, INDEX_NAME)
    try:
        with open(path, encoding='utf-8') as f:
            text = f.read()
    except FileNotFoundError:
        raise IndexFileError(f'{path}: no {INDEX_NAME} (an incomplete conversion or copy?)') from None
    except (OSError, UnicodeDecodeError) as e:
        raise IndexFileError(f'{path}: cannot read {INDEX_NAME}: {e}') from e
    try:
        index = json.loads(text)
    except json.JSONDecodeError as e:
        raise IndexFileError(f'{path}: not valid JSON ({e}); the index is damaged') from e
    return validate_index(index, path)


def validate_index(index: Any, where: str = INDEX_NAME) -> dict[str, Any]:
    """Check the parsed index has what streaming and foundrymix read; ``where`` names it in errors."""
    if not isinstance(index, dict):
        raise IndexFileError(f'{where}: expected a JSON object, found {type(index).__name__}')
    if index.get('version') != INDEX_VERSION:
        raise IndexFileError(f'{where}: streaming index version {index.get("version")!r}, '
                             f'expected {INDEX_VERSION}')
    shards = index.get('shards')
    if not isinstance(shards, list):
        raise IndexFileError(f'{where}: no "shards" list')
    names: set[str] = set()
    for i, shard in enumerate(shards):
        at = f'{where}: shard {i}'
        if not isinstance(shard, dict):
            raise IndexFileError(f'{at}: expected an object, found {type(shard).__name__}')
        for key, want in (('format', 'mds'), ('version', INDEX_VERSION)):
            if shard.get(key) != want:
                raise IndexFileError(f'{at}: {key} {shard.get(key)!r}, expected {json.dumps(want)}')
        if not _is_count(shard.get('samples')):
            raise IndexFileError(f'{at}: "samples" is {shard.get("samples")!r}, expected a count')
        for key in ('column_names', 'column_encodings', 'column_sizes'):
            if not isinstance(shard.get(key), list):
                raise IndexFileError(f'{at}: no "{key}" list')
        for key in ('raw_data', 'zip_data'):
            info = shard.get(key)
            if info is None and key == 'zip_data':
                continue
            if (not isinstance(info, dict) or not isinstance(info.get('basename'), str)
                    or not info['basename'] or not _is_count(info.get('bytes'))
                    or not isinstance(info.get('hashes', {}), dict)):
                raise IndexFileError(f'{at}: "{key}" must be {{"basename", "bytes", "hashes"}}, '
                                     f'found {info!r}')
            base = info['basename']
            if os.path.isabs(base) or '..' in base.split('/'):
                raise IndexFileError(f'{at}: shard file name {base!r} leaves the directory')
            if base in names:
                raise IndexFileError(f'{at}: shard file {base} listed twice')
            names.add(base)
        if shard.get('zip_data') is not None and not shard.get('compression'):
            raise IndexFileError(f'{at}: "zip_data" without "compression"')
    return index


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def shard_name(shard: dict[str, Any]) -> str:
    """The file a shard entry is known by: its raw (uncompressed) basename."""
    return shard['raw_data']['basename']


@dataclass(frozen=True)
class ShardProblem:
    """A shard file that is missing or whose size differs from what ``index.json`` records."""

    shard: str  #: the shard's raw basename, e.g. ``shard.00003.mds``
    path: str  #: the file checked (the raw file, or the compressed one for compressed shards)
    kind: Literal['missing', 'size']
    expected_bytes: int  #: the size ``index.json`` records for ``path``
    found_bytes: Optional[int]  #: the size on disk, ``None`` if missing

    def describe(self) -> str:
        if self.kind == 'missing':
            return (f'{self.path}: shard file missing (index.json records '
                    f'{self.expected_bytes:,} bytes)')
        how = 'truncated' if self.found_bytes < self.expected_bytes else 'longer than recorded'
        return (f'{self.path}: {self.found_bytes:,} bytes, index.json records '
                f'{self.expected_bytes:,} ({how})')

    __str__ = describe


class ShardFilesError(FoundrymixError, ValueError):
    """Shard files missing or of the wrong size; ``problems`` lists them (:class:`ShardProblem`)."""

    def __init__(self, text: str, problems: Optional[list[ShardProblem]] = None) -> None:
        super().__init__(text)
        self.problems = list(problems or [])


def shard_files_error(stream: str, directory: str, problems: list[ShardProblem]) -> ShardFilesError:
    """One error for a stream's damaged shard files, each named with expected vs found bytes."""
    listing = '; '.join(p.describe() for p in problems[:10])
    more = f'; and {len(problems) - 10} more' if len(problems) > 10 else ''
    return ShardFilesError(
        f"stream '{stream}' ({directory}): {len(problems)} shard file(s) do not match "
        f'{INDEX_NAME}: {listing}{more}. Re-copy or re-convert the stream '
        f'(`foundrymix verify {directory}` checks every shard)', problems)


def row_count_problem(index_path: str, manifest_path: str, indexed: int, recorded: int,
                      location: str) -> Optional[str]:
    """The problem when ``index.json`` and the manifest disagree on a stream's rows, else None.

    Refused, not warned: streaming reads only the rows the index lists, so a short index would
    silently train fewer rows than planned. ``plan``, ``train`` and ``verify`` share these words."""
    if indexed == recorded:
        return None
    return (f'{index_path} lists {indexed:,} rows, {manifest_path} records {recorded:,}: they '
            f'are not from one whole conversion (streaming reads only the rows {INDEX_NAME} '
            f'lists); re-run `foundrymix convert` into {location}')


def check_shard_files(directory: str, index: dict[str, Any],
                      allow_missing: bool = False) -> list[ShardProblem]:
    """Shards of ``index`` (read from ``directory``) that are missing or of the wrong size.

    Nothing read; every file present must have its recorded size.
    ``allow_missing=True`` is for a remote stream's cache (raw or compressed file, either may be
    absent); otherwise a compressed shard must be present as its compressed file, the one read."""
    problems = []
    for shard in index['shards']:
        name = shard_name(shard)
        pairs = [f for f in (shard['raw_data'], shard.get('zip_data')) if f] if allow_missing else [_stored(shard)]
        present = 0
        for info in pairs:
            path = os.path.join(directory, info['basename'])
            if not os.path.exists(path):
                continue
            found = os.stat(path).st_size
            present += 1
            if found != int(info['bytes']):
                problems.append(ShardProblem(name, path, 'size', int(info['bytes']), found))
        if not present and not allow_missing:  # what a conversion writes: the compressed file if any
            problems.append(ShardProblem(name, os.path.join(directory, pairs[0]['basename']),
                                         'missing', int(pairs[0]['bytes']), None))
    return problems


def _stored(shard: dict[str, Any]) -> dict[str, Any]:
    """The index entry of the file a shard is stored (and hashed) as: compressed if any, else raw."""
    return shard.get('zip_data') or shard['raw_data']


def stored_name(shard: dict[str, Any]) -> str:
    """The file a shard is stored as: its compressed basename if it has one, else its raw one."""
    return _stored(shard)['basename']


def hashes_in_index(index: dict[str, Any]) -> set[str]:
    """Hash algorithms recorded for every shard's stored file; empty when the index records
    none (older conversions) or has no shards. A ``validate_hash`` outside it is refused."""
    common: Optional[set[str]] = None
    for shard in index['shards']:
        algos = set(_stored(shard).get('hashes') or {})
        common = algos if common is None else common & algos
    return common or set()


def hashes_dropped_problem(index: dict[str, Any], recorded: Sequence[str], index_name: str,
                           manifest_name: str) -> Optional[str]:
    """Why ``index`` has shards recording none of the hashes ``recorded`` (the manifest's
    ``options.hashes``), or ``None``: such an index was rewritten, and those shards' bytes go unchecked."""
    if not recorded:
        return None
    bare = [shard_name(s) for s in index['shards']
            if not set(_stored(s).get('hashes') or {}) & set(recorded)]
    if not bare:
        return None
    return (f'{index_name} records no hash for {len(bare)} of {len(index["shards"])} shard(s) (e.g. '
            f'{bare[0]}), though {manifest_name} says the conversion wrote {", ".join(recorded)}: the index '
            f'was rewritten after the conversion, and nothing can check those shards\' bytes')


def validate_hash_problem(stream: str, index: dict[str, Any], algorithm: Optional[str]) -> Optional[str]:
    """Why ``validate_hash: algorithm`` cannot work for ``stream``, or ``None`` if it can."""
    if not algorithm:
        return None
    if not is_hash(algorithm):
        return f'validate_hash {algorithm!r} is not a hash algorithm streaming knows'
    have = hashes_in_index(index)
    if algorithm in have:
        return None
    listing = ', '.join(sorted(have)) if have else 'none (converted without shard hashes)'
    return (f'stream {stream!r}: validate_hash {algorithm!r} is not recorded in its {INDEX_NAME} '
            f'(hashes recorded for every shard: {listing}); streaming would fail when it '
            f'fetches a shard. Use one of those, or drop validate_hash')


@dataclass(frozen=True)
class HashCheck:
    """One recorded hash of one shard file against its bytes."""

    file: str
    algorithm: str
    expected: str
    found: str

    @property
    def ok(self) -> bool:
        return self.expected == self.found


def shard_hash_checks(info: dict[str, Any], data: bytes) -> list[HashCheck]:
    """Every hash recorded in ``info`` (an index ``raw_data``/``zip_data``) against ``data``."""
    out = []
    for algo, expected in sorted((info.get('hashes') or {}).items()):
        found = get_hash(algo, data) if is_hash(algo) else '(unknown algorithm)'
        out.append(HashCheck(info['basename'], algo, str(expected), found))
    return out


@dataclass(frozen=True)
class RowResult:
    """One row of a shard read from its bytes: the row, or what is wrong with it."""

    row: int  #: index within the shard
    value: Optional[dict[str, Any]]  #: the decoded MDS row (``None`` if unreadable)
    problem: Optional[str]  #: why it is unreadable or breaks the schema (``None`` if fine)


def shard_header_problems(data: bytes, shard: dict[str, Any]) -> list[str]:
    """Problems of a shard's header and offset table (row count, where rows end)."""
    samples = int(shard['samples'])
    if len(data) < 4:
        return [f'{len(data)} bytes: shorter than the shard header']
    out = []
    n = int(np.frombuffer(data[:4], np.uint32)[0])
    if n != samples:
        out.append(f'shard header says {n:,} rows, index.json records {samples:,}')
    table_end = 4 + 4 * (samples + 1)
    if len(data) < table_end:
        out.append(f'{len(data):,} bytes: offset table of {samples:,} rows cut off (truncated)')
    else:
        last = int(np.frombuffer(data[table_end - 4:table_end], np.uint32)[0])
        if last != len(data):
            out.append(f'last row ends at byte {last:,}, the shard has {len(data):,} bytes')
    return out


def iter_shard_rows(data: bytes, shard: dict[str, Any], vocab_size: Optional[int] = None,
                    max_seq_len: Optional[int] = None) -> Iterator[RowResult]:
    """Each of the rows ``index.json`` records for a shard, read from its raw bytes and checked
    with :func:`check_row`; a row that cannot be read is reported, not raised."""
    rows = ShardRows(shard, data)
    for r in range(len(rows)):
        try:
            value = rows[r]
        except RowBoundsError as e:
            yield RowResult(r, None, str(e))
            continue
        except Exception as e:  # numpy/struct errors on garbage bytes
            yield RowResult(r, None, f'cannot decode: {type(e).__name__}: {e}')
            continue
        yield RowResult(r, value, check_row(value, vocab_size, max_seq_len))


def index_files(index: dict[str, Any]) -> set[str]:
    """The shard files an ``index.json`` lists (raw and zip data, relative to the dataset)."""
    names = set()
    for shard in index.get('shards', []):
        for key in ('raw_data', 'zip_data'):
            if shard.get(key):
                names.add(shard[key]['basename'])
    return names


def shard_raw_bytes(shard: dict[str, Any], stored: bytes) -> bytes:
    """A shard's raw bytes from the bytes of its stored file (decompressed with streaming's codec)."""
    if not shard.get('zip_data'):
        return stored
    return decompress(shard['compression'], stored)

