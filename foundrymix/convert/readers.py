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
import mmap
import os
import re
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import zstandard

from foundrymix.convert.paths import input_format
from foundrymix.convert.writer import parse_s3_url
from foundrymix.errors import FoundrymixError, UserError
from foundrymix.format.mds import ndarray_rows
from foundrymix.format.shards import (INDEX_NAME, IndexFileError, check_shard_files, index_files, read_index,
                                     shard_header_problems, shard_raw_bytes)
from foundrymix.format.streaming_format import ShardRows
from foundrymix.s3.client import describe as describe_s3, list_keys, make_client

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
                for shard, info in enumerate(_index(path)['shards']):
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


#: how many splits a root may hold before it is taken as a mistake (e.g. a home directory)
MAX_SPLITS = 1000


@dataclass(frozen=True)
class MdsSplit:
    """One MDS dataset: a directory with ``index.json`` and the columns its shards share."""

    name: str  # path relative to the root given; '' when the root itself is the dataset
    path: str  # absolute directory
    columns: dict[str, str]  # column name -> MDS encoding
    rows: int
    shards: int
    compression: Optional[str]

    def describe(self) -> str:
        cols = ', '.join(f'{k}: {v}' for k, v in self.columns.items())
        zipped = f', {self.compression}' if self.compression else ''
        return f"{self.name or '.'}: {self.rows:,} rows in {self.shards:,} shard(s){zipped} ({cols})"


def is_mds_dir(path: str) -> bool:
    """An MDS dataset directory: it holds ``index.json``."""
    return os.path.isfile(os.path.join(path, INDEX_NAME))


def load_split(path: str, name: str) -> MdsSplit:
    """Read ``path``'s index and check, before anything is converted, that every shard has
    the same columns and every shard file the size ``index.json`` records."""
    index = _index(path)
    shards = index['shards']
    if not shards:
        raise UserError(f'{os.path.join(path, INDEX_NAME)}: lists no shards (an empty dataset)')
    first = shards[0]
    columns = dict(zip(first['column_names'], first['column_encodings']))
    for i, shard in enumerate(shards):
        if dict(zip(shard['column_names'], shard['column_encodings'])) != columns:
            raise UserError(f'{os.path.join(path, INDEX_NAME)}: shard {i} has columns '
                            f'{shard["column_names"]}, shard 0 has {first["column_names"]}; '
                            f'adopt needs one set of columns per dataset')
    problems = check_shard_files(os.path.abspath(path), index)
    if problems:
        listing = '; '.join(p.describe() for p in problems[:10])
        more = f'; and {len(problems) - 10} more' if len(problems) > 10 else ''
        raise UserError(f'{os.path.abspath(path)}: {len(problems)} shard file(s) do not match {INDEX_NAME}: '
                        f'{listing}{more}. adopt reads what {INDEX_NAME} records: copy the dataset again '
                        f'from where it was written (an incomplete copy?)')
    compression = next((s.get('compression') for s in shards if s.get('compression')), None)
    return MdsSplit(name=name, path=os.path.abspath(path), columns=columns,
                    rows=sum(int(s['samples']) for s in shards), shards=len(shards),
                    compression=compression)


def find_splits(root: str) -> list[MdsSplit]:
    """The MDS datasets at ``root``: itself, or each directory below it with ``index.json``
    (sorted by path; hidden directories and the inside of a dataset are not searched)."""
    if not os.path.isdir(root):
        if os.path.exists(root):
            raise UserError(f'{root}: not a directory; give the folder holding index.json '
                            f'(or the folder of its splits)')
        raise UserError(f'{root}: no such directory')
    if is_mds_dir(root):
        return [load_split(root, '')]
    found: list[MdsSplit] = []
    for here, dirs, _files in os.walk(root):
        dirs.sort()
        dirs[:] = [d for d in dirs if not d.startswith('.')]
        for d in list(dirs):
            full = os.path.join(here, d)
            if is_mds_dir(full):
                found.append(load_split(full, os.path.relpath(full, root)))
                dirs.remove(d)  # a dataset's own subfolders are not splits
        if len(found) > MAX_SPLITS:
            raise UserError(f'{root}: more than {MAX_SPLITS} MDS datasets below it; give the '
                            f'dataset folder itself')
    if not found:
        raise UserError(f'{root}: no MDS dataset here (no {INDEX_NAME} in it or in any folder '
                        f'below it)')
    return found


@functools.lru_cache(maxsize=None)
def _index(path: str) -> dict[str, Any]:
    """``path``'s validated index, read once per process (workers read shards by number)."""
    try:
        return read_index(os.path.abspath(path))
    except IndexFileError as e:
        raise UserError(str(e)) from None


def shard_count(path: str) -> int:
    return len(_index(path)['shards'])


def shard_bytes(path: str, number: int) -> tuple[str, bytes | mmap.mmap]:
    """``(file, raw shard bytes)`` of shard ``number`` of the dataset in ``path``, once its header
    agrees with ``index.json`` (a wrong index is named here, not met later as a bare numpy
    ``ValueError``). Read from the uncompressed file if present (streaming keeps both with
    ``keep_zip``), memory-mapped: a fresh buffer would pay a page fault per page."""
    shard = _index(path)['shards'][number]
    name = os.path.join(path, shard['raw_data']['basename'])
    compressed = not os.path.isfile(name) and bool(shard.get('zip_data'))
    if compressed:
        name = os.path.join(path, shard['zip_data']['basename'])
    try:
        with open(name, 'rb') as f:
            if not compressed:
                size = os.fstat(f.fileno()).st_size
                data: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b''
            elif shard['compression'].split(':')[0] == 'zstd':  # streaming's codec is zstandard's, without torch
                data = zstandard.decompress(f.read())
            else:
                data = shard_raw_bytes(shard, f.read())
    except FileNotFoundError:
        raise UserError(f'{name}: missing; {os.path.join(path, INDEX_NAME)} lists it '
                        f'(an incomplete copy?)') from None
    problems = shard_header_problems(data, shard)
    if problems:
        raise UserError(f'{name}: {problems[0]}: {INDEX_NAME} does not describe this shard; '
                        f'copy the dataset again from where it was written, or rewrite it')
    return name, data


def read_shard(path: str, number: int) -> tuple[str, list[dict[str, Any]]]:
    """``(file, rows)`` of shard ``number``: each row a dict of its columns, read by
    :class:`foundrymix.format.streaming_format.ShardRows` (the reader training uses)."""
    shard = _index(path)['shards'][number]
    name, data = shard_bytes(path, number)
    reader = ShardRows(shard, data)
    rows = []
    for r in range(len(reader)):
        try:
            rows.append(reader[r])
        except Exception as e:  # noqa: BLE001 -- numpy/struct/json errors on bytes of another layout
            columns = ', '.join(f'{c}: {enc}' for c, enc in zip(shard['column_names'], shard['column_encodings']))
            raise UserError(f'{name}: row {r} cannot be read as the columns {INDEX_NAME} declares ({columns}): '
                            f'{type(e).__name__}: {e}; the column_encodings do not match how the shards were '
                            f'written (e.g. ndarray:int64 for int32 tokens): correct them in {INDEX_NAME}, or '
                            f'write the dataset again') from None
    return name, rows


class OutOfRange(Exception):
    """A value of a column outside ``[0, below)``: args ``(shard file, row, value)``."""


def read_column_arrays(path: str, number: int, column: str, dtype: Optional[str] = None,
                       below: Optional[int] = None) -> tuple[str, np.ndarray, np.ndarray]:
    """``(file, values, row_lengths)``: one ndarray column of every row of a shard, back to back,
    as ``dtype``; with ``below``, a stored value outside ``[0, below)`` raises :class:`OutOfRange`
    (checked before narrowing)."""
    shard = _index(path)['shards'][number]
    name, data = shard_bytes(path, number)
    rows = ndarray_rows(data, shard) if shard['column_names'] == [column] else None
    if rows is not None:
        lens = np.full(rows.shape[0], rows.shape[1], dtype=np.int64)
    else:
        _, decoded = read_shard(path, number)
        arrays = [np.asarray(r[column]).reshape(-1) for r in decoded]
        rows = np.concatenate(arrays)
        lens = np.asarray([len(a) for a in arrays], dtype=np.int64)
    if below is not None and rows.size and (int(rows.min()) < 0 or int(rows.max()) >= below):
        bad = int(np.flatnonzero((rows < 0) | (rows >= below))[0])
        row = int(np.searchsorted(np.cumsum(lens), bad, side='right'))
        raise OutOfRange(name, row, int(rows.reshape(-1)[bad]))
    values = rows.astype(dtype or rows.dtype).reshape(-1)  # the one copy out of the shard
    return name, values, lens


def download_datasets(url: str, into: str, progress: bool = False) -> None:
    """Copy every MDS dataset under ``s3://bucket/prefix`` (each ``index.json`` and the shard
    files it lists, nothing else) into the local folder ``into``, keeping the layout: the readers
    here map or read whole local shard files."""
    s3 = parse_s3_url(url, 'adopt')
    client = make_client()
    try:
        keys = set(list_keys(client, s3))
    except Exception as e:
        raise UserError(describe_s3('listing', url, e)) from None
    indexes = sorted(k for k in keys if k.split('/')[-1] == INDEX_NAME
                     and not any(part.startswith('.') for part in k.split('/')))
    if not indexes:
        raise UserError(f'{url}: no MDS dataset there (no {INDEX_NAME} under the prefix)')

    def get(key: str) -> None:
        local = os.path.join(into, *key.split('/'))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        try:
            client.download_file(s3.bucket, s3.key(key), local)
        except Exception as e:
            raise UserError(describe_s3('download', s3.url(key), e)) from None

    for index_key in indexes:
        get(index_key)
        folder = index_key[:-len(INDEX_NAME)]
        index = _index(os.path.join(into, *folder.split('/')))
        wanted = sorted(folder + name for name in index_files(index))
        for shard in index['shards']:
            names = [folder + shard[k]['basename'] for k in ('raw_data', 'zip_data') if shard.get(k)]
            if not any(n in keys for n in names):
                raise UserError(f"{s3.url(names[0])}: missing; {s3.url(index_key)} lists it (an incomplete "
                                f"upload?)")
        for key in wanted:
            if key in keys:
                get(key)
        if progress:
            print(f'  copied {s3.url(folder.rstrip("/"))} ({len(wanted)} shard file(s))')
