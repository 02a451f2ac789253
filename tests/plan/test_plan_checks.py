"""What ``plan`` and ``train`` refuse alike, and what the catalog checks before any row is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from foundrymix.cli import main
from foundrymix.config import ConfigError
from foundrymix.loader.mixer import StreamMixer
from foundrymix.format.shards import ShardFilesError
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
    ('max_duration=10', "max_duration: '10' has no unit; give one (e.g. 10ep, 10ba, 10sp or 10tok)"),
    ('global_train_batchsize=16', "config: unknown key 'global_train_batchsize'; allowed: "
                                  "train_loader, global_train_batch_size, max_duration, max_seq_len"),
    ('train_loader.streams.a.local=s3://bucket/a',
     "train_loader.streams.a.local: 's3://bucket/a' is a URL, not a local directory"),
    # keys plan used to skip (it read only train_loader, the batch and max_duration)
    ('optimizer.lrr=0.1', "optimizer: unknown key 'lrr'; allowed: name, lr, betas, eps, weight_decay"),
    ('scheduler.t_warmpu=10ba', "scheduler: unknown key 't_warmpu'; allowed: name, t_warmup, alpha_f"),
    ('callbacks.stream_acounting={}', "callbacks: unknown key 'stream_acounting'; allowed: "),
    ('seed=17.5', 'seed: expected int, got 17.5'),
])
def test_plan_and_train_refuse_alike(root, capsys, override, message):
    """``plan`` reads the whole run config as ``train`` does: same refusal, same words, and
    nothing printed before it; the error names the override that caused it, not the YAML."""
    assert main(['plan', str(root / 'run.yaml'), override]) == 2
    out, err = capsys.readouterr()
    assert out == ''
    assert err.startswith(f'foundrymix plan: error: override {override!r}: {message}')
    with pytest.raises(ConfigError) as e:
        load_config(str(root / 'run.yaml'), [override])
    assert str(e.value).startswith(f'override {override!r}: {message}')


def test_plan_refuses_a_fractional_seed_through_the_real_cli(root):
    proc = run_cli('plan', str(root / 'run.yaml'), 'seed=17.5')
    assert (proc.returncode, proc.stdout) == (2, '')
    assert proc.stderr == "foundrymix plan: error: override 'seed=17.5': seed: expected int, got 17.5\n"


def test_plan_refuses_a_microbatch_the_ranks_cannot_split(root, capsys):
    """Issue 26: ``composer -n 2`` died in a launcher crash dump on a microbatch of 4 with a
    global batch of 4 (2 per rank), and ``plan --world-size 2`` said nothing. Plan now refuses
    it for that topology, in the words train uses on a rank count that cannot split it."""
    proc = run_cli('plan', '--world-size', '2', str(root / 'run.yaml'), 'device_train_microbatch_size=4')
    assert (proc.returncode, proc.stdout) == (2, '')
    assert proc.stderr == ('foundrymix plan: error: device_train_microbatch_size=4 does not divide '
                           'the per-rank batch (2 = 4 / 2 ranks)\n')
    assert main(['plan', '--json', str(root / 'run.yaml'), 'device_train_microbatch_size=4']) == 0
    capsys.readouterr()
    # one rank: train refuses a microbatch of 3 exactly as plan does
    for command in ('plan', 'train'):
        if command == 'train':
            pytest.importorskip('composer')  # train's half: the composer extra (scripts/test_core.sh has none)
        assert main([command, str(root / 'run.yaml'), 'device_train_microbatch_size=3']) == 2
        assert capsys.readouterr().err == (f'foundrymix {command}: error: device_train_microbatch_size=3 '
                                           f'does not divide the per-rank batch (4 = 4 / 1 ranks)\n')


def test_proportions_not_summing_to_one_are_stated(root, capsys):
    assert main(['plan', '--json', str(root / 'run.yaml')]) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {s['name']: s['rows_per_epoch'] for s in plan['streams']}
    # the epoch is the streams' total rows (70), split 0.9 : 0.8 and rounded, then cut to
    # whole global batches
    N = plan['epoch_size']
    assert sum(plan['nominal_rows_per_epoch'].values()) == 70
    assert N == 70 - 70 % plan['global_batch_size'] and abs(rows['a'] - N * 0.9 / 1.7) <= 1
    shares = ', '.join(f'{n} {rows[n] / N:.1%}' for n in ('a', 'b'))
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


def run_cli(*args: str):
    """The real command line in a fresh process (what a user types)."""
    return subprocess.run([sys.executable, '-m', 'foundrymix.cli', *args], capture_output=True,
                          text=True, timeout=300)


def cut_index(root, tmp_path):
    """A copy of stream a whose index.json lost its last shard (the shard file stays), the
    run YAML on it, and the refusal message plan and train give (with verify's problem)."""
    damaged = tmp_path / 'a'
    index = copy_stream(root / 'a', damaged)
    dropped = index['shards'].pop()
    (damaged / 'index.json').write_text(json.dumps(index))
    listed = 40 - dropped['samples']
    problem = (f'{damaged / "index.json"} lists {listed:,} rows, {damaged / "foundrymix.json"} '
               f'records 40: they are not from one whole conversion (streaming reads only the rows '
               f'index.json lists); re-run `foundrymix convert` into {damaged}')
    message = (f'train_loader.streams.a: {problem} (`foundrymix verify {damaged}` shows which '
               f'shards are there)')
    yaml = tmp_path / 'run.yaml'
    yaml.write_text(YAML.format(a=damaged, b=root / 'b'))
    return damaged, yaml, message, problem


def test_index_listing_fewer_rows_than_the_manifest_is_refused_by_plan_and_verify(root, tmp_path, capsys):
    """An index.json cut short trained fewer rows than the manifest's, and ``plan`` only
    warned; plan, train and verify now all refuse it alike."""
    damaged, yaml, message, problem = cut_index(root, tmp_path)
    proc = run_cli('plan', str(yaml))
    assert (proc.returncode, proc.stdout) == (2, ''), proc.stderr
    assert proc.stderr == f'foundrymix plan: error: {message}\n'

    # the advice, followed: verify names the same two counts
    assert main(['verify', str(damaged)]) == 1
    out = capsys.readouterr().out
    assert f'  {problem}\n' in out
    assert 'verdict: CORRUPT' in out


def test_index_listing_fewer_rows_than_the_manifest_is_refused_by_train(root, tmp_path, capsys):
    pytest.importorskip('composer')  # it trains: the composer extra (scripts/test_core.sh has none)
    _, yaml, message, _ = cut_index(root, tmp_path)
    assert main(['train', str(yaml)]) == 2
    assert capsys.readouterr().err == f'foundrymix train: error: {message}\n'


def test_stream_mapping_overrides_replace_the_yaml_streams(root, tmp_path, capsys):
    """``train_loader.streams={a: ...}`` (and a stage's ``streams={...}``) planned the YAML's
    streams plus the typed ones; now exactly the typed ones."""
    assert main(['plan', '--json', str(root / 'run.yaml'),
                 f'train_loader.streams={{a: {{local: {root / "a"}}}}}']) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [(s['name'], s['rows_per_epoch']) for s in plan['streams']] == [('a', 40)]

    staged = tmp_path / 'staged.yaml'
    staged.write_text(YAML.format(a=root / 'a', b=root / 'b').replace('max_duration: 2ep\n', '')
                      .replace(', proportion: 0.9', '').replace(', proportion: 0.8', '') +
                      '  stages:\n'
                      '    - {name: first, duration: 2ba, streams: {a: {proportion: 1.0}}}\n'
                      '    - {name: second, duration: 2ba, streams: {a: {proportion: 0.5}, '
                      'b: {proportion: 0.5}}}\n')
    proc = run_cli('plan', '--json', str(staged), 'train_loader.stages.1.streams={b: {proportion: 1.0}}')
    assert proc.returncode == 0, proc.stderr
    stages = json.loads(proc.stdout)['stages']
    assert [[s['name'] for s in st['plan']['streams']] for st in stages] == [['a'], ['b']]


def test_plan_refuses_a_max_seq_len_the_streams_differ_from(root, capsys):
    """Issue 21: plan printed a plan for ``max_seq_len: 64`` over rows of 32 tokens; train refused
    it. Plan now refuses it in train's words."""
    assert main(['plan', str(root / 'run.yaml'), 'max_seq_len=64']) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ('', 'foundrymix plan: error: max_seq_len=64, but the train streams hold rows '
                              'of 32 tokens\n')


def test_plan_refuses_a_tokenizer_the_streams_were_not_made_with(root, capsys):
    """Issue 26: ``tokenizer:`` naming another tokenizer than the streams' was planned without
    a word and refused only by train. Plan refuses it with train's message (one function,
    ``train.config.check_streams``, for both); the streams' own tokenizer passes."""
    from helpers import spm_tokenizer_path
    from foundrymix.train.config import check_streams
    from foundrymix.plan.catalog import Catalog

    spm = spm_tokenizer_path()
    assert main(['plan', str(root / 'run.yaml'), f'tokenizer={spm}']) == 2
    out, err = capsys.readouterr()
    assert out == '' and err.startswith(f"foundrymix plan: error: tokenizer '{spm}' differs from the one "
                                        f"the streams were converted with (")
    cfg = load_config(str(root / 'run.yaml'), [f'tokenizer={spm}'])
    catalog = Catalog(cfg.train_loader)
    with pytest.raises(ConfigError) as train_refusal:  # what the trainer runs, word for word
        check_streams(cfg, catalog.max_seq_len, catalog.tokenizer)
    assert err == f'foundrymix plan: error: {train_refusal.value}\n'
    assert main(['plan', str(root / 'run.yaml'), 'tokenizer=foundrymix-bpe-8k']) == 0
