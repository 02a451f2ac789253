"""``foundrymix.build_loader``: the run's loader for any training loop.

Every expectation comes from another loader run, not from the code under test: the batches of
N ranks against the batches of one rank, a resumed loader against the straight run, the
per-stream counts against the stream ids the batches carried, the loader a plain loop gets
against the one the Composer trainer builds.
"""

from __future__ import annotations

import collections
import io
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

import foundrymix
from foundrymix.config import ConfigError
from foundrymix.errors import MissingError
from foundrymix.loader.run_loader import StagedDataLoader
from helpers import ROOT, staged, tiny_run_config

KEYS = ('input_ids', 'labels', 'stream_id', 'sample_id', 'stage_id')


def batches(loader) -> list[dict]:
    return [{k: b[k].clone() for k in KEYS if k in b} for b in loader]


def joined(per_rank: list[list[dict]]) -> list[dict]:
    """The ranks' slices of each global batch, rank after rank."""
    return [{k: torch.cat([r[i][k] for r in per_rank]) for k in per_rank[0][i]}
            for i in range(len(per_rank[0]))]


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), i
        for k in w:
            assert torch.equal(g[k], w[k]), (i, k)


@pytest.fixture(scope='module')
def straight(small_streams) -> list[dict]:
    return batches(foundrymix.build_loader(staged(small_streams), rank=0, world_size=1))


def test_a_data_only_yaml_and_its_mapping_give_one_loader(small_streams, straight, tmp_path):
    path = tmp_path / 'data.yaml'
    cfg = staged(small_streams)
    cfg['variables'] = {'a': str(small_streams['arxiv'])}
    cfg['train_loader']['streams']['arxiv']['local'] = '${variables.a}'
    path.write_text(yaml.safe_dump(cfg))
    loader = foundrymix.build_loader(path, rank=0, world_size=1)
    assert isinstance(loader, StagedDataLoader) and loader.world_size == 1
    assert [s.name for s in loader.plan.stages] == ['text', 'mix'] and len(loader) == 14
    assert_same(batches(loader), straight)
    assert_same(batches(foundrymix.build_loader(cfg, rank=0, world_size=1)), straight)
    shorter = foundrymix.build_loader(path, rank=0, world_size=1,
                                      overrides=['train_loader.stages.1.duration=4ba'])
    assert_same(batches(shorter), straight[:9])  # an override, as on the command line
    # stage 'text' is arXiv only, then both streams
    assert {int(x) for b in straight[:5] for x in b['stream_id']} == {0}
    assert {int(x) for b in straight[5:] for x in b['stream_id']} == {0, 1}
    assert [int(b['stage_id'][0]) for b in straight] == [0] * 5 + [1] * 9


def test_the_ranks_split_each_global_batch_of_one_rank(small_streams, straight, monkeypatch):
    cfg = staged(small_streams)
    two = [batches(foundrymix.build_loader(cfg, rank=r, world_size=2)) for r in (0, 1)]
    assert all(len(b['sample_id']) == 2 for b in two[0])
    assert_same(joined(two), straight)
    monkeypatch.setenv('RANK', '1')  # the launcher's environment, as torchrun sets it
    monkeypatch.setenv('WORLD_SIZE', '2')
    loader = foundrymix.build_loader(cfg)  # (not read: that needs the launcher's process group)
    assert (loader.rank, loader.world_size) == (1, 2)


def _checkpoint(state: dict) -> dict:
    """Through a real checkpoint file's bytes, loaded as torch loads by default (weights_only)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize('stop', [3, 5, 8])  # in the first stage, at the switch, in the second
@pytest.mark.parametrize('before,after', [(1, 1), (2, 1), (1, 2)])
def test_resume_exact_and_elastic(small_streams, straight, stop, before, after):
    cfg = staged(small_streams)
    first = [foundrymix.build_loader(cfg, rank=r, world_size=before) for r in range(before)]
    done = []
    for loader in first:
        it = iter(loader)
        done.append([{k: b[k].clone() for k in KEYS if k in b} for _, b in zip(range(stop), it)])
    states = [_checkpoint(loader.state_dict()) for loader in first]
    assert all(s == states[0] for s in states)  # one position for every rank
    assert_same(joined(done), straight[:stop])
    rest = []
    for r in range(after):
        loader = foundrymix.build_loader(cfg, rank=r, world_size=after)
        loader.load_state_dict(states[0])
        rest.append(batches(loader))
    assert_same(joined(rest), straight[stop:])


def test_samples_per_stream_is_what_the_batches_carried(small_streams, straight):
    cfg = staged(small_streams)
    names = ['arxiv', 'dolly']
    seen = collections.Counter()
    loader = foundrymix.build_loader(cfg, rank=1, world_size=2)
    assert loader.samples_per_stream() == {'arxiv': 0, 'dolly': 0}
    for i, _ in enumerate(loader, start=1):
        seen.update(names[int(x)] for x in straight[i - 1]['stream_id'])
        assert loader.samples_per_stream() == {n: seen[n] for n in names}, i
        if i == 7:  # a loader resumed here reports the whole run's rows so far
            resumed = foundrymix.build_loader(cfg, rank=0, world_size=1)
            resumed.load_state_dict(loader.state_dict())
            assert resumed.samples_per_stream() == {n: seen[n] for n in names}
    assert loader.samples_per_stream() == loader.plan.rows_per_stream


def test_the_composer_trainer_gets_the_same_loader(small_streams, straight):
    """The trainer's loader (``builder._train_data``, what Composer is given) from a training
    YAML with the same data yields the same batches as ``build_loader`` of it."""
    pytest.importorskip('composer')  # the trainer's builder: the composer extra (scripts/test_core.sh has none)
    from foundrymix.train.builder import _train_data
    from foundrymix.train.config import TrainConfig
    cfg = {**staged(small_streams), 'max_seq_len': 128}
    train_cfg = tiny_run_config(cfg['train_loader'], global_train_batch_size=4)
    data = _train_data(TrainConfig.from_dict(train_cfg), 4)
    assert type(data.loader) is StagedDataLoader
    assert_same(batches(data.loader), straight)
    assert_same(batches(foundrymix.build_loader(train_cfg, rank=0, world_size=1)), straight)


def test_bad_calls_are_one_line_errors(small_streams, tmp_path):
    cfg = staged(small_streams)
    cases = [
        (dict(config=cfg, rank=2, world_size=2), 'rank 2 of world_size 2'),
        (dict(config=cfg, rank=0, world_size=3), 'global_train_batch_size=4 is not divisible by the 3 ranks'),
        (dict(config={**cfg, 'global_train_batchsize': 4}), "global_train_batchsize"),
        (dict(config=[cfg]), 'config must be a YAML path or a mapping, got list'),
        (dict(config=cfg, overrides=['seed=1']), 'overrides apply to a YAML file'),
        (dict(config={**cfg, 'max_seq_len': 64}), 'max_seq_len=64, but the train streams hold rows of 128'),
        (dict(config=str(tmp_path / 'missing.yaml')), 'missing.yaml: no such config file'),
    ]
    for kwargs, words in cases:
        kwargs.setdefault('world_size', 1)
        kwargs.setdefault('rank', 0)
        with pytest.raises(MissingError if 'missing' in words else ConfigError) as e:
            foundrymix.build_loader(**kwargs)
        assert words in str(e.value) and '\n' not in str(e.value), (kwargs, str(e.value))


def test_a_loop_with_the_loader_never_imports_composer(small_streams):
    cfg = staged(small_streams)
    code = textwrap.dedent(f'''
        import sys, foundrymix
        loader = foundrymix.build_loader({cfg!r}, rank=0, world_size=1)
        for batch in loader:
            pass
        loader.load_state_dict(loader.state_dict())
        print(loader.samples_per_stream())
        print(sorted(m for m in sys.modules if m == 'composer' or m.startswith('composer.')))
    ''')
    out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[-1] == '[]', out


def test_dataloader_workers_inherit_streaming_rather_than_import_it(small_streams, tmp_path):
    """A worker forked before streaming was imported imports it itself (seconds of CPU per
    worker, at every span); the loader imports it once, in the main process, before the
    fork. Seen by an import hook that logs the pid of every process that imports streaming."""
    cfg = staged(small_streams)
    cfg['train_loader']['num_workers'] = 2
    log = tmp_path / 'imports.log'
    code = textwrap.dedent(f'''
        import os, sys
        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name == 'streaming':
                    with open({str(log)!r}, 'a') as f:
                        f.write(f'{{os.getpid()}}\\n')
                return None
        sys.meta_path.insert(0, Watch())
        import foundrymix
        loader = foundrymix.build_loader({cfg!r}, rank=0, world_size=1)
        print(os.getpid(), sum(1 for _ in loader))
    ''')
    out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[1] == '14'  # both stages' batches (5 + 9), read by workers
    assert log.read_text().split() == [out[0]]  # imported once, by the main process


def test_samples_per_stream_of_an_adaptive_run(tmp_path_factory):
    """Adaptive segments: the counts follow each decision as the batches did."""
    from mix_helpers import build_three
    from adaptive_helpers import ROWS, Feeder, build, config
    loader = build(config(build_three(str(tmp_path_factory.mktemp('adaptive')), ROWS)))
    feeder, names = Feeder(loader), loader.plan.stream_names
    seen = collections.Counter()
    for i, batch in enumerate(loader, start=1):
        feeder.batch(batch)  # the loss of a finished segment decides the next one
        seen.update(names[int(x)] for x in batch['stream_id'])
        assert loader.samples_per_stream() == {n: seen[n] for n in names}, i
    assert len(set(tuple(d.rows) for d in loader.position.adaptive[0].decisions)) > 1  # it adapted
