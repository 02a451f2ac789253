"""Fast decode equals schema.decode_row; collate gives int64 views of one pickle-friendly buffer."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from foundrymix.mix.collate import Batch, collate
from foundrymix.mix.dataset import decode_row_fast
from foundrymix.schema import decode_row, encode_row
from mix_helpers import finetune_row, pretrain_row


def rows():
    out = [encode_row(*pretrain_row(0, r, 32), 'uint16') for r in range(5)]
    out += [encode_row(*finetune_row(1, r, 32, pad_id=3), 'uint16') for r in range(5)]
    full_pack = encode_row(np.arange(32) + 5, [(2, 9), (20, 32)], [9, 11, 12], 'uint16')
    empty_spans = encode_row(np.arange(32) + 5, [], [10], 'uint16')
    return out + [full_pack, empty_spans]


def test_decode_row_fast_equals_decode_row():
    for row in rows():
        slow, fast = decode_row(row), decode_row_fast(row)
        assert list(slow) == list(fast)
        for key in slow:
            assert fast[key].dtype == np.int64
            assert np.array_equal(slow[key], fast[key]), key


def test_collate_stacks_int64_and_survives_pickle():
    samples = []
    for i, row in enumerate(rows()):
        s = decode_row_fast(row)
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
