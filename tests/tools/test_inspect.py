"""foundrymix inspect: manifest table, --json, and --decode with no-loss spans marked."""

from __future__ import annotations

import json

from convert_helpers import read_jsonl, write_jsonl
from foundrymix.cli import main
from foundrymix.convert.finetune import FinetuneOptions, convert_finetune


def test_inspect_table_json_and_decode(capsys, dolly_jsonl, tmp_path):
    records = read_jsonl(dolly_jsonl, 3)
    src = write_jsonl(tmp_path / 'in.jsonl', records)
    out = tmp_path / 'out'
    m = convert_finetune([str(src)], str(out), FinetuneOptions(max_seq_len=1024, workers=1))
    assert main(['inspect', str(out), '--json']) == 0
    assert json.loads(capsys.readouterr().out) == m.to_dict()
    assert main(['inspect', str(out), '--decode', '1']) == 0
    text = capsys.readouterr().out
    assert 'finetune' in text and f'{m.counts.loss_tokens:,}' in text
    first_seg = text.split('--- row 0, segment 0 ---\n')[1].split('\n--- ')[0]
    assert first_seg == f"⟦{records[0]['prompt']}⟧{records[0]['response']}<|endoftext|>"
    assert main(['inspect', str(tmp_path)]) == 2
    assert 'no foundrymix manifest' in capsys.readouterr().err
