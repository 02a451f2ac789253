"""Existing MDS datasets as conversion inputs: a directory with ``index.json`` is one dataset, else
each below it is a split; shards are read by number, their rows decoded by streaming's reader."""

from __future__ import annotations

import functools
import mmap
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import zstandard

from foundrymix.convert.upload import parse_s3_url
from foundrymix.errors import UserError
from foundrymix.format.mds import ndarray_rows
from foundrymix.format.shards import (INDEX_NAME, IndexFileError, check_shard_files, index_files, read_index,
                                     shard_header_problems, shard_raw_bytes)
from foundrymix.format.streaming_format import ShardRows
from foundrymix.s3.remote import describe as describe_s3, list_keys, make_client


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


def load_split(path: str, name: str) -> MdsSplit:
    """Read ``path``'s index and check, before anything is converted, that every shard has
    the same columns and every shard file the size ``index.json`` records."""
    index = dataset_index(path)
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
    if os.path.isfile(os.path.join(root, INDEX_NAME)):
        return [load_split(root, '')]
    found: list[MdsSplit] = []
    for here, dirs, _files in os.walk(root):
        dirs.sort()
        dirs[:] = [d for d in dirs if not d.startswith('.')]
        for d in list(dirs):
            full = os.path.join(here, d)
            if os.path.isfile(os.path.join(full, INDEX_NAME)):  # an MDS dataset
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
def dataset_index(path: str) -> dict[str, Any]:
    """``path``'s validated index, read once per process (workers read shards by number)."""
    try:
        return read_index(os.path.abspath(path))
    except IndexFileError as e:
        raise UserError(str(e)) from None


def shard_bytes(path: str, number: int) -> tuple[dict[str, Any], str, bytes | mmap.mmap]:
    """``(index entry, file, raw bytes)`` of shard ``number`` of the dataset in ``path``, once its
    header agrees with ``index.json`` (a wrong index is named here, not met later as a bare numpy
    ``ValueError``). Read from the uncompressed file if present (streaming keeps both with
    ``keep_zip``), memory-mapped: a fresh buffer would pay a page fault per page."""
    shard = dataset_index(path)['shards'][number]
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
    return shard, name, data


def read_shard(path: str, number: int) -> tuple[str, list[dict[str, Any]]]:
    """``(file, rows)`` of shard ``number``: each row a dict of its columns, read by
    :class:`foundrymix.format.streaming_format.ShardRows` (the reader training uses)."""
    shard, name, data = shard_bytes(path, number)
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


def read_column_arrays(path: str, number: int, column: str, dtype: Optional[str] = None,
                       vocab: Optional[tuple[str, int]] = None) -> tuple[str, np.ndarray, np.ndarray]:
    """``(file, values, row_lengths)``: one ndarray column of every row of a shard, back to back,
    as ``dtype``; with ``vocab`` (tokenizer, size), an id outside the vocabulary is refused, naming
    its row (checked before narrowing)."""
    shard, name, data = shard_bytes(path, number)
    rows = ndarray_rows(data, shard) if shard['column_names'] == [column] else None
    if rows is not None:
        lens = np.full(rows.shape[0], rows.shape[1], dtype=np.int64)
    else:
        _, decoded = read_shard(path, number)
        arrays = [np.asarray(r[column]).reshape(-1) for r in decoded]
        rows = np.concatenate(arrays)
        lens = np.asarray([len(a) for a in arrays], dtype=np.int64)
    tokenizer, below = vocab or ('', None)
    if below is not None and rows.size and (int(rows.min()) < 0 or int(rows.max()) >= below):
        bad = int(np.flatnonzero((rows < 0) | (rows >= below))[0])
        row = int(np.searchsorted(np.cumsum(lens), bad, side='right'))
        raise UserError(f'{name}:row {row}: token id {int(rows.reshape(-1)[bad])} is outside the vocabulary of '
                        f'tokenizer {tokenizer!r} ({below:,} ids); the shards were made with another '
                        f'tokenizer: pass it with --tokenizer')
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
        index = dataset_index(os.path.join(into, *folder.split('/')))
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
