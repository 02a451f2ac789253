"""Bad input: each case stops with an error naming file, line and field, or is skipped and counted."""

from __future__ import annotations

import os

import pytest

from convert_helpers import read_rows, write_jsonl
from foundrymix.cli import main
from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain


def run(capsys, *argv) -> tuple[int, str]:
    rc = main(['convert', *argv, '--no-progress', '--workers', '1', '--max-seq-len', '64'])
    return rc, capsys.readouterr().err


GOOD = '{"text": "A perfectly fine document about cats."}\n'
BAD_LINES = [
    ('{"text": "unterminated\n', 'malformed_json', ':2: malformed JSON'),
    ('{"body": "no text field"}\n', 'missing_field', ":2: field 'text': missing"),
    ('{"text": 17}\n', 'not_string', ":2: field 'text': expected a string, got int"),
    ('{"text": ""}\n', 'empty_document', ":2: field 'text': empty document"),
]


@pytest.mark.parametrize('bad,reason,message', BAD_LINES, ids=[b[1] for b in BAD_LINES])
def test_bad_record_stops_or_is_skipped(capsys, tmp_path, bad, reason, message):
    src = tmp_path / 'data.jsonl'
    src.write_text(GOOD + bad + GOOD, encoding='utf-8')
    rc, err = run(capsys, 'pretrain', str(src), '-o', str(tmp_path / 'out'))
    assert rc == 2 and f'{src}{message}' in err and err.startswith('foundrymix convert: error: ')
    assert not (tmp_path / 'out').exists()
    m = convert_pretrain([str(src)], str(tmp_path / 'out'),
                         PretrainOptions(max_seq_len=8, workers=1, on_error='skip'))
    assert m.skipped == {reason: 1} and m.counts.documents_read == 3 and m.counts.documents_written == 2


def test_invalid_utf8(capsys, tmp_path):
    src = tmp_path / 'data.jsonl'
    src.write_bytes(GOOD.encode() * 2 + b'{"text": "caf\xe9"}\n')
    rc, err = run(capsys, 'pretrain', str(src), '-o', str(tmp_path / 'out'))
    assert rc == 2 and f'{src}:3: invalid UTF-8' in err
    m = convert_pretrain([str(src)], str(tmp_path / 'o2'), PretrainOptions(max_seq_len=8, workers=1,
                                                                             on_error='skip'))
    assert m.skipped == {'invalid_utf8': 1}


@pytest.mark.parametrize('parallel', ['threads', 'processes'])
def test_line_numbers_across_chunks(tmp_path, parallel):
    src = tmp_path / 'data.jsonl'
    src.write_text(GOOD * 500 + '{"text": null}\n' + GOOD * 500, encoding='utf-8')
    with pytest.raises(ValueError, match=rf"{src}:501: field 'text': expected a string, got null"):
        convert_pretrain([str(src)], str(tmp_path / 'o'), PretrainOptions(max_seq_len=64, workers=2,
                                                                            chunk_bytes=1000,
                                                                            parallel=parallel))
    assert not (tmp_path / 'o').exists()
    m = convert_pretrain([str(src)], str(tmp_path / 'o'),
                         PretrainOptions(max_seq_len=64, workers=2, chunk_bytes=1000, parallel=parallel,
                                         on_error='skip'))
    assert m.skipped == {'not_string': 1} and m.counts.documents_read == 1001


def test_finetune_bad_fields(capsys, tmp_path):
    src = write_jsonl(tmp_path / 'ft.jsonl', [{'prompt': 'Hi', 'response': 'Hello'}, {'prompt': 'Hi'},
                                              {'prompt': 3, 'response': 'x'}])
    rc, err = run(capsys, 'finetune', str(src), '-o', str(tmp_path / 'out'))
    assert rc == 2 and f"{src}:2: field 'response': missing" in err
    m = convert_finetune([str(src)], str(tmp_path / 'out'), FinetuneOptions(max_seq_len=64, workers=1,
                                                                             on_error='skip'))
    assert m.skipped == {'missing_field': 1, 'not_string': 1} and m.counts.documents_written == 1
    assert len(read_rows(tmp_path / 'out')) == 1


def test_empty_input_set(capsys, tmp_path):
    (tmp_path / 'empty').mkdir()
    rc, err = run(capsys, 'pretrain', str(tmp_path / 'empty'), '-o', str(tmp_path / 'out'))
    assert rc == 2 and 'no supported input files' in err
    (tmp_path / 'blank.jsonl').write_text('\n\n')
    rc, err = run(capsys, 'pretrain', str(tmp_path / 'blank.jsonl'), '-o', str(tmp_path / 'out'))
    assert rc == 2 and 'no documents found' in err and not (tmp_path / 'out').exists()


def test_nonexistent_path_and_glob(capsys, tmp_path):
    rc, err = run(capsys, 'pretrain', str(tmp_path / 'nope.jsonl'), '-o', str(tmp_path / 'out'))
    assert rc == 2 and f'{tmp_path / "nope.jsonl"}: no such file or directory' in err
    rc, err = run(capsys, 'pretrain', str(tmp_path / '*.jsonl'), '-o', str(tmp_path / 'out'))
    assert rc == 2 and 'no file matches this pattern' in err


def test_unknown_tokenizer(capsys, arxiv_jsonl, tmp_path):
    rc, err = run(capsys, 'pretrain', str(arxiv_jsonl), '-o', str(tmp_path / 'out'), '--tokenizer', 'no-such-tok')
    assert rc == 2 and "unknown tokenizer 'no-such-tok'" in err


def test_output_not_empty_needs_overwrite(capsys, tmp_path):
    src = tmp_path / 'data.jsonl'
    src.write_text(GOOD * 20)
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'keep.txt').write_text('x')
    # a folder of the user's: refused with and without --overwrite (which replaces only datasets)
    for extra in ([], ['--overwrite']):
        rc, err = run(capsys, 'pretrain', str(src), '-o', str(out), *extra)
        assert rc == 2 and f'{out} holds files foundrymix did not write (keep.txt)' in err, err
        assert (out / 'keep.txt').read_text() == 'x'
    os.remove(out / 'keep.txt')
    assert run(capsys, 'pretrain', str(src), '-o', str(out))[0] == 0
    # a foundrymix dataset: refused without --overwrite, replaced with it
    rc, err = run(capsys, 'pretrain', str(src), '-o', str(out))
    assert rc == 2 and 'not empty; pass --overwrite' in err
    rc, _ = run(capsys, 'pretrain', str(src), '-o', str(out), '--overwrite')
    assert rc == 0 and sorted(os.listdir(out)) == ['foundrymix.json', 'index.json', 'shard.00000.mds']


def test_max_seq_len_too_small_for_special_tokens(spm_tokenizer, tmp_path):
    src = tmp_path / 'data.jsonl'
    src.write_text(GOOD)
    with pytest.raises(ValueError, match='--max-seq-len 2 is too small: each sequence needs 2 special'):
        convert_pretrain([str(src)], str(tmp_path / 'o'), PretrainOptions(tokenizer=spm_tokenizer, max_seq_len=2))
    with pytest.raises(ValueError, match='--max-seq-len 3 is too small'):
        convert_finetune([str(src)], str(tmp_path / 'o'), FinetuneOptions(tokenizer=spm_tokenizer, max_seq_len=3))
