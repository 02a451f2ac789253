"""A local stream's shard readers come from the ``index.json`` the catalog read
(:class:`foundrymix.format.streaming_format.ParsedIndexShards`), not from streaming's second
read of the file: the same readers and rows as streaming's own ``Stream``, a dataset that
still pickles (``spawn`` workers), and the index the plan was made from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from foundrymix.format.streaming_format import ParsedIndexShards
from foundrymix.loader.mixer import StreamMixer
from mix_helpers import build_three, identity, loader_dict


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
    return build_three(str(tmp_path_factory.mktemp('parsed-index')), (40, 30, 20))


def test_readers_and_rows_equal_streamings_own(dirs):
    from streaming import Stream, StreamingDataset
    mixer = StreamMixer.from_dict(loader_dict(dirs, {}, shuffle=False))
    ours = mixer.build_dataset(2, world_size=1)
    try:
        assert all(isinstance(s.get_shards, ParsedIndexShards) for s in ours.streams)
        own = StreamingDataset(streams=[Stream(local=d) for d in dirs.values()], batch_size=2,
                               shuffle=False)
        assert len(ours.shards) == len(own.shards) > 3
        for a, b in zip(ours.shards, own.shards):
            assert (a.dirname, a.split, a.samples, a.file_pairs) == (b.dirname, b.split, b.samples,
                                                                     b.file_pairs)
        rows = [identity(np.asarray(ours.get_row(i)['input_ids'])) for i in range(ours.num_samples)]
        assert rows == [identity(np.asarray(own[i]['input_ids'], dtype=np.int64))
                        for i in range(own.num_samples)]
    finally:
        ours.release()


def test_the_dataset_reads_the_planned_index_not_a_later_file(dirs, tmp_path):
    """index.json rewritten after the plan read it (here: emptied of shards): the dataset
    still has the planned shards, so what trains is what was planned."""
    import shutil
    local = {n: str(tmp_path / n) for n in dirs}
    for n, d in dirs.items():
        shutil.copytree(d, local[n])
    mixer = StreamMixer.from_dict(loader_dict(local, {}, shuffle=False))
    mixer.catalog.infos()
    path = os.path.join(local['wiki'], 'index.json')
    index = json.load(open(path))
    json.dump(dict(index, shards=index['shards'][:1]), open(path, 'w'))
    ds = mixer.build_dataset(2, world_size=1)
    try:
        assert ds.num_samples == 90
    finally:
        ds.release()


def test_spawned_workers_load_the_dataset(dirs, tmp_path):
    """A DataLoader worker started with ``spawn`` unpickles the dataset (its streams'
    ``get_shards`` included) and yields the same batches as the main process."""
    code = f'''
import json, sys
sys.path.insert(0, {os.path.join(os.path.dirname(__file__), '..')!r})
from foundrymix.loader.mixer import StreamMixer
from mix_helpers import loader_dict
if __name__ == '__main__':
    mixer = StreamMixer.from_dict(loader_dict({dirs!r}, {{}}, shuffle=False, num_workers=1))
    ds = mixer.build_dataset(2, world_size=1)
    import torch.utils.data as tud
    from foundrymix.loader.collate import collate
    spawned = tud.DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context='spawn',
                             collate_fn=collate)
    a = [b['input_ids'][:, :2].tolist() for b in spawned]
    b = [b['input_ids'][:, :2].tolist() for b in tud.DataLoader(ds, batch_size=2, collate_fn=collate)]
    print(json.dumps([len(a), a == b]))
'''
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [45, True]


def test_an_iterator_held_at_exit_leaves_no_traceback(dirs):
    """A loader iterator still held when the interpreter exits: the run's teardown used to
    print ``Exception ignored ... ImportError: sys.meta_path is None`` from ``release``."""
    code = f'''
from foundrymix.loader.run_loader import build_staged_loader
from foundrymix.plan.config import LoaderConfig
import sys
sys.path.insert(0, {os.path.join(os.path.dirname(__file__), '..')!r})
from mix_helpers import loader_dict
config = LoaderConfig.from_dict(loader_dict({dirs!r}, {{}}))
loader = build_staged_loader(config, 2, '5ba')
it = iter(loader)
next(it)
print('held')
'''
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == 'held'
    assert 'Exception ignored' not in out.stderr and 'Traceback' not in out.stderr, out.stderr
