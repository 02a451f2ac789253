"""The one config reader: every annotation kind is checked, errors name the full key path."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import pytest
import yaml
from helpers import DEMO_TOKENIZER, SMALL_SEQ, tiny_run_config

from foundrymix.config import ConfigError, Duration, load_yaml, read_dataclass
from foundrymix.tools.plan import plan_from_yaml


@dataclass
class Leaf:
    size: int
    mode: Literal['fast', 'exact'] = 'fast'


@dataclass
class Middle:
    leaves: dict[str, Leaf] = field(default_factory=dict)
    ratio: Optional[float] = None


@dataclass
class Top:
    middle: Middle
    names: list[str] = field(default_factory=list)
    pair: tuple[float, float] = (0.0, 1.0)
    limit: Optional[Union[int, str]] = None
    width: int | None = None
    flags: dict[str, bool] = field(default_factory=dict)
    anything: Any = None


def read(d: dict) -> Top:
    return read_dataclass(Top, d, 'cfg')


def test_reads_every_kind():
    t = read({'middle': {'leaves': {'a': {'size': '2k', 'mode': 'exact'}}, 'ratio': 1},
              'names': ['x', 3], 'pair': [1, 2.5], 'limit': '10gb', 'width': 7,
              'flags': {'on': 'true'}, 'anything': {'free': [1]}})
    assert t.middle.leaves['a'] == Leaf(size=2000, mode='exact')
    assert t.middle.ratio == 1.0 and isinstance(t.middle.ratio, float)
    assert t.names == ['x', '3'] and t.pair == (1.0, 2.5)
    assert t.limit == '10gb' and read({'middle': {}, 'limit': 5}).limit == 5
    assert t.width == 7 and t.flags == {'on': True} and t.anything == {'free': [1]}


@pytest.mark.parametrize('data, message', [
    ({'middle': {'leaves': {'a': {'size': 'many'}}}},
     "cfg.middle.leaves.a.size: expected int, got 'many'"),
    ({'middle': {'leaves': {'a': {'size': 1, 'mode': 'slow'}}}},
     "cfg.middle.leaves.a.mode: 'slow' is not one of fast, exact"),
    ({'middle': {'leaves': {'a': {'size': 1, 'colour': 'red'}}}},
     "cfg.middle.leaves.a: unknown key 'colour'; allowed: size, mode"),
    ({'middle': {'leaves': {'a': {}}}}, "cfg.middle.leaves.a: missing required key 'size'"),
    ({'middle': {'ratio': 'half'}}, "cfg.middle.ratio: expected float, got 'half'"),
    ({'middle': {}, 'names': 'abc'}, "cfg.names: expected a list, got 'abc'"),
    ({'middle': {}, 'names': [['nested']]}, "cfg.names[0]: expected str, got ['nested']"),
    ({'middle': {}, 'pair': [1]}, 'cfg.pair: expected 2 values, got 1'),
    ({'middle': {}, 'width': 2.5}, 'cfg.width: expected int, got 2.5'),
    ({'middle': {}, 'width': True}, 'cfg.width: expected int, got True'),
    ({'middle': {}, 'limit': [1]}, 'cfg.limit: expected int or str, got [1]'),
    ({'middle': {}, 'flags': {'on': 'yes'}}, "cfg.flags.on: expected bool, got 'yes'"),
    ({'middle': {}, 'flags': ['on']}, "cfg.flags: expected a mapping, got ['on']"),
    ({'middle': 3}, 'cfg.middle: must be a mapping, got 3'),
    ({}, "cfg: missing required key 'middle'"),
])
def test_wrong_types_name_the_key_path(data, message):
    with pytest.raises(ConfigError) as e:
        read(data)
    assert str(e.value) == message


def test_duration_needs_a_unit():
    with pytest.raises(ConfigError) as e:
        Duration.from_config('10', 'max_duration')
    assert str(e.value) == "max_duration: '10' has no unit; give one (e.g. 10ep, 10ba, 10sp or 10tok)"
    assert Duration.from_config('10ba', 'max_duration') == '10ba'


def test_yaml_overrides_and_plus_form(tmp_path):
    path = tmp_path / 'c.yaml'
    path.write_text('variables: {n: 3}\na: ${variables.n}\nb: {c: 1}\n')
    assert load_yaml(str(path), ['b.c=2', '+d=x']) == {'variables': {'n': 3}, 'a': 3,
                                                       'b': {'c': 2}, 'd': 'x'}
    with pytest.raises(ConfigError, match="override 'oops' is not key=value"):
        load_yaml(str(path), ['oops'])
    path.write_text('a: [1\n')
    with pytest.raises(ConfigError, match='not valid YAML'):
        load_yaml(str(path))


def test_mapping_and_list_overrides_replace_scalar_overrides_set(tmp_path):
    """A mapping typed on the command line was merged into the YAML's, keeping streams the
    user left out; it (and a list) now replaces the value at its key, as typed."""
    path = tmp_path / 'c.yaml'
    path.write_text('seed: 1\n'
                    'train_loader:\n'
                    '  streams: {a: {local: /a, repeat: 2}, b: {local: /b}}\n'
                    '  stages:\n'
                    '    - {name: s0, streams: {a: {repeat: 1}, b: {repeat: 1}}}\n'
                    '    - {name: s1, streams: {a: {repeat: 1}, b: {repeat: 2}}}\n'
                    'tags: [x, y, z]\n')
    data = load_yaml(str(path), ['train_loader.streams={a: {local: /c}}',
                                 'train_loader.stages.1.streams={b: {repeat: 3}}',
                                 'tags=[w]', 'seed=4', 'train_loader.stages.0.streams.a.repeat=5'])
    assert data == {'seed': 4, 'tags': ['w'], 'train_loader': {
        'streams': {'a': {'local': '/c'}},
        'stages': [{'name': 's0', 'streams': {'a': {'repeat': 5}, 'b': {'repeat': 1}}},
                   {'name': 's1', 'streams': {'b': {'repeat': 3}}}]}}


def test_reading_a_config_imports_neither_torch_nor_composer():
    code = ('import sys; from foundrymix.train.config import TrainConfig; import foundrymix.tools.plan; '
            'from foundrymix.plan.config import LoaderConfig; '
            'print(sorted(m for m in ("torch", "composer", "streaming", "transformers") '
            'if m in sys.modules))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == '[]'


def _imported(args: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run the ``foundrymix`` CLI under ``-X importtime``: its result and every module imported."""
    done = subprocess.run([sys.executable, '-X', 'importtime', '-m', 'foundrymix.cli', *args],
                          capture_output=True, text=True, timeout=300)
    modules = {line.rsplit('|', 1)[1].strip() for line in done.stderr.splitlines()
               if line.startswith('import time:') and line.count('|') == 2}
    return done, modules


def test_plan_of_a_data_only_yaml_imports_no_trainer_torch_or_transformers(small_streams, tmp_path):
    """``foundrymix plan`` of a data-only YAML (tokenizer and eval_loader set, so every data
    check runs) on real streams: planned and checked by the core alone. The same data with a
    model is read by the trainer's config, which the import log then shows."""
    streams = {'arxiv': {'local': str(small_streams['arxiv'])}, 'dolly': {'local': str(small_streams['dolly'])}}
    data = {'train_loader': {'streams': streams}, 'eval_loader': {'streams': {'arxiv': streams['arxiv']}},
            'global_train_batch_size': 4, 'max_duration': '3ba', 'tokenizer': DEMO_TOKENIZER,
            'max_seq_len': SMALL_SEQ}
    (tmp_path / 'data.yaml').write_text(yaml.safe_dump(data))
    done, modules = _imported(['plan', str(tmp_path / 'data.yaml')])
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'max_duration 3ba: 3 batches, 12 samples' in done.stdout
    assert 'no model section' in done.stdout
    assert {'torch', 'transformers', 'composer', 'foundrymix.train.config'} & modules == set()
    assert {'foundrymix.plan.data_config', 'tokenizers'} <= modules  # the log holds the checks' imports

    (tmp_path / 'train.yaml').write_text(yaml.safe_dump({**tiny_run_config(data['train_loader']), **data}))
    done, modules = _imported(['plan', str(tmp_path / 'train.yaml')])
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'max_duration 3ba: 3 batches, 12 samples' in done.stdout and 'no model section' not in done.stdout
    assert 'foundrymix.train.config' in modules
    with pytest.raises(ConfigError, match=r"max_seq_len=64, but the train streams hold rows of 128 tokens$"):
        plan_from_yaml(str(tmp_path / 'data.yaml'), ['max_seq_len=64'])


def test_the_data_part_of_a_training_yaml():
    """``DataConfig.from_run`` (what ``build_loader`` reads): a YAML with ``model:`` has its data
    keys read and checked, the rest left to the trainer; a YAML without one is data-only and
    every key of it is checked."""
    from foundrymix.plan.data_config import DataConfig
    train = tiny_run_config({'streams': {'a': {'local': '/d'}}}, global_train_batch_size=4, max_duration='2ba',
                            optimizer={'lrr': 1}, tokenizer=DEMO_TOKENIZER)
    cfg = DataConfig.from_run(train)
    assert type(cfg) is DataConfig
    assert (cfg.global_train_batch_size, cfg.max_duration, cfg.max_seq_len, cfg.seed) == (4, '2ba', SMALL_SEQ, 5)
    assert cfg.train_loader.tokenizer == DEMO_TOKENIZER  # the run's tokenizer reaches its loaders
    with pytest.raises(ConfigError, match=r"^max_duration: '2' has no unit"):
        DataConfig.from_run({**train, 'max_duration': '2'})
    data = {k: v for k, v in train.items() if k not in ('model', 'optimizer', 'save_interval', 'loggers')}
    assert DataConfig.from_run(data) == cfg
    with pytest.raises(ConfigError, match=r"^config: unknown key 'optimizer'; allowed: train_loader, "):
        DataConfig.from_run({**data, 'optimizer': {'lr': 1}})
