"""foundrymix inspect: manifest table, --json, and --decode with no-loss spans marked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from convert_helpers import read_jsonl, write_jsonl
from helpers import ROOT
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


@pytest.mark.parametrize('flags,code', [(['--json'], 141), (['--decode', '2'], 1)], ids=['json', 'table'])
def test_output_cut_short_by_its_reader_ends_without_a_traceback(small_streams, flags, code):
    """``foundrymix inspect DIR | head``, the reader gone before inspect writes (so every
    write fails, whatever the timing): nothing on stderr, and the exit a shell's SIGPIPE
    gives (141) -- or rich's own (1) when its table is what met the closed pipe."""
    read, write = os.pipe()
    os.close(read)  # the reader has left
    try:
        proc = subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'inspect',
                               str(small_streams['arxiv']), *flags], stdout=write, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, 'PYTHONPATH': str(ROOT)}, timeout=120)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (code, '')
