"""Huge documents: sliced tokenization gives the whole-text tokens, and a 50 MB single-line
document converts in bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from convert_helpers import ids, read_jsonl, read_rows
from foundrymix.convert.mapping import encode_long, encode_texts, slice_mode
from foundrymix.tokenizer import DEMO_TOKENIZER, load_tokenizer, tokenizer_info


def test_sliced_tokens_equal_whole_text_tokens(any_tokenizer, arxiv_jsonl):
    """Cut every ~20k characters (about 60 cuts) of the whole arXiv sample joined as one text
    (1.2 MB: LaTeX, numbers, newlines, runs of spaces): the same ids as one encode call
    through the HF Python API."""
    tok = load_tokenizer(any_tokenizer)
    # SentencePiece puts its dummy prefix in front of every text: a slice after a cut starts
    # without the space, which the prefix stands for
    assert slice_mode(tok) == ('keep_space' if any_tokenizer == DEMO_TOKENIZER else 'drop_space')
    text = ' '.join(r['text'] for r in read_jsonl(arxiv_jsonl))
    got = encode_long(tok, text, slice_chars=20_000)
    assert got.dtype == np.uint32 and got.tolist() == ids(any_tokenizer, text)
    # encode_texts slices only the long ones; short ones stay lists, order kept
    mixed = encode_texts(tok, ['short one', text, 'another'], slice_chars=20_000)
    assert mixed[0] == ids(any_tokenizer, 'short one') and mixed[2] == ids(any_tokenizer, 'another')
    assert np.array_equal(mixed[1], got)


PEAK_LIMIT = 2 << 30
_MEASURE = '''
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:]).returncode
print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
'''


@pytest.mark.slow
def test_huge_single_line_document_in_bounded_memory(arxiv_jsonl, tmp_path):
    """A 50 MB document on one line: peak RSS of the whole conversion under 2 GB (it was
    5.7 GB), tokens equal to the reference.

    Reference: the document is the arXiv texts (stripped) cycled and joined by single
    spaces, so its whole-text tokens are ``ids(u0) + ids(' ' + u1) + ...`` -- exactly the
    slicing property checked against real whole-text tokenization above, here at the
    unit boundaries, while the converter cuts at its own 1 MB points inside the units.
    """
    units = [r['text'].strip() for r in read_jsonl(arxiv_jsonl)]
    parts, size, order = [], 0, []
    while size < 50 << 20:
        i = len(order) % len(units)
        order.append(i)
        parts.append(units[i])
        size += len(units[i]) + 1
    doc = ' '.join(parts)
    src = tmp_path / 'huge.jsonl'
    src.write_text(json.dumps({'text': doc}) + '\n', encoding='utf-8')
    del doc, parts
    out = tmp_path / 'out'
    L = 2048
    cmd = [sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(src), '-o', str(out),
           '--max-seq-len', str(L), '--workers', '1', '--no-progress']
    proc = subprocess.run([sys.executable, '-c', _MEASURE, *cmd], capture_output=True, text=True)
    rc, peak = map(int, proc.stdout.split())
    assert rc == 0, proc.stderr
    print(f'peak RSS of the conversion: {peak / 2**30:.2f} GB')
    assert peak < PEAK_LIMIT, f'peak RSS {peak / 2**30:.2f} GB'

    tok = 'foundrymix-bpe-8k'
    first = [np.asarray(ids(tok, u), dtype=np.int64) for u in units]
    spaced = [np.asarray(ids(tok, ' ' + u), dtype=np.int64) for u in units]
    eos = tokenizer_info(load_tokenizer(tok)).eos_id
    want = np.concatenate([first[order[0]]] + [spaced[i] for i in order[1:]] + [np.asarray([eos])])
    got = np.concatenate([r['input_ids'] for r in read_rows(out)]).astype(np.int64)
    n = len(want) // L * L
    assert len(got) == n and np.array_equal(got, want[:n])


@pytest.mark.parametrize('too_long', ['drop', 'truncate'])
def test_finetune_huge_response_is_sliced_then_dropped_or_truncated(arxiv_jsonl, tmp_path, too_long):
    """A 1.5 MB response (over the slicing threshold) goes through the sliced path and is
    dropped, or truncated to exactly the whole-text tokens' first row."""
    from convert_helpers import spans, write_jsonl
    from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
    response = ' '.join(r['text'].strip() for r in read_jsonl(arxiv_jsonl))[:1_500_000]
    src = write_jsonl(tmp_path / 'ft.jsonl', [{'prompt': 'Summarise:', 'response': response},
                                               {'prompt': 'Hi', 'response': 'Hello!'}])
    L = 256
    m = convert_finetune([str(src)], str(tmp_path / 'out'),
                         FinetuneOptions(max_seq_len=L, workers=1, too_long=too_long, pack=False))
    rows = read_rows(tmp_path / 'out')
    if too_long == 'drop':
        assert m.dropped == {'too_long': 1} and len(rows) == 1
        return
    tok = 'foundrymix-bpe-8k'
    prompt = ids(tok, 'Summarise:')
    want = (prompt + ids(tok, response))[:L]
    assert len(rows) == 2 and rows[0]['input_ids'].tolist() == want
    assert spans(rows[0]) == [(len(prompt), L)]
    assert m.dropped['truncated_tokens'] == len(prompt) + len(ids(tok, response)) + 1 - L
