"""LoaderConfig: strict keys, typed values, one kind of weight, cache dirs for remote-only streams."""

from __future__ import annotations

import os
import re

import pytest
from omegaconf import OmegaConf

from foundrymix.config import ConfigError
from foundrymix.plan.config import LoaderConfig, StreamSpec


def test_parses_llm_foundry_shape_from_dictconfig():
    cfg = OmegaConf.create({
        'variables': {'root': '/data'},
        'train_loader': {
            'streams': {
                'arxiv': {'local': '${variables.root}/arxiv', 'remote': 's3://b/arxiv',
                          'split': 'train', 'repeat': 2.5},
                'dolly': {'local': '/data/dolly', 'choose': 100},
            },
            'shuffle': True, 'shuffle_seed': 17, 'batching_method': 'stratified',
            'num_workers': 2,
        }})
    c = LoaderConfig.from_dict(cfg.train_loader)
    assert c.streams['arxiv'] == StreamSpec(name='arxiv', local='/data/arxiv', remote='s3://b/arxiv',
                                            split='train', repeat=2.5)
    assert c.streams['dolly'].choose == 100 and c.streams['dolly'].weight_kind == 'choose'
    assert (c.shuffle_seed, c.batching_method, c.num_workers, c.drop_last) == (17, 'stratified', 2, True)
    assert c.stream_dir('arxiv') == '/data/arxiv/train'


def test_unknown_stream_key_names_key_and_allowed():
    with pytest.raises(ConfigError) as e:
        LoaderConfig.from_dict({'streams': {'arxiv': {'local': '/x', 'repaet': 2}}})
    assert str(e.value) == ("train_loader.streams.arxiv: unknown key 'repaet'; allowed: local, "
                            "remote, split, repeat, proportion, choose, tokenizer; did you mean 'repeat'?")


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match=r"^train_loader: unknown key 'shufle'; allowed: streams, "
                                          r"shuffle, shuffle_seed, "):
        LoaderConfig.from_dict({'streams': {'a': {'local': '/x'}}, 'shufle': False})


def test_mixing_proportion_with_repeat_is_refused():
    with pytest.raises(ConfigError) as e:
        LoaderConfig.from_dict({'streams': {'a': {'local': '/a', 'proportion': 0.5},
                                            'b': {'local': '/b', 'repeat': 2},
                                            'c': {'local': '/c'}}})
    assert str(e.value).startswith(
        'train_loader.streams: cannot mix relative and absolute weights: proportion is set on a but '
        'not on b (repeat), c (no weight).')


def test_epoch_size_with_repeat_is_refused():
    with pytest.raises(ConfigError, match=r'train_loader.epoch_size: cannot be combined with '
                                          r'repeat/choose \(set on b\)'):
        LoaderConfig.from_dict({'streams': {'a': {'local': '/a'}, 'b': {'local': '/b', 'repeat': 2}},
                                'epoch_size': 100})


@pytest.mark.parametrize('stream, message', [
    ({'local': '/a', 'repeat': 1, 'choose': 3},
     'train_loader.streams.a: give at most one of repeat, proportion, choose (got repeat, choose; a stream, not a group, may give proportion and repeat: its share, and whole passes of it that size the epoch)'),
    ({'split': 'train'}, 'train_loader.streams.a: needs local and/or remote'),
    ({'local': '/a', 'repeat': 'lots'}, "train_loader.streams.a.repeat: expected float, got 'lots'"),
    ({'local': '/a', 'repeat': -1}, 'train_loader.streams.a.repeat: must be >= 0, got -1.0'),
])
def test_bad_stream_entries(stream, message):
    with pytest.raises(ConfigError) as e:
        LoaderConfig.from_dict({'streams': {'a': stream}})
    assert str(e.value) == message


def test_bad_enum_and_types():
    with pytest.raises(ConfigError, match=r"train_loader.batching_method: 'balanced' is not one of "
                                          r"random, stratified"):
        LoaderConfig.from_dict({'streams': {'a': {'local': '/a'}}, 'batching_method': 'balanced'})
    with pytest.raises(ConfigError, match=r"train_loader.num_workers: expected int, got 2.5"):
        LoaderConfig.from_dict({'streams': {'a': {'local': '/a'}}, 'num_workers': 2.5})
    with pytest.raises(ConfigError, match=r'train_loader.streams: must be a non-empty mapping'):
        LoaderConfig.from_dict({'streams': {}})
    with pytest.raises(ConfigError, match=r"train_loader: missing required key 'streams'"):
        LoaderConfig.from_dict({}, )
    c = LoaderConfig.from_dict({'streams': {'a': {'local': '/a', 'proportion': 1}},
                                'epoch_size': '2k'})
    assert c.epoch_size == 2000


def test_remote_only_stream_gets_a_cache_dir_keyed_by_remote(tmp_path):
    c = LoaderConfig.from_dict({'streams': {'a': {'remote': 's3://bucket/a', 'split': 'train'},
                                            'b': {'remote': 's3://bucket/b'}},
                                'cache_root': str(tmp_path)})
    la, lb = c.stream_local('a'), c.stream_local('b')
    assert os.path.dirname(la) == str(tmp_path) and os.path.basename(la).startswith('a-')
    assert la != lb
    assert c.stream_dir('a') == os.path.join(la, 'train')
    assert c.stream_remote_dir('a') == 's3://bucket/a/train'
    again = LoaderConfig.from_dict({'streams': {'a': {'remote': 's3://bucket/a'}},
                                    'cache_root': str(tmp_path)})
    assert again.stream_local('a') == la


def test_cache_root_in_a_stream_directory_or_a_dataset_is_refused(tmp_path, small_streams):
    """cache_root equal to (or inside) a local stream's directory, or a directory holding a
    dataset: refused before anything is written there (before, plan wrote its ``plans/``
    record among the stream's shards)."""
    import shutil

    from foundrymix.loader.mixer import StreamMixer

    arxiv, dolly = tmp_path / 'arxiv', tmp_path / 'dolly'
    shutil.copytree(small_streams['arxiv'], arxiv)
    shutil.copytree(small_streams['dolly'], dolly)
    listing = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob('*'))
    before = {d: listing(d) for d in (arxiv, dolly)}
    streams = {'arxiv': {'local': str(arxiv)}, 'dolly': {'local': str(dolly), 'repeat': 0.5}}
    advice = ("; foundrymix writes its records there (plans/, shuffles/, shard-hashes/, ...). Give "
              "cache_root a directory of its own, or leave it out ($FOUNDRYMIX_CACHE, else "
              "<tmp>/foundrymix-cache)")
    cases = [(str(dolly), f"train_loader.cache_root: {dolly} is stream dolly's directory {dolly}{advice}"),
             (str(arxiv / 'cache'),
              f"train_loader.cache_root: {arxiv / 'cache'} is inside stream arxiv's directory {arxiv}{advice}")]
    for root, message in cases:
        with pytest.raises(ConfigError) as e:
            StreamMixer.from_dict({'streams': streams, 'cache_root': root}).plan(4)
        assert str(e.value) == message
    other = tmp_path / 'other'  # a dataset that is not one of the run's streams
    shutil.copytree(small_streams['arxiv'], other)
    with pytest.raises(ConfigError) as e:
        LoaderConfig.from_dict({'streams': {'dolly': {'local': str(dolly)}}, 'cache_root': str(other)})
    assert str(e.value) == (f'train_loader.cache_root: {other} holds a dataset (foundrymix.json, '
                            f'index.json); foundrymix writes its records there. Give cache_root a '
                            f'directory of its own, or leave it out ($FOUNDRYMIX_CACHE, else '
                            f'<tmp>/foundrymix-cache)')
    assert {d: listing(d) for d in (arxiv, dolly)} == before
    # beside the streams (their parent) is fine: the records go in subdirectories of their own
    StreamMixer.from_dict({'streams': streams, 'cache_root': str(tmp_path)}).plan(4)
    assert {d: listing(d) for d in (arxiv, dolly)} == before


@pytest.mark.parametrize('key, value, kind', [
    ('shuffle_algo', 'py1e', 'sampler'), ('num_canonical_nodes', 1, 'sampler'),
    ('partition_algo', 'orig', 'sampler'), ('sampling_method', 'fixed', 'sampler'),
    ('sampling_granularity', 2, 'sampler'), ('predownload', 8, 'download')])
def test_streamings_sampler_knobs_are_refused_as_given_on_every_path(key, value, kind):
    """Refused whatever the value (even the old default), through the training YAML's reader
    (TrainConfig reads train_loader as a nested dataclass), from_dict and a stage's overrides."""
    from foundrymix.config import read_dataclass
    streams = {'a': {'local': '/a'}}
    message = f"train_loader.{key}: streaming's {kind} knob, which foundrymix's own sample order replaced"
    for read in (lambda d: read_dataclass(LoaderConfig, d, 'train_loader'),
                 lambda d: LoaderConfig.from_dict(d)):
        with pytest.raises(ConfigError, match=re.escape(message)):
            read({'streams': streams, key: value})
    with pytest.raises(ConfigError, match=re.escape(f"stages[0].{key}: streaming's {kind} knob")):
        LoaderConfig.from_dict({'streams': streams, 'stages': [
            {'name': 's', 'duration': '1ba', 'streams': {'a': {}}, key: value}]})


def test_drop_last_false_is_refused_for_training_only():
    from foundrymix.config import read_dataclass
    with pytest.raises(ConfigError, match=r'train_loader.drop_last: false is gone: every epoch is '
                                          r'whole global batches'):
        read_dataclass(LoaderConfig, {'streams': {'a': {'local': '/a'}}, 'drop_last': False},
                       'train_loader')
    ok = read_dataclass(LoaderConfig, {'streams': {'a': {'local': '/a'}}, 'drop_last': False},
                        'eval_loader')
    assert ok.drop_last is False
    assert read_dataclass(LoaderConfig, {'streams': {'a': {'local': '/a'}}, 'drop_last': True},
                          'train_loader').drop_last is True


@pytest.mark.parametrize('where', ['train_loader', 'eval_loader'])
def test_persistent_workers_true_is_refused_false_is_the_default(where):
    """Each span of batches is read by DataLoader workers of its own, so ``persistent_workers:
    true`` would be a promise the loader does not keep (``migrate`` removes it, saying why)."""
    from foundrymix.config import read_dataclass
    with pytest.raises(ConfigError) as e:
        read_dataclass(LoaderConfig, {'streams': {'a': {'local': '/a'}}, 'persistent_workers': True}, where)
    assert str(e.value) == (f'{where}.persistent_workers: true cannot be kept: each span of batches (an '
                            f'epoch, a stage, an adaptive segment, an evaluation) is read by DataLoader '
                            f'workers of its own, forked when it starts; remove it')
    assert read_dataclass(LoaderConfig, {'streams': {'a': {'local': '/a'}}, 'persistent_workers': False},
                          where).persistent_workers is False
