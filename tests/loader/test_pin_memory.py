"""``train_loader.pin_memory``: batches handed over in page-locked memory by the DataLoader's pin
thread (the default where CUDA is available), equal bitwise to the unpinned batches.

The pin thread copies a batch (``copy.copy``) and pins its values; a batch of stored rows must
not be decoded again by that copy, or the pin thread would decode every batch twice.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import foundrymix
from foundrymix.loader.collate import collate
from helpers import staged

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')


def loader(streams, workers: int, **extra):
    cfg = staged(streams)
    cfg['train_loader'].update(num_workers=workers, **extra)
    return foundrymix.build_loader(cfg, rank=0, world_size=1)


def test_copying_a_batch_keeps_its_tensors_and_decodes_nothing(small_streams):
    """The pin thread gets a batch as a worker pickled it (its stored rows, decoded where
    unpickled) and first copies it (``copy.copy``: it is a ``Mapping``). The copy holds the very
    tensors of the batch (a decode would make new ones) and is still a batch."""
    run = loader(small_streams, workers=0)
    run.prepare()
    rows = [run.storage.get_row(i) for i in range(4)]
    batch = pickle.loads(pickle.dumps(collate(rows)))  # what the DataLoader's result queue gives
    assert all(torch.equal(batch[k], v) for k, v in collate(rows).items())
    clone = copy.copy(batch)
    assert type(clone) is type(batch) and list(clone) == list(batch)
    assert all(clone[k] is batch[k] for k in batch)


@gpu
def test_pinned_batches_equal_unpinned_and_are_pinned_by_default_on_cuda(small_streams):
    """Where CUDA is available the default pins (as ``pin_memory: true``); every batch, read by
    two workers, equals the unpinned loader's bitwise."""
    plain = list(loader(small_streams, workers=2, pin_memory=False))
    for pinned in (list(loader(small_streams, workers=2)), list(loader(small_streams, workers=2, pin_memory=True))):
        assert len(pinned) == len(plain) == 14
        for a, b in zip(pinned, plain):
            assert list(a) == list(b)
            assert all(a[k].is_pinned() and not b[k].is_pinned() for k in a)
            assert all(torch.equal(a[k], b[k]) for k in a)
