"""What ``plan`` and ``train`` refuse alike, and what the catalog checks before any row is read."""

from __future__ import annotations

import json
import os

import pytest

from foundrymix.cli import main
from foundrymix.config import ConfigError
from foundrymix.mix.mixer import StreamMixer
from foundrymix.shards import ShardFilesError
from foundrymix.train.config import load_config
from mix_helpers import build_stream

YAML = '''
global_train_batch_size: 4
max_seq_len: 32
max_duration: 2ep
model: {{type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1,
         num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 32}}
train_loader:
  streams:
    a: {{local: {a}, proportion: 0.9}}
    b: {{local: {b}, proportion: 0.8}}
'''


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp('checks')
    build_stream(str(root / 'a'), 'pretrain', 40, 0)
    build_stream(str(root / 'b'), 'finetune', 30, 1)
    (root / 'run.yaml').write_text(YAML.format(a=root / 'a', b=root / 'b'))
    return root


@pytest.mark.parametrize('override, message', [
    ('max_duration=10', "max_duration: '10' has no unit; write it as a Composer time string"),
    ('global_train_batchsize=16', "config: unknown key 'global_train_batchsize'; allowed: "
                                  "max_seq_len, model, train_loader, global_train_batch_size"),
    ('train_loader.streams.a.local=s3://bucket/a',
     "train_loader.streams.a.local: 's3://bucket/a' is a URL, not a local directory"),
])
def test_plan_and_train_refuse_alike(root, capsys, override, message):
    assert main(['plan', str(root / 'run.yaml'), override]) == 2
    assert capsys.readouterr().err.startswith(f'foundrymix plan: error: {message}')
    with pytest.raises(ConfigError) as e:
        load_config(str(root / 'run.yaml'), [override])
    assert str(e.value).startswith(f'{root / "run.yaml"}: {message}')


def test_proportions_not_summing_to_one_are_stated(root, capsys):
    assert main(['plan', '--json', str(root / 'run.yaml'), 'train_loader.exact=false']) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {s['name']: s['rows_per_epoch'] for s in plan['streams']}
    # streaming's epoch is the streams' total rows (70), split 0.9 : 0.8 and rounded
    assert plan['epoch_size'] == 70 and abs(rows['a'] - 70 * 0.9 / 1.7) <= 1
    shares = ', '.join(f'{n} {rows[n] / 70:.1%}' for n in ('a', 'b'))
    assert (f'proportions sum to 1.7 (0.9 + 0.8), not 1: they are normalised to {shares} of the '
            f'epoch') in plan['warnings']


def test_validate_hash_must_be_recorded(root):
    mixer = StreamMixer.from_dict({'streams': {'a': {'local': str(root / 'a')}},
                                   'validate_hash': 'sha1'})
    with pytest.raises(ConfigError) as e:
        mixer.validate()
    assert str(e.value).startswith("train_loader.validate_hash: stream 'a': validate_hash 'sha1' "
                                   "is not recorded in its index.json (hashes recorded for every "
                                   "shard: xxh3_64); streaming would fail when it fetches a shard")


def copy_stream(src, dst):
    import shutil
    shutil.copytree(src, dst)
    with open(os.path.join(dst, 'index.json')) as f:
        return json.load(f)


@pytest.mark.parametrize('damage', ['truncate', 'delete'])
def test_shards_not_matching_the_index_are_refused_by_plan(root, tmp_path, damage):
    index = copy_stream(root / 'a', tmp_path / 'a')
    shard = index['shards'][1]['raw_data']
    path = tmp_path / 'a' / shard['basename']
    if damage == 'truncate':
        path.write_bytes(path.read_bytes()[:100])
    else:
        path.unlink()
    mixer = StreamMixer.from_dict({'streams': {'a': {'local': str(tmp_path / 'a')}}})
    with pytest.raises(ShardFilesError) as e:
        mixer.plan(batch_size=4)
    assert str(e.value).startswith(f"stream 'a' ({tmp_path / 'a'}): 1 shard file(s) do not match "
                                   f"index.json: {path}: ")
    if damage == 'truncate':
        assert f'100 bytes, index.json records {shard["bytes"]:,} (truncated)' in str(e.value)
    else:
        assert f'shard file missing (index.json records {shard["bytes"]:,} bytes)' in str(e.value)
