"""Read input files as records, in chunks that workers read and parse alone (tokenizing is the cost).

A chunk is a small picklable share: a byte range of a plain ``.jsonl``, a parquet row group, rows
of a saved dataset, ``.txt`` files, or (compressed ``.jsonl``, which cannot be split) a payload of
whole lines streamed by the calling thread, or (``adopt``) a shard of an existing MDS dataset, its rows
decoded by streaming's reader (a directory with ``index.json`` is one dataset; else each below it is a
split). An unreadable record is a :class:`BadRecord`.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import json
import os
import re
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import zstandard

from foundrymix.convert.paths import input_format
from foundrymix.convert.mds_input import dataset_index, read_shard
from foundrymix.errors import FoundrymixError, UserError

#: how many .txt documents one chunk holds (one document per file)
TXT_FILES_PER_CHUNK = 64
#: rows per chunk of a dataset saved to disk
HF_ROWS_PER_CHUNK = 2048


class InputError(FoundrymixError, ValueError):
    """An input record is unusable; the message names file, line (or row) and field."""


@dataclass(frozen=True)
class BadRecord:
    """A record that could not be read: ``reason`` is the manifest key, ``detail`` the message."""

    reason: str
    detail: str


@dataclass(frozen=True)
class Chunk:
    """One worker's share of the input. ``first_line``: 1-based line (jsonl) or 0-based row of its
    first record, ``None`` where only earlier chunks tell. ``bad``: the damage that ends the file."""

    fmt: str  # jsonl | jsonl_stream | txt | parquet | hf | mds (start = shard number)
    path: str
    start: int = 0
    end: int = 0
    first_line: Optional[int] = None
    payload: Optional[bytes] = None
    paths: tuple[str, ...] = ()
    bad: Optional['BadRecord'] = None


def plan_chunks(inputs: Sequence[str], chunk_bytes: int) -> Iterator[Chunk]:
    """Lazily cut ``inputs`` into chunks of about ``chunk_bytes``, in input order."""
    for fmt, paths in itertools.groupby(inputs, input_format):
        if fmt == 'txt':  # consecutive .txt files: up to TXT_FILES_PER_CHUNK a chunk
            group = tuple(paths)
            for i in range(0, len(group), TXT_FILES_PER_CHUNK):
                yield Chunk('txt', group[i], paths=group[i:i + TXT_FILES_PER_CHUNK])
            continue
        for path in paths:
            if fmt == 'jsonl':
                yield from _jsonl_ranges(path, chunk_bytes)
            elif fmt == 'jsonl_stream':
                yield from _stream_blocks(path, chunk_bytes)
            elif fmt == 'parquet':
                meta = _parquet_file(path).metadata
                row = 0
                for g in range(meta.num_row_groups):
                    yield Chunk('parquet', path, start=g, end=g + 1, first_line=row)
                    row += meta.row_group(g).num_rows
            elif fmt == 'mds':  # an existing MDS dataset (foundrymix adopt): one chunk per shard
                row = 0
                for shard, info in enumerate(dataset_index(path)['shards']):
                    yield Chunk('mds', path, start=shard, end=shard + 1, first_line=row)
                    row += int(info['samples'])
            else:  # hf
                n = len(_load_hf(path))
                for start in range(0, n, HF_ROWS_PER_CHUNK):
                    yield Chunk('hf', path, start=start, end=min(n, start + HF_ROWS_PER_CHUNK),
                                first_line=start)


def _jsonl_ranges(path: str, chunk_bytes: int) -> Iterator[Chunk]:
    size = os.path.getsize(path)
    start = 0
    with open(path, 'rb') as f:
        while start < size:
            f.seek(min(size, start + chunk_bytes))
            f.readline()  # move to the end of the line the cut falls in
            end = min(size, f.tell())
            yield Chunk('jsonl', path, start=start, end=end)
            start = end


#: decompressed bytes read at a time from a compressed input
_READ_BYTES = 1 << 16


def _decompressed(path: str) -> Iterator[bytes]:
    """The decompressed bytes of a ``.gz``/``.zst`` file, block by block, then
    :class:`_StreamEnded` if truncated or corrupt (zstandard's reader would end silently)."""
    if path.lower().endswith('.gz'):
        with gzip.open(path, 'rb') as f:
            try:
                while block := f.read1(_READ_BYTES):
                    yield block
            except EOFError:
                raise _StreamEnded('truncated_file', 'the gzip data ends early (a truncated file?)') from None
            except (gzip.BadGzipFile, zlib.error) as e:
                raise _StreamEnded('corrupt_file', f'not valid gzip data ({e})') from None
        return
    with open(path, 'rb') as raw:
        frame, fed = zstandard.ZstdDecompressor().decompressobj(), False
        try:
            while data := raw.read(_READ_BYTES):
                while data:
                    if frame.eof:  # the next frame of a multi-frame file
                        frame, fed = zstandard.ZstdDecompressor().decompressobj(), False
                    out = frame.decompress(data)
                    fed = True
                    data = frame.unused_data if frame.eof else b''
                    if out:
                        yield out
        except zstandard.ZstdError as e:
            raise _StreamEnded('corrupt_file', f'not valid zstd data ({e})') from None
        if fed and not frame.eof:
            raise _StreamEnded('truncated_file', 'the zstd data ends early (a truncated file?)')


class _StreamEnded(Exception):
    """A compressed input could not be read to its end: args ``(reason (manifest key), detail)``."""


def _stream_blocks(path: str, chunk_bytes: int) -> Iterator[Chunk]:
    """Blocks of whole lines (about ``chunk_bytes``) of a compressed file. A file that
    cannot be read to its end gives a last chunk with ``bad`` set: the lines before the
    damage are read as usual, the damage is one bad record (naming the line it cut)."""
    line = 1
    buf = bytearray()
    try:
        for block in _decompressed(path):
            cut = block.rfind(b'\n')
            buf += block
            if cut >= 0 and len(buf) >= chunk_bytes:
                end = len(buf) - len(block) + cut + 1
                payload = bytes(buf[:end])
                del buf[:end]
                yield Chunk('jsonl_stream', path, first_line=line, payload=payload)
                line += payload.count(b'\n')
    except _StreamEnded as e:
        done = line - 1 + buf.count(b'\n')
        complete = bytes(buf[:buf.rfind(b'\n') + 1])
        read = f'after line {done:,}: lines 1-{done:,} were read' if done else 'before its first line ends'
        lost = f', the rest of line {done + 1:,} is lost' if len(complete) < len(buf) else ''
        reason, detail = e.args
        yield Chunk('jsonl_stream', path, first_line=line, payload=complete, bad=BadRecord(
            reason, f'{detail} {read}{lost}; replace the file, or pass --on-error skip to convert '
                    f'the lines before the damage'))
        return
    if buf:
        yield Chunk('jsonl_stream', path, first_line=line, payload=bytes(buf))


def _parquet_file(path: str) -> Any:
    """``pyarrow.parquet.ParquetFile(path)``, or a :class:`UserError` naming the file."""
    import pyarrow
    import pyarrow.parquet as pq
    try:
        return pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise UserError(f'{path}: not a readable parquet file ({e})') from None


def count_lines(data: bytes) -> int:
    """Number of lines in a block (a last line without newline counts)."""
    return data.count(b'\n') + (1 if data and not data.endswith(b'\n') else 0)


def read_chunk_bytes(chunk: Chunk) -> bytes:
    """The raw jsonl bytes of a chunk (a file range, or the payload of a compressed block)."""
    if chunk.payload is not None:
        return chunk.payload
    with open(chunk.path, 'rb') as f:
        f.seek(chunk.start)
        return f.read(chunk.end - chunk.start)


def read_records(chunk: Chunk, fields: Optional[Sequence[str]]
                 ) -> tuple[int, list[tuple[str, Optional[int], Any]]]:
    """Read a chunk: ``(n_lines, [(path, index, record), ...])``, ``record`` a dict or a
    :class:`BadRecord`, ``index`` its line (row) in the chunk (``None``: txt). ``n_lines`` counts
    blank lines too. ``fields``: the columns to load (``None``: all; the first names a txt's text)."""
    if chunk.fmt in ('jsonl', 'jsonl_stream'):
        data = read_chunk_bytes(chunk)
        records = [(chunk.path, i, _parse_json_line(line, fields))
                   for i, line in enumerate(data.split(b'\n')) if line.strip()]
        if chunk.bad is not None:  # the file ends here, damaged: one bad record, located by file
            records.append((chunk.path, None, chunk.bad))
        return count_lines(data), records
    if chunk.fmt == 'txt':
        field = fields[0] if fields else 'text'
        return len(chunk.paths), [(path, None, _read_txt(path, field)) for path in chunk.paths]
    if chunk.fmt == 'parquet':
        import pyarrow
        pf = _parquet_file(chunk.path)
        columns = None if fields is None else [c for c in fields if c in pf.schema_arrow.names]
        try:
            rows = pf.read_row_group(chunk.start, columns=columns).to_pylist()
        except (pyarrow.ArrowException, OSError) as e:  # e.g. "Corrupt snappy compressed data."
            return 0, [(chunk.path, None, BadRecord('corrupt_file', (
                f'row group {chunk.start} (from row {chunk.first_line}) cannot be read ({e}); replace '
                f'the file, or pass --on-error skip to convert the other row groups')))]
        return len(rows), [(chunk.path, i, rec) for i, rec in enumerate(rows)]
    if chunk.fmt == 'mds':
        name, rows = read_shard(chunk.path, chunk.start)
        return len(rows), [(name, i, rec if fields is None else {c: rec[c] for c in fields if c in rec})
                           for i, rec in enumerate(rows)]
    ds = _load_hf(chunk.path)  # hf
    columns = list(ds.column_names) if fields is None else [c for c in fields if c in ds.column_names]
    part = ds.select_columns(columns)[chunk.start:chunk.end]
    n = chunk.end - chunk.start
    return n, [(chunk.path, i, {c: part[c][i] for c in columns}) for i in range(n)]


def _read_txt(path: str, field: str) -> Any:
    """A whole .txt file as one document, under the first requested field name."""
    with open(path, 'rb') as f:
        data = f.read()
    try:
        return {field: data.decode('utf-8')}
    except UnicodeDecodeError as e:
        return BadRecord('invalid_utf8', f'invalid UTF-8 at byte {e.start}')


#: a JSON escape of a UTF-16 surrogate: only lines holding one are searched by :func:`lone_surrogate`
_SURROGATE_ESCAPE = re.compile(rb'\\u[dD][89a-fA-F]')


def lone_surrogate(rec: dict, fields: Optional[Sequence[str]]) -> Optional[BadRecord]:
    """Why ``rec`` cannot be tokenized if one of ``fields`` (all: ``None``) holds a lone UTF-16
    surrogate (``json.loads`` takes it; the Rust tokenizer then refuses the whole chunk), else ``None``."""
    for key in (rec if fields is None else fields):
        if key in rec:
            where = _surrogate_in(rec[key], str(key))
            if where is not None:
                field, at, char = where
                return BadRecord('invalid_unicode', f"field '{field}': a lone UTF-16 surrogate "
                                                    f"\\u{char:04x} at character {at}, not valid Unicode (half "
                                                    f"of an escaped pair, or bytes decoded with surrogateescape?)")
    return None


def _surrogate_in(value: Any, name: str) -> Optional[tuple[str, int, int]]:
    if isinstance(value, str):
        try:
            value.encode('utf-8')
        except UnicodeEncodeError as e:
            return name, e.start, ord(value[e.start])
    elif isinstance(value, (dict, list)):
        keyed = isinstance(value, dict)
        for k, v in (value.items() if keyed else enumerate(value)):
            found = _surrogate_in(v, f'{name}.{k}' if keyed else f'{name}[{k}]')
            if found is not None:
                return found
    return None


def _parse_json_line(line: bytes, fields: Optional[Sequence[str]] = None) -> Any:
    try:
        text = line.decode('utf-8')
    except UnicodeDecodeError as e:
        return BadRecord('invalid_utf8', f'invalid UTF-8 at byte {e.start} of the line')
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        return BadRecord('malformed_json', f'malformed JSON: {e.msg} (column {e.colno})')
    if not isinstance(rec, dict):
        return BadRecord('malformed_json', f'expected a JSON object, got {type(rec).__name__}')
    if b'\\' in line and _SURROGATE_ESCAPE.search(line):  # one byte: memchr, cheaper than b'\\u'
        return lone_surrogate(rec, fields) or rec
    return rec


@functools.lru_cache(maxsize=None)
def _load_hf(path: str) -> Any:
    """A dataset saved to disk, memory-mapped once per process."""
    import pyarrow
    from datasets import load_from_disk
    try:
        ds = load_from_disk(path)
    except (pyarrow.ArrowException, OSError) as e:  # a truncated .arrow file: OSError
        raise UserError(f'{path}: this saved dataset cannot be read ({e})') from None
    if not hasattr(ds, 'column_names') or isinstance(ds.column_names, dict):
        raise UserError(f'{path}: expected a single dataset split, got a DatasetDict')
    return ds


def location(path: str, line: Optional[int], fmt: str) -> str:
    """``file:line`` for jsonl, ``file:row N`` for columnar inputs, ``file`` for txt."""
    if line is None:
        return path
    return f'{path}:{line}' if fmt.startswith('jsonl') else f'{path}:row {line}'


def describe(chunk: Chunk) -> str:
    """Which share of the input a chunk is, for messages: file and byte, line or row range."""
    c, more = chunk, len(chunk.paths) - 1
    last = (c.first_line or 1) + count_lines(c.payload or b'') - 1
    return c.path + {'jsonl': f' bytes {c.start}-{c.end}', 'jsonl_stream': f' lines {c.first_line}-{last}',
                     'parquet': f' row group {c.start} (from row {c.first_line})',
                     'mds': f' shard {c.start} (from row {c.first_line})', 'hf': f' rows {c.start}-{c.end - 1}',
                     'txt': f' and {more} more .txt file(s)' if more > 0 else ''}[c.fmt]


def type_name(value: Any) -> str:
    return 'null' if value is None else type(value).__name__


def fields_of(rec: dict) -> str:
    """The fields a record has, for a missing-field message: what to use instead."""
    return ', '.join(sorted(map(str, rec))) or 'none'


def get_string(rec: dict, field: str) -> str | BadRecord:
    """``rec[field]`` if it is a string, else the reason it is not."""
    if field not in rec:
        return BadRecord('missing_field', f"field '{field}': missing (has: {fields_of(rec)})")
    value = rec[field]
    if not isinstance(value, str):
        return BadRecord('not_string', f"field '{field}': expected a string, got {type_name(value)}")
    return value

