"""The lean MDS writer (no streaming/torch import) writes exactly ``streaming.MDSWriter``'s files."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from streaming import MDSWriter

from foundrymix.format.mds import LeanMDSWriter, size_limit_bytes
from foundrymix.format.schema import encode_row, mds_columns
from helpers import ROOT


def _rows(n: int, seq: int, dtype: str, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        # doc_lens of 1..300 entries: the shape header's dtype changes at 256
        n_docs = int(rng.integers(1, 300)) if i % 7 == 0 else int(rng.integers(1, 9))
        spans = np.sort(rng.choice(seq, size=2 * int(rng.integers(1, 5)), replace=False))
        rows.append(encode_row(rng.integers(0, 30000, seq), spans, rng.integers(1, seq, n_docs), dtype))
    return rows


@pytest.mark.parametrize('dtype,size_limit,hashes', [
    ('uint16', '20kb', ['sha1', 'xxh3_64']),
    ('uint32', 50_000, ['xxh3_64']),
    ('uint16', None, []),  # one shard
])
def test_files_equal_streaming_mdswriter(tmp_path, dtype, size_limit, hashes):
    seq = 512
    columns = mds_columns(seq, dtype)
    rows = _rows(120, seq, dtype, seed=len(hashes))
    ref = MDSWriter(out=str(tmp_path / 'ref'), columns=columns, size_limit=size_limit, hashes=hashes,
                    progress_bar=False, exist_ok=False)
    lean = LeanMDSWriter(str(tmp_path / 'lean'), columns, hashes=hashes, size_limit=size_limit)
    for row in rows:
        ref.write(row)
        lean.write(row)
    ref.finish()
    lean.finish()
    names = sorted(os.listdir(tmp_path / 'ref'))
    assert sorted(os.listdir(tmp_path / 'lean')) == names
    shards = [n for n in names if n.endswith('.mds')]
    if size_limit is None:
        assert shards == ['shard.00000.mds']
    else:
        assert len(shards) > 3  # several shards: the size-limit rule was exercised
    for name in names:
        assert (tmp_path / 'lean' / name).read_bytes() == (tmp_path / 'ref' / name).read_bytes(), name


def test_bad_rows_fail_as_in_streaming(tmp_path):
    lean = LeanMDSWriter(str(tmp_path / 'o'), mds_columns(8, 'uint16'))
    with pytest.raises(ValueError, match='0 elements'):
        lean.write(encode_row(np.zeros(8), np.zeros(0), [8], 'uint16'))
    with pytest.raises(ValueError, match='Wrong shape'):
        lean.write(encode_row(np.zeros(7), [1, 7], [7], 'uint16'))
    assert size_limit_bytes('64mb') == 64 << 20 and size_limit_bytes('100b') == 100
    with pytest.raises(ValueError, match='Unsupported value/suffix'):
        size_limit_bytes('64 megs')


def test_uncompressed_conversion_never_imports_torch(tmp_path):
    """The point of the lean writer: a standalone conversion does not import torch."""
    code = ('import sys\nfrom foundrymix.cli import main\n'
            f'sys.argv = ["foundrymix", "convert", "pretrain", {str(ROOT / "data/samples/arxiv_sample.jsonl")!r}, '
            f'"-o", {str(tmp_path / "out")!r}, "--no-progress", "--max-seq-len", "256"]\n'
            'main(sys.argv[1:])\nprint(sorted(m for m in ("torch", "streaming") if m in sys.modules))\n')
    env = {**os.environ, 'PYTHONPATH': str(ROOT)}
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True, env=env)
    # transformers 5.x imports torch to load any tokenizer (its auto classes import its
    # configuration module, which imports torch): then torch is the tokenizer's, and what the
    # writer must not add is streaming
    import importlib.metadata
    tokenizer_torch = int(importlib.metadata.version('transformers').split('.')[0]) >= 5
    assert out.stdout.strip().splitlines()[-1] == ("['torch']" if tokenizer_torch else '[]')
    assert (tmp_path / 'out' / 'index.json').exists()


@pytest.mark.parametrize('dtype,size_limit', [('uint16', '20kb'), ('uint32', None), ('uint16', 900)])
def test_write_batch_equals_streaming_mdswriter(tmp_path, dtype, size_limit):
    """Rows written in batches of any size (some one by one between them) give streaming's
    MDSWriter's files, byte for byte: shard cuts (a size limit smaller than one row
    included), offsets, doc_lens shape headers of 1 and 2 bytes, index hashes."""
    from foundrymix.format.schema import RowBatch
    seq = 512
    columns = mds_columns(seq, dtype)
    rows = _rows(150, seq, dtype, seed=3)
    ref = MDSWriter(out=str(tmp_path / 'ref'), columns=columns, size_limit=size_limit, hashes=['xxh3_64'],
                    progress_bar=False, exist_ok=False)
    for row in rows:
        ref.write(row)
    ref.finish()
    lean = LeanMDSWriter(str(tmp_path / 'lean'), columns, hashes=['xxh3_64'], size_limit=size_limit)
    at = 0
    for size in [1, 37, 2, 60, 0, 50]:
        part = rows[at:at + size]
        at += size
        if size == 2:
            for row in part:
                lean.write(row)
            continue
        batch = RowBatch(np.stack([r['input_ids'] for r in part]).reshape(-1, seq) if part else
                         np.zeros((0, seq), dtype),
                         *(x for col in ('loss_spans', 'doc_lens')
                           for x in (np.concatenate([r[col] for r in part] or [np.zeros(0, np.int32)]),
                                     np.asarray([len(r[col]) for r in part], dtype=np.int64))))
        lean.write_batch(batch.columns())
    assert at == len(rows)
    lean.finish()
    names = sorted(os.listdir(tmp_path / 'ref'))
    assert sorted(os.listdir(tmp_path / 'lean')) == names and len(names) > (1 if size_limit is None else 4)
    for name in names:
        assert (tmp_path / 'lean' / name).read_bytes() == (tmp_path / 'ref' / name).read_bytes(), name
