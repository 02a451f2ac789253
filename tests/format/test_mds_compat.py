"""MDS written by mosaicml-streaming 0.13 reads in foundrymix, row for row, on streaming-community.

The suite runs on streaming-community only, while datasets users already have were written by
mosaicml-streaming 0.13 (by LLM-Foundry, by streaming's own tools, by foundrymix before it moved
to the fork). ``tests/data/mds13/`` holds such datasets, written by 0.13.0 itself
(``tests/data/mds13/README.md``: how), and ``values.json`` beside them, the values the writing
script put in. Each is read here as a user reads it, and every row must equal those values:

* ``foundry_tokens/``: LLM-Foundry 0.22's token layout (``tokens: ndarray:int32``, zstd, two
  shards), read in place by the loader and adopted;
* ``text/``: streaming's raw-text layout (``text: str``, sha1 and xxh3_64), read by adopt;
* ``foundrymix/``: ``foundrymix convert`` under 0.13 (zstd through 0.13's ``MDSWriter``, sha1
  and xxh3_64), verified intact and read by the loader with ``validate_hash``.
"""

from __future__ import annotations

import json
import os

import pytest
from convert_helpers import read_rows, spans, write_jsonl
from helpers import DEMO_TOKENIZER, ROOT

from foundrymix.convert.adopt import AdoptArgs, adopt
from foundrymix.convert.mds_input import read_shard, shard_bytes
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
from foundrymix.format.shards import read_index, shard_hash_checks
from foundrymix.loader.mixer import StreamMixer
from foundrymix.tools.verify import verify

FIXTURE = ROOT / 'tests' / 'data' / 'mds13'
VALUES = json.loads((FIXTURE / 'values.json').read_text(encoding='utf-8'))
EOS = 0  # the bundled tokenizer's <|endoftext|>, the Foundry rows' --eos_text


def listing(directory) -> dict[str, tuple[int, int]]:
    return {p: (os.stat(directory / p).st_size, os.stat(directory / p).st_mtime_ns) for p in sorted(os.listdir(directory))}


def documents(row: list[int]) -> list[int]:
    """A window's document pieces: a document ends after each EOS, the last piece at the window's end."""
    lens, start = [], 0
    for i, tok in enumerate(row):
        if tok == EOS:
            lens.append(i + 1 - start)
            start = i + 1
    return lens + ([len(row) - start] if start < len(row) else [])


def test_the_fixture_is_what_its_readme_says():
    assert VALUES['made_with']['mosaicml-streaming'].startswith('0.13.')
    tokens = read_index(str(FIXTURE / 'foundry_tokens' / 'index.json'))['shards']
    assert len(tokens) == 2 and {s['compression'] for s in tokens} == {'zstd'}
    assert {(tuple(s['column_names']), tuple(s['column_encodings'])) for s in tokens} == {(('tokens',), ('ndarray:int32',))}
    text = read_index(str(FIXTURE / 'text' / 'index.json'))['shards']
    assert len(text) == 2 and {s['compression'] for s in text} == {None}
    assert {tuple(s['hashes']) for s in text} == {('sha1', 'xxh3_64')}
    converted = read_index(str(FIXTURE / 'foundrymix' / 'index.json'))['shards']
    assert len(converted) == 2 and {s['compression'] for s in converted} == {'zstd'}


def test_foundry_tokens_read_in_place_are_the_rows_written():
    src = FIXTURE / 'foundry_tokens'
    rows = VALUES['foundry_tokens']['rows']
    before = listing(src)
    mixer = StreamMixer.from_dict({'streams': {'c4': {'local': str(src), 'tokenizer': DEMO_TOKENIZER}},
                                   'shuffle': False, 'num_workers': 0})
    [stream] = mixer.plan(2, '1ep').streams
    assert stream.rows == len(rows) and mixer.max_seq_len == VALUES['foundry_tokens']['max_length']
    store = mixer.build_store()
    try:
        assert len(store) == len(rows)
        for i, want in enumerate(rows):
            row = store.get_row(i)
            assert row['input_ids'].tolist() == want, i
            assert row['doc_lens'].tolist() == documents(want), i
            assert spans(row) == [(0, len(want))], i  # pretrain: loss on every token
    finally:
        store.release()
    assert listing(src) == before  # read in place: nothing written beside the user's shards


def test_foundry_tokens_adopted_are_the_rows_written(tmp_path):
    """adopt re-cuts the token stream at the same length with the same EOS separators, so its
    rows are Foundry's windows, each split into documents after every EOS."""
    rows = VALUES['foundry_tokens']['rows']
    [(split, manifest)] = adopt(AdoptArgs(source=str(FIXTURE / 'foundry_tokens'), out=str(tmp_path / 'out'),
                                          tokenizer=DEMO_TOKENIZER, common={'workers': 1, 'progress': False}))
    assert split.rows == manifest.counts.rows == len(rows)
    adopted = read_rows(tmp_path / 'out')
    assert [r['input_ids'].tolist() for r in adopted] == rows
    assert [r['doc_lens'].tolist() for r in adopted] == [documents(r) for r in rows]
    assert verify(str(tmp_path / 'out')).intact


def test_raw_text_hashes_rows_and_adopt_equal_what_was_written(tmp_path):
    src = str(FIXTURE / 'text')
    index = read_index(os.path.join(src, 'index.json'))
    texts = []
    for k in range(len(index['shards'])):
        checks = shard_hash_checks(index['shards'][k]['raw_data'], bytes(shard_bytes(src, k)[2]))
        assert [(c.algorithm, c.ok) for c in checks] == [('sha1', True), ('xxh3_64', True)], k
        texts += [row['text'] for row in read_shard(src, k)[1]]
    assert texts == VALUES['text']['texts']
    # adopt tokenizes them as convert pretrain tokenizes the same texts from JSON Lines
    adopt(AdoptArgs(source=src, out=str(tmp_path / 'adopted'), tokenizer=DEMO_TOKENIZER, max_seq_len=32,
                    common={'workers': 1, 'progress': False}))
    corpus = write_jsonl(tmp_path / 'texts.jsonl', [{'text': t} for t in VALUES['text']['texts']])
    convert_pretrain([str(corpus)], str(tmp_path / 'ref'),
                     PretrainOptions(tokenizer=DEMO_TOKENIZER, max_seq_len=32, workers=1, progress=False))
    got, want = read_rows(tmp_path / 'adopted'), read_rows(tmp_path / 'ref')
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        for col in ('input_ids', 'loss_spans', 'doc_lens'):
            assert g[col].tolist() == w[col].tolist(), col


@pytest.mark.parametrize('validate_hash', [None, 'sha1'])
def test_foundrymix_dataset_written_on_0_13_verifies_and_loads_the_rows_written(validate_hash):
    src = FIXTURE / 'foundrymix'
    rows = VALUES['foundrymix']['rows']
    before = listing(src)
    report = verify(str(src))
    assert report.intact and report.hashes_recorded, report.all_problems()
    assert report.found['rows'] == len(rows)
    mixer = StreamMixer.from_dict({'streams': {'a': {'local': str(src)}}, 'shuffle': False, 'num_workers': 0,
                                   'validate_hash': validate_hash})
    store = mixer.build_store()
    try:
        assert len(store) == len(rows)
        for i, want in enumerate(rows):
            row = store.get_row(i)
            assert row['input_ids'].tolist() == want['input_ids'], i
            assert row['loss_spans'].reshape(-1).tolist() == want['loss_spans'], i
            assert row['doc_lens'].tolist() == want['doc_lens'], i
    finally:
        store.release()
    assert listing(src) == before
