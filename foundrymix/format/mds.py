"""Write uncompressed MDS shards of foundrymix rows without importing ``streaming`` (and torch).

The files are byte for byte ``streaming.MDSWriter``'s (layout, names, ``index.json``, size-limit
rule, hashes; ``tests/format/test_convert_mds.py`` compares). Compressed output uses ``MDSWriter``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional

import numpy as np
import xxhash

from foundrymix.errors import UserError

#: the shard file's write buffer: rows' parts are copied into it, one write per buffer
_WRITE_BUFFER = 1 << 20
#: ``extra_bytes_per_sample`` of MDSWriter: a sample's offset in the shard header
_OFFSET_BYTES = 4
#: streaming's ``bytes_to_int`` units
_UNITS = {'kb': 1 << 10, 'mb': 1 << 20, 'gb': 1 << 30, 'tb': 1 << 40, 'pb': 1 << 50, 'eb': 1 << 60,
          'zb': 1 << 70, 'yb': 1 << 80}


def size_limit_bytes(value: int | float | str) -> int:
    """``'64mb'`` -> bytes, by the rule of ``streaming.base.util.bytes_to_int``."""
    if isinstance(value, (int, float)):
        return int(value)
    text = value.lower().strip()
    for suffix, unit in _UNITS.items():
        if text.endswith(suffix):
            try:
                return int(float(text[:-len(suffix)]) * unit)
            except ValueError:
                break
    else:
        if text.endswith('b') and text[:-1].isdigit():
            return int(text[:-1])
        if text.isdigit():
            return int(text)
    raise UserError(f"Unsupported value/suffix {text}. Supported suffix are {['b', *_UNITS]}.")


def hash_function(algo: str) -> Any:
    """The function streaming's ``get_hash`` uses for ``algo`` (hashlib's, then xxhash's)."""
    if hasattr(hashlib, algo) and algo in hashlib.algorithms_available and not algo.startswith('shake_'):
        return getattr(hashlib, algo)
    if algo in xxhash.algorithms_available:
        return getattr(xxhash, algo)
    raise ValueError(f'{algo} is not a supported hash algorithm.')


class _Column:
    """One ``ndarray[:dtype[:shape]]`` column of ``MDSWriter`` (the only kind foundrymix writes)."""

    def __init__(self, name: str, encoding: str) -> None:
        parts = encoding.split(':')
        if parts[0] != 'ndarray' or len(parts) < 2 or len(parts) > 3:
            raise ValueError(f'column {name!r}: only ndarray:<dtype>[:<shape>] encodings are written '
                             f'here, got {encoding!r}')
        self.name = name
        self.dtype = np.dtype(parts[1])
        self.shape = tuple(int(d) for d in parts[2].split(',')) if len(parts) == 3 else None
        self.size = None if self.shape is None else int(np.prod(self.shape)) * self.dtype.itemsize

    def encode(self, value: np.ndarray) -> bytes:
        if value.dtype != self.dtype:
            raise ValueError(f'Wrong dtype: expected {self.dtype.name}, got {value.dtype.name}.')
        if value.size == 0:
            raise ValueError('Attempting to encode a numpy array with 0 elements.')
        if self.shape is not None:
            if value.shape != self.shape:
                raise ValueError(f'Wrong shape: expected {self.shape}, got {value.shape}.')
            return value.tobytes()
        if value.ndim >= 64:
            raise ValueError(f'Array has too many axes: maximum 63, got {value.ndim}.')
        longest = max(value.shape)
        code, shape_dtype = ((0, np.uint8) if longest < 1 << 8 else (1, np.uint16) if longest < 1 << 16
                             else (2, np.uint32) if longest < 1 << 32 else (3, np.uint64))
        return (bytes([(value.ndim << 2) | code]) + np.asarray(value.shape, dtype=shape_dtype).tobytes()
                + value.tobytes())


class LeanMDSWriter:
    """``MDSWriter(out, columns, compression=None, hashes, size_limit)`` for ndarray columns:
    :meth:`write` a row dict, :meth:`finish` to flush the last shard and ``index.json``."""

    def __init__(self, out: str, columns: dict[str, str], hashes: Optional[list[str]] = None,
                 size_limit: Optional[int | str] = 1 << 26) -> None:
        limit = size_limit_bytes(size_limit) if size_limit else None
        if limit is not None and limit < 0:
            raise UserError(f'`size_limit` must be greater than zero, instead, found as {limit}.')
        if limit is not None and limit >= 2**32:
            raise UserError(f'`size_limit` must be less than 2**32, instead, found as {limit}.')
        self.out = out
        os.makedirs(out, exist_ok=False)
        self.hashes = list(hashes or [])
        self._hash_fns = [hash_function(a) for a in self.hashes]
        self.columns = [_Column(name, columns[name]) for name in sorted(columns)]
        self.config = {
            'version': 2, 'format': 'mds', 'compression': None, 'hashes': self.hashes, 'size_limit': limit,
            'column_names': [c.name for c in self.columns],
            'column_encodings': [columns[c.name] for c in self.columns],
            'column_sizes': [c.size for c in self.columns],
        }
        self.config_data = json.dumps(self.config, sort_keys=True).encode('utf-8')
        self.size_limit = limit
        self.shards: list[dict[str, Any]] = []
        self._new_shard()

    def _new_shard(self) -> None:
        self._samples: list[bytes | memoryview] = []  # encoded rows (one or many each), in order
        self._sizes: list[int] = []  # each pending row's encoded bytes
        self._shard_size = 4 + 4 + len(self.config_data)  # sample count, last offset, config

    def write(self, sample: dict[str, Any]) -> None:
        data = [column.encode(sample[column.name]) for column in self.columns]
        sizes = [len(datum) for column, datum in zip(self.columns, data) if column.size is None]
        encoded = np.asarray(sizes, dtype=np.uint32).tobytes() + b''.join(data)
        size = len(encoded) + _OFFSET_BYTES
        if self.size_limit and self.size_limit < self._shard_size + size:
            self._flush_shard()
        self._samples.append(encoded)
        self._sizes.append(len(encoded))
        self._shard_size += size

    def write_batch(self, columns: dict[str, Any]) -> None:
        """Write many rows at once: the same files as :meth:`write` of each row in turn.

        ``columns`` as :meth:`foundrymix.format.schema.RowBatch.columns` gives them."""
        parts, sizes = self._encode_batch(columns)
        per_row = len(parts) // len(sizes) if len(sizes) else 0
        with_offset = sizes + _OFFSET_BYTES
        i, n = 0, len(sizes)
        while i < n:
            fit = np.cumsum(with_offset[i:])  # the rows that still fit, by write()'s rule
            room = self.size_limit - self._shard_size if self.size_limit else np.inf
            k = int(np.searchsorted(fit, room, side='right'))
            if k == 0:  # not one more row: a new shard (a row that never fits goes alone)
                self._flush_shard()
                k = 1
            self._samples.extend(parts[i * per_row:(i + k) * per_row])
            self._sizes.extend(sizes[i:i + k].tolist())
            self._shard_size += int(fit[k - 1])
            i += k

    def _encode_batch(self, columns: dict[str, Any]) -> tuple[list[memoryview], np.ndarray]:
        """``(every row's parts in order, each row's size)``: a row's parts joined are what
        :meth:`write` encodes. Parts, not a joined blob, so bytes are copied once, on flush."""
        n = None
        segments: list[Any] = []  # per row in order: small parts (flat, lens) or big ones (rows 2-D)
        var_sizes = []
        for column in self.columns:
            value = columns[column.name]
            if column.shape is not None:
                value = np.ascontiguousarray(value)
                if value.dtype != column.dtype:
                    raise ValueError(f'Wrong dtype: expected {column.dtype.name}, got {value.dtype.name}.')
                if value.shape[1:] != column.shape:
                    raise ValueError(f'Wrong shape: expected {column.shape}, got {value.shape[1:]}.')
                n = len(value)
                segments.append(value.view(np.uint8).reshape(n, column.size))
                continue
            values, counts = value
            counts = np.asarray(counts, dtype=np.int64)
            if values.dtype != column.dtype:
                raise ValueError(f'Wrong dtype: expected {column.dtype.name}, got {values.dtype.name}.')
            if len(counts) and int(counts.min()) <= 0:
                raise ValueError('Attempting to encode a numpy array with 0 elements.')
            n = len(counts)
            code = (counts >= 1 << 8).astype(np.int64) + (counts >= 1 << 16) + (counts >= 1 << 32)
            shape_bytes = 1 << code
            shape = counts.astype('<u8').view(np.uint8).reshape(n, 8)[np.arange(8) < shape_bytes[:, None]]
            lens = counts * column.dtype.itemsize
            datum = _interleave([((4 | code).astype(np.uint8), np.ones(n, np.int64)), (shape, shape_bytes),
                                 (np.ascontiguousarray(values).view(np.uint8), lens)])
            var_sizes.append(datum[1])
            segments.append(datum)
        assert n is not None
        if var_sizes:
            head = np.stack(var_sizes, axis=1).astype('<u4').view(np.uint8).reshape(-1)
            segments.insert(0, (head, np.full(n, 4 * len(var_sizes), np.int64)))
        merged: list[Any] = []  # neighbouring small parts joined per row
        for seg in segments:
            if isinstance(seg, tuple) and merged and isinstance(merged[-1], tuple):
                merged[-1] = _interleave([merged[-1], seg])
            else:
                merged.append(seg)
        sizes = np.zeros(n, np.int64)
        per_row = []
        for seg in merged:
            if isinstance(seg, tuple):
                flat, lens = seg
                bounds = np.concatenate(([0], np.cumsum(lens))).tolist()
                sizes += lens
            else:
                flat, width = seg.reshape(-1), seg.shape[1]
                bounds = list(range(0, n * width + 1, width))
                sizes += width
            view = memoryview(flat)
            per_row.append([view[a:b] for a, b in zip(bounds, bounds[1:])])
        return [part for row in zip(*per_row) for part in row], sizes

    def _flush_shard(self) -> None:
        basename = f'shard.{len(self.shards):05}.mds'
        n = len(self._sizes)
        offsets = np.concatenate(([0], np.cumsum(self._sizes, dtype=np.int64)))
        offsets = (offsets + 4 + 4 * (n + 1) + len(self.config_data)).astype(np.uint32)
        parts = [np.uint32(n).tobytes() + offsets.tobytes() + self.config_data, *self._samples]
        hashers = [fn() for fn in self._hash_fns]
        with open(os.path.join(self.out, basename), 'wb', buffering=_WRITE_BUFFER) as f:
            for part in parts:
                f.write(part)
                for h in hashers:
                    h.update(part)
        raw = {'basename': basename, 'bytes': sum(len(p) for p in parts),
               'hashes': {a: h.hexdigest() for a, h in zip(self.hashes, hashers)}}
        self.shards.append({'samples': n, 'raw_data': raw, 'zip_data': None, **self.config})
        self._new_shard()

    def finish(self) -> None:
        if self._sizes:
            self._flush_shard()
        with open(os.path.join(self.out, 'index.json'), 'w') as f:
            json.dump({'version': 2, 'shards': self.shards}, f, sort_keys=True)


def _interleave(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged byte arrays joined row by row: ``parts`` are ``(bytes back to back, each row's
    length)``; returns the same for rows made of part 0's row, then part 1's, ..."""
    total = sum(lens for _, lens in parts)
    out = np.empty(int(total.sum()), np.uint8)
    at = np.cumsum(total) - total  # where each row's next part goes
    for flat, lens in parts:
        out[np.repeat(at - (np.cumsum(lens) - lens), lens) + np.arange(len(flat))] = flat
        at = at + lens
    return out, total


#: numpy dtypes an ``ndarray:<dtype>`` MDS column may name (streaming's NDArray value dtypes)
_NDARRAY_DTYPES = ('uint8', 'uint16', 'uint32', 'uint64', 'int8', 'int16', 'int32', 'int64',
                   'float16', 'float32', 'float64')


def ndarray_rows(data: bytes | memoryview | Any, shard: dict[str, Any]) -> Optional[np.ndarray]:
    """A ``[rows, values]`` read-only view of the values of a shard whose one column is a 1-D
    ``ndarray:<dtype>[:<n>]`` and whose rows all have the same layout, else None; ``data`` is the
    uncompressed shard. Every row's header bytes are checked equal, so the view equals streaming's
    decoding (``tests/convert/test_adopt.py``) without streaming, torch, or a copy."""
    names, encodings = shard['column_names'], shard['column_encodings']
    parts = encodings[0].split(':') if len(names) == 1 else []
    if len(parts) not in (2, 3) or parts[0] != 'ndarray' or parts[1] not in _NDARRAY_DTYPES:
        return None
    dtype = np.dtype(parts[1]).newbyteorder('<')
    n = int(shard['samples'])
    if n == 0:
        return np.zeros((0, 0), dtype=dtype)
    offsets = np.frombuffer(data, np.uint32, count=n + 1, offset=4).astype(np.int64)
    k = int(offsets[1] - offsets[0])
    if not (np.diff(offsets) == k).all():
        return None
    row0 = bytes(data[int(offsets[0]):int(offsets[1])])
    if len(parts) == 3:  # fixed shape: the values alone
        head = 0
    else:
        if k < 5:
            return None
        byte = row0[4]
        ndim, shape_bytes = byte >> 2, 1 << (byte & 3)
        if ndim != 1:
            return None
        head = 5 + shape_bytes
        length = int.from_bytes(row0[5:head], 'little')
        if int.from_bytes(row0[:4], 'little') != k - 4 or head + length * dtype.itemsize != k:
            return None
    block = np.frombuffer(data, np.uint8, count=n * k, offset=int(offsets[0])).reshape(n, k)
    if head and not (block[:, :head] == np.frombuffer(row0[:head], np.uint8)).all():
        return None
    return block[:, head:].view(dtype)
