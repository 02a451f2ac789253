"""streaming's per-dataset ``<tmp>/NNNNNN_barrier_filelock`` / ``_cache_filelock`` go when the
dataset is released and its prefix is dead, and only then (streaming 0.13 leaves them for
good, and every later dataset's prefix scan walks past each; issue 22)."""

from __future__ import annotations

import gc
import os
import tempfile

from foundrymix.loader import streaming_compat
from foundrymix.loader.mixer import StreamMixer


def locks(ds) -> list[str]:
    prefix = streaming_compat.shm_prefix(ds)
    return [p for p in (os.path.join(tempfile.gettempdir(), f'{prefix}_{n}')
                        for n in streaming_compat.filelock_names()) if os.path.exists(p)]


def test_release_removes_the_dead_prefixs_filelocks_and_no_live_ones(small_streams):
    spec = {'streams': {n: {'local': str(d)} for n, d in small_streams.items()}, 'shuffle_seed': 5}
    first = StreamMixer.from_dict(spec).build_dataloader(batch_size=4)
    next(iter(first))
    a = first.dataset
    held = locks(a)
    assert held, 'streaming made its filelocks'
    del first
    gc.collect()
    a.release()
    assert [p for p in held if os.path.exists(p)] == []
    second = StreamMixer.from_dict(spec).build_dataloader(batch_size=4)
    next(iter(second))
    b = second.dataset
    live = locks(b)
    assert live
    from foundrymix.loader.cache.stale import remove_dead_filelocks
    assert remove_dead_filelocks(streaming_compat.shm_prefix(b)) == []  # its segments exist
    assert locks(b) == live
    del second
    gc.collect()
    b.release()
    assert locks(b) == []
