"""``ShardRows``, the one reader of an MDS row, against the rows streaming's ``MDSWriter`` was given.

The independent source is what was written: shards written by streaming's own writer with
several column kinds, read back row by row from bytes and from the file, must give the
written values exactly; a cut file is named, not decoded; a removed file raises
``FileNotFoundError`` (what the loader's cache eviction relies on). LLM-Foundry's older
``bytes`` token column goes through the same reader.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from foundrymix.format.foundry_tokens import shard0_layout
from foundrymix.format.streaming_format import RowBoundsError, ShardRows


def _write(out, columns, rows, size_limit=1 << 12):
    from streaming import MDSWriter
    with MDSWriter(out=str(out), columns=columns, size_limit=size_limit) as w:
        for row in rows:
            w.write(row)
    return json.loads((out / 'index.json').read_text())


def _rows(n):
    rng = np.random.default_rng(5)
    return [{'input_ids': rng.integers(0, 60000, size=int(rng.integers(1, 90))).astype(np.uint16),
             'blob': rng.bytes(int(rng.integers(0, 40))), 'text': f'row {i} \u00e9', 'k': i * 7 - 3}
            for i in range(n)]


COLUMNS = {'input_ids': 'ndarray:uint16', 'blob': 'bytes', 'text': 'str', 'k': 'int'}


def test_rows_read_from_bytes_and_from_the_file_are_the_rows_written(tmp_path):
    written = _rows(200)
    index = _write(tmp_path / 'd', COLUMNS, written)
    assert len(index['shards']) > 2
    i = 0
    for shard in index['shards']:
        path = tmp_path / 'd' / shard['raw_data']['basename']
        data = path.read_bytes()
        for reader in (ShardRows(shard, data), ShardRows(shard, path=str(path))):
            assert len(reader) == shard['samples']
            for r in range(len(reader)):
                got, want = reader[r], written[i + r]
                assert got['input_ids'].dtype == np.uint16
                assert got['input_ids'].tobytes() == want['input_ids'].tobytes()
                assert (got['blob'], got['text'], got['k']) == (want['blob'], want['text'], want['k'])
            with pytest.raises(IndexError):
                reader[len(reader)]
        i += shard['samples']
    assert i == len(written)


def test_a_cut_shard_is_named_and_a_removed_file_raises_file_not_found(tmp_path):
    index = _write(tmp_path / 'd', COLUMNS, _rows(40))
    shard = index['shards'][0]
    path = tmp_path / 'd' / shard['raw_data']['basename']
    data = path.read_bytes()
    n = shard['samples']
    cut = ShardRows(shard, data[:len(data) - 3])
    with pytest.raises(RowBoundsError, match=r'are not inside the row data .*truncated shard'):
        cut[n - 1]
    assert cut[0]['k'] == -3  # rows before the cut still read
    with pytest.raises(RowBoundsError, match=r'offsets are past the end of the shard'):
        ShardRows(shard, data[:8])[3]
    from_file = ShardRows(shard, path=str(path))
    os.remove(path)
    with pytest.raises(FileNotFoundError):
        from_file[0]


def test_foundry_bytes_token_rows_are_read_by_the_same_reader(tmp_path):
    """LLM-Foundry's older writer: ``tokens`` as ``bytes`` of int64 values."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50000, size=(30, 16)).astype(np.int64)
    index = _write(tmp_path / 'f', {'tokens': 'bytes'}, [{'tokens': t.tobytes()} for t in tokens],
                   size_limit=1 << 20)
    [shard] = index['shards']
    data = (tmp_path / 'f' / shard['raw_data']['basename']).read_bytes()
    layout, rows = shard0_layout(data, shard, 'f')
    assert (layout.length, layout.dtype) == (16, 'int64')
    assert rows.dtype == np.int64 and np.array_equal(rows, tokens)
