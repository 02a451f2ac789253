"""The plan beyond 20 streams: the extremes, the groups and the totals; one warning line per
kind of per-stream warning; ``--streams all`` and ``--json`` for every stream (issue 22).

Totals are checked against the streams' own ``index.json`` files, read here directly.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from foundrymix.cli import main
from foundrymix.tools.render import EXTREME_ROWS
from mix_helpers import build_stream

GROUPS = {'web': 1, 'code': 0.5, 'math': 2}   # repeat per group: code/ is under one pass
PER_GROUP = 10
YAML = '''
global_train_batch_size: 8
max_duration: 1ep
max_seq_len: 32
model: {{type: llama, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1,
         num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 32}}
train_loader:
  shuffle_seed: 17
  streams:
{streams}
'''


@pytest.fixture(scope='module')
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp('thirty')
    lines, rows = [], {}
    for g, (group, repeat) in enumerate(GROUPS.items()):
        for i in range(PER_GROUP):
            name, out = f'{group}/s{g}{i}', str(root / f'{group}-{i}')
            build_stream(out, 'pretrain', 20 + 3 * i + g, tag=g)
            with open(os.path.join(out, 'index.json')) as f:
                rows[name] = sum(s['samples'] for s in json.load(f)['shards'])
            lines.append(f'    {name}: {{local: {out}, repeat: {repeat}}}')
    path = root / 'run.yaml'
    path.write_text(YAML.format(streams='\n'.join(lines)))
    return str(path), rows


def plan_text(capsys, *args) -> str:
    assert main(['plan', *args]) == 0
    return capsys.readouterr().out


def table_rows(text: str) -> list[str]:
    """The first cell of every row of the first table (the mixture)."""
    table = text.split('Per group')[0]
    return [m.group(1) for m in re.finditer(r'^│ (\S[^│]*?)\s*│', table, re.M)]


def test_thirty_streams_show_extremes_groups_and_totals(capsys, config):
    path, rows = config
    doc = json.loads(plan_text(capsys, '--json', path))
    text = plan_text(capsys, path)
    names = table_rows(text)
    by_share = sorted(doc['streams'], key=lambda s: -s['share'])
    expected = [s['name'] for s in by_share[:EXTREME_ROWS]] + [f'... {30 - 2 * EXTREME_ROWS} more'] \
        + [s['name'] for s in by_share[-EXTREME_ROWS:]] + ['all 30']
    assert names == expected
    total = re.search(r'│ all 30\s*│\s*│\s*([\d,]+) │', text).group(1)
    assert int(total.replace(',', '')) == sum(rows.values())
    # one row per group, its rows the sum of its members' index files
    groups = dict(re.findall(r'^│ (\w+/)\s*│\s*10 │\s*([\d,]+) │', text.split('Per group')[1], re.M))
    assert {g: int(v.replace(',', '')) for g, v in groups.items()} == {
        f'{g}/': sum(n for s, n in rows.items() if s.startswith(f'{g}/')) for g in GROUPS}
    # per-stream lists become totals + extremes + groups
    trained = doc['duration']['total_samples']
    assert f'rows trained per stream over the run: 30 streams, {trained:,} in all; most:' in text


def test_one_line_per_kind_of_warning_and_every_stream_on_request(capsys, config):
    path, rows = config
    doc = json.loads(plan_text(capsys, '--json', path))
    under = [s for s in doc['streams'] if s['full_passes'] == 0]
    assert sorted(s['name'] for s in under) == sorted(n for n in rows if n.startswith('code/'))
    text = ' '.join(plan_text(capsys, path).split())   # rich wraps long lines
    assert text.count('warning:') == 1
    unseen = sum(s['unseen_rows'] for s in under)
    assert (f'warning: 10 streams under one pass: {unseen:,} of their '
            f'{sum(rows[s["name"]] for s in under):,} rows are not seen') in text
    full = plan_text(capsys, path, '--streams', 'all')
    assert len(table_rows(full)) == 30
    flat = ' '.join(full.split())
    assert flat.count('warning:') == 10
    for s in under:
        assert f'warning: {s["name"]}: under one pass ({s["passes"]:.3g}x): {s["unseen_rows"]:,} of' in flat
