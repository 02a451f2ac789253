"""decode_row and the batch decode of collate equal a token-by-token reference; collate gives
int64 views of one buffer that pickles compactly."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from foundrymix.loader.collate import Batch, collate
from foundrymix.format.schema import DECODED_KEYS, decode_row, encode_row
from helpers import reference_decode
from mix_helpers import finetune_row, pretrain_row


def rows():
    out = [encode_row(*pretrain_row(0, r, 32), 'uint16') for r in range(5)]
    out += [encode_row(*finetune_row(1, r, 32, pad_id=3), 'uint16') for r in range(5)]
    full_pack = encode_row(np.arange(32) + 5, [(2, 9), (20, 32)], [9, 11, 12], 'uint16')
    empty_spans = encode_row(np.arange(32) + 5, [], [10], 'uint16')
    return out + [full_pack, empty_spans]


def test_decode_row_matches_reference():
    for row in rows():
        got, want = decode_row(row), reference_decode(row)
        assert list(got) == list(want)
        for key in want:
            assert got[key].dtype == np.int64
            assert got[key].tolist() == want[key], key


def test_collate_stacks_int64_and_survives_pickle():
    samples = []
    for i, row in enumerate(rows()):
        s = decode_row(row)
        s['stream_id'], s['sample_id'] = i % 3, 100 + i
        samples.append(s)
    batch = collate(samples)
    assert isinstance(batch, Batch) and isinstance(batch, dict)
    assert list(batch) == list(samples[0])
    for key, value in batch.items():
        assert value.dtype == torch.int64
        expected = np.stack([np.asarray(s[key]) for s in samples])
        assert np.array_equal(value.numpy(), expected), key
    assert batch['sample_id'].tolist() == [100 + i for i in range(len(samples))]
    again = pickle.loads(pickle.dumps(batch))
    assert list(again) == list(batch)
    for key in batch:
        assert torch.equal(again[key], batch[key])
    batch['labels'] = batch['labels'].clone()  # edited batch still pickles correctly
    edited = pickle.loads(pickle.dumps(batch))
    assert torch.equal(edited['labels'], batch['labels'])


def stored_rows():
    """rows() plus edge cases: empty/zero-length documents, overlapping and empty spans, odd span list."""
    extra = [
        encode_row(np.arange(32) + 5, [], [], 'uint16'),                       # all padding
        encode_row(np.arange(32) + 5, [(0, 0), (31, 32)], [0, 5, 0, 27], 'uint16'),
        encode_row(np.arange(32) + 5, [(2, 10), (5, 12)], [32], 'uint16'),     # overlapping spans
        {'input_ids': np.arange(32, dtype=np.uint16), 'loss_spans': np.array([1, 4, 7], np.int32),
         'doc_lens': np.array([3, 4], np.int32)},                               # unpaired last value
    ]
    out = rows() + extra
    for i, row in enumerate(out):
        row['stream_id'], row['sample_id'] = i % 3, 100 + i
    return out


def test_batch_decode_matches_reference_and_decode_row():
    """collate of stored rows == the token-by-token reference == stacking decode_row, bitwise."""
    rows_ = stored_rows()
    for lo, hi in ((0, len(rows_)), (0, 1), (3, 9), (10, len(rows_))):
        part = rows_[lo:hi]
        batch = collate(part)
        assert list(batch) == list(DECODED_KEYS) + ['stream_id', 'sample_id']
        decoded = [decode_row(r) for r in part]
        for key in DECODED_KEYS:
            assert batch[key].dtype == torch.int64
            assert np.array_equal(batch[key].numpy(), np.stack([d[key] for d in decoded])), key
        for j, row in enumerate(part):
            if len(row['loss_spans']) % 2 == 0 and (np.diff(row['loss_spans'].reshape(-1, 2), axis=1) >= 0).all():
                want = reference_decode(row)
                for key in DECODED_KEYS:
                    assert batch[key][j].tolist() == want[key], (lo + j, key)
        assert batch['stream_id'].tolist() == [r['stream_id'] for r in part]
        assert batch['sample_id'].tolist() == [r['sample_id'] for r in part]


def test_row_and_decoded_collate_agree_and_pickle_compactly():
    rows_ = stored_rows()
    decoded = []
    for row in rows_:
        d = decode_row(row)
        d['stream_id'], d['sample_id'] = row['stream_id'], row['sample_id']
        decoded.append(d)
    a, b = collate(rows_), collate(decoded)
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    small, big = pickle.dumps(a), pickle.dumps(b)
    assert len(small) < len(big) / 5  # rows, not the int64 buffer
    again = pickle.loads(small)
    for key in a:
        assert torch.equal(again[key], a[key]), key
    a['labels'].mul_(0)  # written in place: no longer matches its rows, ships its buffer
    edited = pickle.loads(pickle.dumps(a))
    assert edited['labels'].abs().sum() == 0 and torch.equal(edited['input_ids'], a['input_ids'])


def test_batch_decode_handles_odd_rows_like_decode_row():
    """Out-of-range or reversed spans: slice semantics; bad lengths: an error -- in both paths."""
    odd = [encode_row(np.arange(32) + 5, [(0, 40), (-3, 32)], [20, 12], 'uint16'),
           encode_row(np.arange(32) + 5, [(5, 2)], [10, 0, 20], 'uint16')]
    for i, row in enumerate(odd):
        row['stream_id'], row['sample_id'] = 0, i
    batch = collate(odd)
    for j, row in enumerate(odd):
        for key, value in decode_row(row).items():
            assert np.array_equal(batch[key][j].numpy(), value), (j, key)
    for lens in ([20, 20], [10, -4, 20]):  # past the row's end, negative
        bad = encode_row(np.arange(32) + 5, [(0, 4)], lens, 'uint16')
        bad['stream_id'], bad['sample_id'] = 0, 0
        for decode in (decode_row, lambda row: collate([row])):
            with pytest.raises(ValueError):
                decode(bad)
