"""Field mapping at conversion: --prompt/--response/--text templates and --preprocess.

Real-shaped records (LAMBADA, HellaSwag, PIQA, nested metadata) are converted through the
CLI and the rows decoded with the bundled tokenizer; errors are compared exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from convert_helpers import read_rows, spans, write_jsonl
from foundrymix.cli import main
from foundrymix.convert.mapping import Template, TemplateError
from foundrymix.format.schema import Manifest
from foundrymix.tokenizer import load_tokenizer

TOK = load_tokenizer('foundrymix-bpe-8k')


def convert(capsys, kind, src, out, *extra) -> tuple[int, str]:
    pack = ['--no-pack'] if kind == 'finetune' else []
    rc = main(['convert', kind, str(src), '-o', str(out), '--no-progress', '--workers', '1',
               '--max-seq-len', '64', *pack, *extra])
    return rc, capsys.readouterr().err


def examples(out) -> list[tuple[str, str]]:
    """(whole example, loss part) of each row, decoded."""
    result = []
    for row in read_rows(out):
        n = int(row['doc_lens'].sum())
        ids = row['input_ids'][:n].tolist()
        (s, e), = spans(row)
        result.append((TOK.decode(ids), TOK.decode(ids[s:e])))
    return result


EOS = TOK.eos_token


def test_lambada_context_continuation(capsys, tmp_path):
    src = write_jsonl(tmp_path / 'lambada.jsonl', [
        {'context': 'He opened the door and saw the', 'continuation': 'garden'},
        {'context': 'She poured the tea into a', 'continuation': 'cup'}])
    rc, err = convert(capsys, 'finetune', src, tmp_path / 'out', '--prompt', '{context}', '--response',
                      ' {continuation}')
    assert rc == 0, err
    assert examples(tmp_path / 'out') == [
        (f'He opened the door and saw the garden{EOS}', f' garden{EOS}'),
        (f'She poured the tea into a cup{EOS}', f' cup{EOS}')]
    m = Manifest.read(str(tmp_path / 'out'))
    assert (m.options['prompt_template'], m.options['response_template'], m.options['preprocess']) == \
        ('{context}', ' {continuation}', None)


def test_hellaswag_choice_by_other_field_and_nested(capsys, tmp_path):
    src = write_jsonl(tmp_path / 'hs.jsonl', [
        {'ctx': 'A man is', 'endings': ['running.', 'sleeping.'], 'label': 1, 'meta': {'src': 'wiki'}},
        {'ctx': 'A dog is', 'endings': ['barking.', 'flying.'], 'label': '0', 'meta': {'src': 'act'}}])
    rc, err = convert(capsys, 'finetune', src, tmp_path / 'out', '--prompt', '[{meta.src}] {ctx}',
                      '--response', ' {endings[label]} / {endings[-1]}')
    assert rc == 0, err
    assert examples(tmp_path / 'out') == [
        (f'[wiki] A man is sleeping. / sleeping.{EOS}', f' sleeping. / sleeping.{EOS}'),
        (f'[act] A dog is barking. / flying.{EOS}', f' barking. / flying.{EOS}')]


PIQA_PREP = '''
def piqa(rec):
    if rec["label"] < 0:
        return None
    return {"prompt": rec["goal"], "response": " " + rec["sol" + str(rec["label"] + 1)]}
'''


def test_piqa_preprocess_in_forked_workers(capsys, tmp_path, monkeypatch):
    (tmp_path / 'piqa_prep.py').write_text(PIQA_PREP)
    monkeypatch.chdir(tmp_path)
    src = write_jsonl(tmp_path / 'piqa.jsonl', [
        {'goal': 'Dry wet shoes', 'sol1': 'in an oven.', 'sol2': 'with newspaper.', 'label': 1},
        {'goal': 'Unlabelled', 'sol1': 'a', 'sol2': 'b', 'label': -1},
        {'goal': 'Open a jar', 'sol1': 'tap the lid.', 'sol2': 'freeze it.', 'label': 0}])
    rc = main(['convert', 'finetune', str(src), '-o', str(tmp_path / 'out'), '--no-progress', '--workers', '2',
               '--parallel', 'processes', '--max-seq-len', '64', '--no-pack', '--preprocess', 'piqa_prep:piqa'])
    assert rc == 0, capsys.readouterr().err
    assert examples(tmp_path / 'out') == [
        (f'Dry wet shoes with newspaper.{EOS}', f' with newspaper.{EOS}'),
        (f'Open a jar tap the lid.{EOS}', f' tap the lid.{EOS}')]
    m = Manifest.read(str(tmp_path / 'out'))
    assert m.dropped == {'preprocess_skipped': 1} and m.options['preprocess'] == 'piqa_prep:piqa'
    assert (m.counts.documents_read, m.counts.documents_written) == (3, 2)


def test_pretrain_text_template_with_escapes(capsys, tmp_path):
    src = write_jsonl(tmp_path / 'docs.jsonl', [{'title': 'Cats', 'body': 'Cats purr.'}])
    rc, err = convert(capsys, 'pretrain', src, tmp_path / 'out', '--text', r'{title}\n\n{body}',
                      '--max-seq-len', '4')
    assert rc == 0, err
    row_ids = np.concatenate([r['input_ids'] for r in read_rows(tmp_path / 'out')]).tolist()
    m = Manifest.read(str(tmp_path / 'out'))
    expected = TOK('Cats\n\nCats purr.', add_special_tokens=False)['input_ids'] + [TOK.eos_token_id]
    assert row_ids == expected[:len(row_ids)] and len(row_ids) + m.counts.tail_tokens == len(expected)
    assert m.options['text_template'] == '{title}\n\n{body}'


ERRORS = [
    ({'ctx': 'x', 'cont': 'y'}, ['--response', ' {continuation}'],
     ":1: --response ' {continuation}': field 'continuation': 'continuation' missing (has: cont, ctx)"),
    ({'ctx': 'x', 'endings': ['a']}, ['--response', '{endings[label]}'],
     ":1: --response '{endings[label]}': field 'endings[label]': index field 'label' missing "
     "(has: ctx, endings)"),
    ({'ctx': 'x', 'endings': ['a'], 'label': 3}, ['--response', '{endings[label]}'],
     ":1: --response '{endings[label]}': field 'endings[label]': index 3 out of range (endings has 1 items)"),
    ({'ctx': 'x', 'meta': {'a': 'b'}}, ['--response', '{meta.src}'],
     ":1: --response '{meta.src}': field 'meta.src': key 'src' of meta missing (has: a)"),
    ({'ctx': 'x', 'meta': {'a': ['b']}}, ['--response', '{meta.a}'],
     ":1: --response '{meta.a}': field 'meta.a': expected a string or number, got list"),
]


@pytest.mark.parametrize('record,args,message', ERRORS)
def test_template_errors_name_file_line_field(capsys, tmp_path, record, args, message):
    src = write_jsonl(tmp_path / 'd.jsonl', [record])
    rc, err = convert(capsys, 'finetune', src, tmp_path / 'out', '--prompt', '{ctx}', *args)
    assert rc == 2 and f'{src}{message}\n' in err, err


def test_missing_plain_field_lists_fields(capsys, tmp_path):
    src = write_jsonl(tmp_path / 'd.jsonl', [{'body': 'x', 'id': 1}])
    rc, err = convert(capsys, 'pretrain', src, tmp_path / 'out')
    assert rc == 2 and f"{src}:1: field 'text': missing (has: body, id)\n" in err, err


@pytest.mark.parametrize('source,message', [
    ('{x.upper()}', "--prompt '{x.upper()}': bad field {x.upper()}: use name, name.key, name[0] "
                      "or name[other_field]"),
    ('{x!r}', "--prompt '{x!r}': format specs and conversions are not supported ({x!r})"),
    ('{}', "--prompt '{}': empty field {}: name a field"),
    ('{a', "--prompt '{a': expected '}' before end of string"),
])
def test_bad_templates_refused_up_front(source, message):
    with pytest.raises(TemplateError) as e:
        Template.parse(source, '--prompt')
    assert str(e.value) == message


def test_preprocess_errors_name_the_function(capsys, tmp_path, monkeypatch):
    (tmp_path / 'prep.py').write_text('def bad(rec):\n    return rec["nope"]\n'
                                      'def lst(rec):\n    return [1]\n')
    monkeypatch.chdir(tmp_path)
    src = write_jsonl(tmp_path / 'd.jsonl', [{'text': 'x'}])
    rc, err = convert(capsys, 'pretrain', src, tmp_path / 'o1', '--preprocess', 'prep:bad')
    assert rc == 2 and f"{src}:1: --preprocess prep:bad: KeyError: 'nope'\n" in err, err
    rc, err = convert(capsys, 'pretrain', src, tmp_path / 'o2', '--preprocess', 'prep:lst')
    assert rc == 2 and f'{src}:1: --preprocess prep:lst: returned list, expected a dict or None\n' in err
    rc, err = convert(capsys, 'pretrain', src, tmp_path / 'o3', '--preprocess', 'prep:missing')
    assert rc == 2 and "--preprocess 'prep:missing': module 'prep' has no function 'missing'" in err
    rc, err = convert(capsys, 'pretrain', src, tmp_path / 'o4', '--preprocess', 'nomodule_xyz:f')
    assert rc == 2 and "--preprocess 'nomodule_xyz:f': cannot import module 'nomodule_xyz'" in err
