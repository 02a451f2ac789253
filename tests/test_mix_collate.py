"""decode_row equals a token-by-token reference; collate gives int64 views of one pickle-friendly buffer."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from foundrymix.mix.collate import Batch, collate
from foundrymix.schema import IGNORE_INDEX, decode_row, encode_row
from mix_helpers import finetune_row, pretrain_row


def rows():
    out = [encode_row(*pretrain_row(0, r, 32), 'uint16') for r in range(5)]
    out += [encode_row(*finetune_row(1, r, 32, pad_id=3), 'uint16') for r in range(5)]
    full_pack = encode_row(np.arange(32) + 5, [(2, 9), (20, 32)], [9, 11, 12], 'uint16')
    empty_spans = encode_row(np.arange(32) + 5, [], [10], 'uint16')
    return out + [full_pack, empty_spans]


def reference_decode(row) -> dict[str, list[int]]:
    """The schema's meaning, one token at a time (an oracle independent of decode_row)."""
    ids = [int(x) for x in row['input_ids']]
    spans = row['loss_spans'].reshape(-1, 2).tolist()
    out = {'input_ids': ids, 'labels': [], 'attention_mask': [], 'sequence_id': [], 'position_ids': []}
    owner = []
    for seg, length in enumerate(row['doc_lens'].tolist()):
        owner += [(seg, pos) for pos in range(length)]
    for i, tok in enumerate(ids):
        in_loss = any(s <= i < e for s, e in spans)
        out['labels'].append(tok if in_loss else IGNORE_INDEX)
        real = i < len(owner)
        out['attention_mask'].append(1 if real else 0)
        out['sequence_id'].append(owner[i][0] if real else -1)
        out['position_ids'].append(owner[i][1] if real else 0)
    return out


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
