"""``foundrymix plan``: exact numbers from manifests and index files only; CLI text, JSON, errors."""

from __future__ import annotations

import json
import os

import pytest

from foundrymix.cli import main
from foundrymix.config import ConfigError
from foundrymix.loader.mixer import StreamMixer
from mix_helpers import PLAN_YAML, build_three, loader_dict, write_yaml


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp('plan')
    build_three(str(root), (120, 80, 60))
    return root


def loader_epochs(dirs, weights, batch_size, epochs):
    """Per epoch, the (stream tag, row) of every row the real loader yields, in order, rows
    identified by their tokens: what the plan must match."""
    from mix_helpers import identity
    m = StreamMixer.from_dict(loader_dict(dirs, weights, shuffle_seed=17))
    loader = m.build_dataloader(batch_size, epochs=epochs)
    rows = [identity(r) for b in loader for r in b['input_ids'].numpy()]
    loader.release()
    per = len(rows) // epochs
    return [rows[e * per:(e + 1) * per] for e in range(epochs)]


def test_plan_numbers(root):
    """Plan figures against hand-computed values and against the loader's own rows."""
    from collections import Counter

    from mix_helpers import MAX_SEQ_LEN, finetune_layout
    dirs = {n: str(root / n) for n in ('arxiv', 'wiki', 'dolly')}
    weights = {'arxiv': {'repeat': 1}, 'wiki': {'repeat': 2.5}, 'dolly': {'repeat': 0.5}}
    m = StreamMixer.from_dict(loader_dict(dirs, weights, shuffle_seed=17))
    p = m.plan(2, '200ba')
    epochs = loader_epochs(dirs, weights, 2, 2)
    seen = Counter(tag for tag, _ in epochs[0])
    # hand-computed: 120 x 1 + 80 x 2.5 + 60 x 0.5 rows, in batches of 2
    assert p.epoch_size == 120 + 200 + 30 == len(epochs[0]) and p.batches_per_epoch == 175
    arxiv, wiki, dolly = p.streams
    assert [s.rows_per_epoch for s in p.streams] == [seen[0], seen[1], seen[2]] == [120, 200, 30]
    wiki_rows = Counter(Counter(r for t, r in epochs[0] if t == 1).values())
    assert (wiki.full_passes, wiki.rows_seen_extra) == (2, 40) and wiki_rows == {2: 40, 3: 40}
    dolly_rows = {r for t, r in epochs[0] if t == 2}
    assert (dolly.kind, dolly.unseen_rows, dolly.tokens_exact) == ('finetune', 30, False)
    assert len(dolly_rows) == 30
    # real tokens of what the loader yields: full rows for pretrain, the packed layout for dolly
    real = {0: lambda r: MAX_SEQ_LEN, 1: lambda r: MAX_SEQ_LEN,
            2: lambda r: sum(finetune_layout(r, MAX_SEQ_LEN)[1])}
    realized = [sum(real[t](r) for t, r in epochs[0] if t == i) for i in range(3)]
    assert arxiv.tokens_exact and wiki.tokens_exact  # full rows: exact despite 2.5x
    assert [arxiv.tokens_per_epoch, wiki.tokens_per_epoch] == realized[:2] == [3840, 6400]
    all_dolly = sum(real[2](r) for r in range(60))
    assert dolly.tokens_per_epoch == all_dolly / 2  # expected value of a random half
    assert min(realized[2], dolly.tokens_per_epoch) / max(realized[2], dolly.tokens_per_epoch) > 0.8
    assert any(w.startswith('dolly: under one pass (0.5x): 30 of 60 rows are not seen') for w in p.warnings)
    d = p.duration  # 200 batches = epoch 0 (175) + 25 batches (50 samples) of epoch 1
    assert (d.total_batches, d.total_samples, d.total_tokens, d.full_epochs, d.last_epoch,
            d.last_batch_in_epoch) == (200, 400, 400 * 32, 1, 1, 25)
    trained = Counter(t for t, _ in epochs[0] + epochs[1][:50])
    assert d.rows_per_stream == {'arxiv': trained[0], 'wiki': trained[1], 'dolly': trained[2]}
    assert m.plan(2, '1000tok').duration.total_batches == 16  # ceil(1000 / (2 x 32))


def test_cli_table(root, tmp_path, capsys):
    assert main(['plan', write_yaml(tmp_path, root, '100ba')]) == 0
    out = capsys.readouterr().out
    assert '43 rows 2x, 37 rows 3x' in out  # wiki: 197 of 2.5 x 80 rows (3 cut for whole batches)
    assert 'global batch 8 (8 x 1 ranks): 43 batches = 344 samples per epoch' in out
    assert ('max_duration 100ba: 100 batches, 800 samples, 25,600 tokens = 2.326 epochs (2 full); '
            'stops in epoch 2 after batch 14 (sample 112 of the epoch)') in out
    assert 'warning: max_duration 100ba ends mid-epoch' in out
    assert ('exact epoch: 344 rows = 43 whole global batches of 8 (the weights ask for 350); '
            'left out per epoch: wiki 3 (of 200), dolly 3 (of 30)') in out


def test_cli_json_and_overrides(root, tmp_path, capsys):
    path = write_yaml(tmp_path, root)
    assert main(['plan', '--json', path, 'train_loader.streams.dolly.repeat=1',
                 'global_train_batch_size=4']) == 0
    data = json.loads(capsys.readouterr().out)
    assert data['epoch_size'] == 380 and data['batches_per_epoch'] == 95
    assert data['duration']['total_batches'] == 285 and data['duration']['ends_mid_epoch'] is False
    assert data['duration']['rows_per_stream'] == {'arxiv': 360, 'wiki': 600, 'dolly': 180}
    assert [s['name'] for s in data['streams']] == ['arxiv', 'wiki', 'dolly']


def test_cli_reads_no_shards(root, tmp_path, capsys, monkeypatch):
    opened = []
    real_open = open

    def spy(file, *a, **k):
        opened.append(os.fspath(file))
        return real_open(file, *a, **k)
    monkeypatch.setattr('builtins.open', spy)
    assert main(['plan', write_yaml(tmp_path, root)]) == 0
    assert not [f for f in opened if f.endswith('.mds')]
    assert any(f.endswith('foundrymix.json') for f in opened)


@pytest.mark.parametrize('override, by_override, message', [
    ('train_loader.streams.wiki.repaet=3', True,
     "train_loader.streams.wiki: unknown key 'repaet'; allowed: local, remote, split, repeat, "
     "proportion, choose, tokenizer; did you mean 'repeat'?"),
    # the YAML's repeat and the override's proportion together: the stream is the YAML's
    ('train_loader.streams.wiki.choose=5', False,
     'train_loader.streams.wiki: give at most one of repeat, proportion, choose'),
    # proportion beside repeat is a share with passes: every other stream then needs a share too
    ('train_loader.streams.wiki.proportion=0.5', False,
     'train_loader.streams: cannot mix relative and absolute weights: proportion is set on wiki'),
    ('max_duration=3xx', True, "max_duration: '3xx' is not a duration: a number and its unit, ep, ba, sp or tok"),
])
def test_cli_errors_exit_2(root, tmp_path, capsys, override, by_override, message):
    path = write_yaml(tmp_path, root)
    assert main(['plan', path, override]) == 2
    err = capsys.readouterr().err
    blamed = f'override {override!r}' if by_override else path
    assert err.startswith(f'foundrymix plan: error: {blamed}: {message}')


def test_cli_missing_manifest(tmp_path, capsys):
    (tmp_path / 'arxiv').mkdir()
    (tmp_path / 'wiki').mkdir()
    (tmp_path / 'dolly').mkdir()
    assert main(['plan', write_yaml(tmp_path, tmp_path)]) == 2
    assert 'train_loader.streams.arxiv: no foundrymix manifest' in capsys.readouterr().err


@pytest.mark.parametrize('workers, duration', [(0, '3ep'), (2, '1000sp'), (2, '32000tok')])
def test_headline_samples_and_tokens_are_what_the_loader_yields(root, tmp_path, capsys, workers,
                                                                duration):
    """The headline counts the rows and tokens a real loader yields, and a duration in
    samples or tokens ends on the batch where Composer's count (rows, rows x 32 tokens)
    reaches it; the rows per stream over the run are the loader's."""
    import re
    from collections import Counter

    from helpers import build_staged_loader
    from foundrymix.plan.config import LoaderConfig
    from mix_helpers import identity
    assert main(['plan', write_yaml(tmp_path, root, duration),
                 f'train_loader.num_workers={workers}', '--json']) == 0
    doc = json.loads(capsys.readouterr().out)
    d = doc['duration']
    planned = [d['total_batches'], d['total_samples'], d['total_tokens']]
    streams = {n: {'local': str(root / n), 'repeat': r} for n, r in
               (('arxiv', 1), ('wiki', 2.5), ('dolly', 0.5))}
    loader = build_staged_loader(LoaderConfig.from_dict(
        {'streams': streams, 'shuffle_seed': 17, 'num_workers': workers}), 8, duration)
    batches = [b['input_ids'].numpy() for b in loader]
    loader.release()
    yielded = [len(batches), sum(len(b) for b in batches), sum(b.size for b in batches)]
    assert planned == yielded
    tags = Counter(identity(r)[0] for b in batches for r in b)
    assert d['rows_per_stream'] == {'arxiv': tags[0], 'wiki': tags[1], 'dolly': tags[2]}
    assert doc['counted'] == {'epoch': 'arithmetic', 'per_rank': 'arithmetic', 'run': 'arithmetic'}
    if not duration.endswith('ep'):  # Composer's count reaches the duration at the last batch
        unit = 1 if duration.endswith('sp') else 32
        counted = [sum(len(b) for b in batches[:n]) * unit for n in (len(batches) - 1, len(batches))]
        assert counted[0] < int(re.match(r'\d+', duration).group()) <= counted[1]


def test_passes_over_the_run_in_one_line(root, tmp_path, capsys):
    """repeat 1 / 2.5 / 0.5 over 350 rows = 50 batches of 7: 2 epochs are 2, 5 and 1 passes
    (what the weights ask for, twice); a run that stops mid-epoch counts the rows it trains."""
    path = write_yaml(tmp_path, root, '2ep')
    assert main(['plan', path, 'global_train_batch_size=7', 'device_train_microbatch_size=7']) == 0
    assert 'passes over the run: arxiv 2.00, wiki 5.00, dolly 1.00\n' in capsys.readouterr().out
    assert main(['plan', path, 'global_train_batch_size=7', 'device_train_microbatch_size=7',
                 'max_duration=75ba', '--json']) == 0
    d = json.loads(capsys.readouterr().out)['duration']
    rows = {'arxiv': 120, 'wiki': 80, 'dolly': 60}
    assert d['passes_per_stream'] == {n: d['rows_per_stream'][n] / rows[n] for n in rows}
    assert sum(d['rows_per_stream'].values()) == 75 * 7



def test_a_stream_trained_for_a_sliver_of_a_pass_is_not_printed_as_none():
    """187 of 49,611 rows is 0.0038 of a pass: two decimals would print 0.00, as if untrained."""
    from foundrymix.tools.render import passes_line
    assert passes_line({'big': 187 / 49611, 'chat': 53 / 30, 'unused': 0.0}, 'the run') == \
        'passes over the run: big 0.0038, chat 1.77, unused 0.00'
    many = passes_line({f's{i}': i / 1000 for i in range(40)}, 'the run')
    assert many.endswith('least: s0 0.00, s1 0.001, s2 0.002, s3 0.003, s4 0.004')

STAGED = '''
global_train_batch_size: 8
max_seq_len: 32
model: {{type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1,
         num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 32}}
train_loader:
  shuffle_seed: 17
  stages:
    - name: warm
      duration: 7ba
      streams: {{arxiv: {{local: {root}/arxiv}}, wiki: {{local: {root}/wiki, repeat: 0.3}}}}
    - name: mix
      duration: 1ep
      streams: {{'*': {{proportion: 1.0}}, arxiv: {{local: {root}/arxiv}}, dolly: {{local: {root}/dolly}}}}
'''


@pytest.mark.parametrize('world', [1, 4])
def test_plan_json_is_dataclasses_asdict(root, tmp_path, world):
    """``Plan.to_dict`` (what ``plan --json`` prints) is exactly ``dataclasses.asdict`` of
    the plan -- the library's own conversion is the oracle -- for a single mixture ending
    mid-epoch, over 1 and 4 ranks (per-rank plans), and for each stage of a staged run."""
    import dataclasses

    from foundrymix.tools.plan import plan_from_yaml
    single = plan_from_yaml(write_yaml(tmp_path, root, duration='40ba'), world_size=world)
    staged_yaml = tmp_path / 'staged.yaml'
    staged_yaml.write_text(STAGED.format(root=root))
    staged = plan_from_yaml(str(staged_yaml), world_size=world)
    plans = [single] + [stage.plan for stage in staged.stages]
    assert len(plans) == 3 and any(p.per_rank for p in plans)
    for plan in plans:
        got = plan.to_dict()
        assert got == dataclasses.asdict(plan)
        assert json.dumps(got, sort_keys=True) == json.dumps(dataclasses.asdict(plan), sort_keys=True)
        # and, as asdict's, a copy: no list or dict of the result is one the plan holds
        assert not _containers(got) & _containers(plan)


def _containers(obj, seen=None) -> set:
    """The ids of every list and dict reachable from ``obj`` through dataclass fields,
    lists, tuples and dict values."""
    import dataclasses
    seen = set() if seen is None else seen
    if isinstance(obj, (list, dict)):
        if id(obj) in seen:
            return seen
        seen.add(id(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _containers(getattr(obj, f.name), seen)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _containers(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            _containers(x, seen)
    return seen


def _data_only(tmp_path, root, seq_len: bool = False) -> str:
    """The run YAML without its model section (and without max_seq_len unless ``seq_len``)."""
    lines = PLAN_YAML.format(root=root, duration='3ep').splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('model:'))
    del lines[start:start + 2]  # model: {...} spans two lines
    if not seq_len:
        lines.remove('max_seq_len: 32')
    path = tmp_path / 'data-only.yaml'
    path.write_text('\n'.join(lines) + '\n')
    assert 'model' not in path.read_text()
    return str(path)


def test_plan_reads_a_data_only_yaml(root, tmp_path, capsys):
    """A data engineer's YAML (streams, batch, duration; no model, no max_seq_len) plans exactly
    what the training YAML with a model plans, text and JSON, with one line saying a model is
    left out; a wrong max_seq_len is still refused; train refuses it as before."""
    assert main(['plan', write_yaml(tmp_path, root)]) == 0
    full = capsys.readouterr().out
    path = _data_only(tmp_path, root)
    assert main(['plan', path]) == 0
    assert capsys.readouterr().out == ('no model section: the data is planned; `foundrymix train` needs a '
                                       'model (and max_seq_len)\n' + full)
    assert main(['plan', '--json', write_yaml(tmp_path, root)]) == 0
    full_json = json.loads(capsys.readouterr().out)
    assert main(['plan', '--json', path]) == 0
    assert json.loads(capsys.readouterr().out) == full_json
    assert main(['plan', path, 'max_seq_len=16']) == 2
    assert 'max_seq_len=16, but the train streams hold rows of 32 tokens' in capsys.readouterr().err
    assert main(['plan', path, 'train_loader.streams.wiki.repaet=3']) == 2  # still read strictly
    assert "unknown key 'repaet'" in capsys.readouterr().err


def test_train_still_needs_the_model_section(root, tmp_path):
    """``python train.py`` on the data-only YAML: refused in one line, as before plan read it."""
    import subprocess
    import sys
    from pathlib import Path
    path = _data_only(tmp_path, root, seq_len=True)
    train_py = Path(__file__).resolve().parents[2] / 'train.py'
    done = subprocess.run([sys.executable, str(train_py), path], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ''
    assert done.stderr.strip().splitlines() == [
        f"foundrymix train: error: {path}: config: missing required key 'model'"]
