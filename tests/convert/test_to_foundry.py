"""``foundrymix export DATASET --to-foundry OUT``: the way back to LLM-Foundry's token shards.

Checked against independent sources: streaming's own ``LocalDataset`` reads OUT (as Foundry's
``StreamingTextDataset`` does, a ``tokens`` ndarray column), and the tokens, read back in row
order, are the converted paper tokenized by the tokenizer itself plus the EOS the converter ends a
document with (less the partial last row the converter does not write). A finetune dataset, an existing OUT and a damaged shard are refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import DEMO_TOKENIZER, ROOT, SAMPLES, mode_prefix

from foundrymix.cli import main


def test_export_to_foundry_writes_the_papers_tokens_as_foundry_reads_them(small_streams, tmp_path, capsys):
    from streaming import LocalDataset

    from foundrymix.tokenizer import load_tokenizer

    out = tmp_path / 'foundry'
    assert main(['export', str(small_streams['arxiv']), '--to-foundry', str(out)]) == 0
    said = capsys.readouterr().out
    index = json.loads((out / 'index.json').read_text())
    assert [s['column_names'] for s in index['shards']] == [['tokens']] * len(index['shards'])
    rows = [LocalDataset(str(out))[i]['tokens'] for i in range(len(LocalDataset(str(out))))]
    manifest = json.loads((small_streams['arxiv'] / 'foundrymix.json').read_text())
    assert len(rows) == manifest['counts']['rows'] and sum(len(r) for r in rows) == manifest['counts']['tokens']
    assert f"{manifest['counts']['rows']:,} rows, {manifest['counts']['tokens']:,} tokens" in said
    with open(SAMPLES / 'arxiv_sample.jsonl', encoding='utf-8') as f:
        paper = json.loads(f.readline())['text'][:12000]  # what the small_streams fixture converted
    tok = load_tokenizer(DEMO_TOKENIZER)
    want = tok(paper, add_special_tokens=False)['input_ids'] + [tok.eos_token_id]
    tail = manifest['counts']['tail_tokens']  # the converter's last, partial row is not written
    assert tail > 0 and np.concatenate(rows).tolist() == want[:len(want) - tail]


def test_export_to_foundry_refuses_finetune_data_an_existing_out_and_a_damaged_shard(small_streams, tmp_path,
                                                                                       capsys):
    assert main(['export', str(small_streams['dolly']), '--to-foundry', str(tmp_path / 'a')]) == 2
    assert "a finetune dataset: its rows carry loss spans" in capsys.readouterr().err
    assert not (tmp_path / 'a').exists()
    (tmp_path / 'b').mkdir()
    (tmp_path / 'b' / 'mine.txt').write_text('keep')
    assert main(['export', str(small_streams['arxiv']), '--to-foundry', str(tmp_path / 'b')]) == 2
    assert 'b: exists; give a new directory' in capsys.readouterr().err
    assert [p.name for p in (tmp_path / 'b').iterdir()] == ['mine.txt']
    damaged = tmp_path / 'damaged'
    shutil.copytree(small_streams['arxiv'], damaged)
    shard = sorted(damaged.glob('shard.*.mds'))[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    assert main(['export', str(damaged), '--to-foundry', str(tmp_path / 'c')]) == 2
    err = capsys.readouterr().err
    assert f'{shard}: row ' in err and 'Traceback' not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ['b', 'damaged']  # nothing partial left


def test_export_to_foundry_into_a_read_only_folder_is_one_line_naming_it(small_streams, tmp_path):
    """The real command line obeying file modes (root: under ``setpriv`` without its file-access
    capabilities): one line naming the folder and what to do, not streaming's uploader's traceback."""
    prefix = mode_prefix()
    if prefix is None:
        pytest.skip('root without setpriv: file modes are not enforced')
    ro = tmp_path / 'ro'
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = subprocess.run([*prefix, sys.executable, '-m', 'foundrymix.cli', 'export', str(small_streams['arxiv']),
                            '--to-foundry', str(ro / 'out')], capture_output=True, text=True, timeout=120,
                           cwd=ROOT, env={**os.environ, 'PYTHONPATH': str(ROOT)})
    finally:
        ro.chmod(0o755)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f'foundrymix export: error: {ro}/out: cannot be created, no permission to write in '
                        f'{ro}; choose another --to-foundry, or make {ro} writable\n')
    assert os.listdir(ro) == []
