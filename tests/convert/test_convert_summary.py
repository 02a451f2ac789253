"""The conversion summary says in plain words what the table cannot: separators, the
pretrain tail, and a warning when many examples are dropped as too long."""

from __future__ import annotations

from convert_helpers import ids, write_jsonl
from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain

TOK = 'foundrymix-bpe-8k'


def notes(err: str) -> list[str]:
    """The summary lines printed after the table."""
    return err[err.rindex('┘') + 2:].splitlines()


def test_finetune_warns_when_many_dropped_as_too_long(capsys, tmp_path):
    short = {'prompt': 'Hi', 'response': ' there'}
    long = {'prompt': 'Tell me about the long history of cats and dogs', 'response': ' ' + 'meow ' * 12}
    src = write_jsonl(tmp_path / 'd.jsonl', [short] * 10 + [long] * 2)
    long_len = len(ids(TOK, long['prompt'])) + len(ids(TOK, long['response'])) + 1  # + EOS
    assert long_len > 16
    m = convert_finetune([str(src)], str(tmp_path / 'out'), FinetuneOptions(max_seq_len=16, workers=1,
                                                                            progress=True))
    assert m.dropped == {'too_long': 2}
    assert notes(capsys.readouterr().err) == [
        'separators: BOS inserted before each example: no (the tokenizer adds no BOS); '
        'EOS inserted after each example: yes (id 0).',
        'examples: 12 read, 10 written; 2 dropped (too_long).',
        'warning: 16.7 % of examples (2 of 12) were dropped as longer than --max-seq-len 16. To keep '
        f'them, raise --max-seq-len to {long_len} (fits 95 % of them): every token is kept, in longer '
        'rows; or pass --too-long truncate: only their first 16 tokens are kept and the rest are lost '
        '(counted as dropped: truncated_tokens).']


def test_finetune_no_warning_at_or_below_five_percent(capsys, tmp_path):
    src = write_jsonl(tmp_path / 'd.jsonl', [{'prompt': 'Hi', 'response': ' there'}] * 20 +
                      [{'prompt': 'x ' * 40, 'response': ' y'}])
    convert_finetune([str(src)], str(tmp_path / 'out'), FinetuneOptions(max_seq_len=16, workers=1,
                                                                        progress=True, bos=False, eos=True))
    assert notes(capsys.readouterr().err)[1:] == ['examples: 21 read, 20 written; 1 dropped (too_long).']


def test_pretrain_explains_the_unwritten_tail(capsys, tmp_path):
    docs = ['One cat.', 'Two dogs sat on the mat.', 'Three.', 'Four.']
    src = write_jsonl(tmp_path / 'd.jsonl', [{'text': t} for t in docs])
    lens = [len(ids(TOK, t)) + 1 for t in docs]
    L = lens[0] + lens[1] - 1  # row 1 ends one token before the end of document 2
    m = convert_pretrain([str(src)], str(tmp_path / 'out'), PretrainOptions(max_seq_len=L, workers=1,
                                                                            progress=True))
    tail = sum(lens) - L
    assert tail < L and m.counts.tail_tokens == tail
    assert notes(capsys.readouterr().err) == [
        'separators: BOS inserted before each document: no (the tokenizer adds no BOS); '
        'EOS inserted after each document: yes (id 0).',
        f'documents: 4 read, 2 written (wholly or in part). The last {tail} tokens, after the last full '
        f'row of {L}, are not written (rows are never padded): 2 document(s) lie wholly in them.']
