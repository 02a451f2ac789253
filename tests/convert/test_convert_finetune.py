"""convert finetune on the real Dolly/HH sample: loss masks cover exactly the responses."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from convert_helpers import ids, read_jsonl, read_rows, spans, write_jsonl
from foundrymix.convert.finetune import FinetuneOptions, Packer, convert_finetune
from foundrymix.tokenizer import load_tokenizer, tokenizer_info

L = 512


def expected_examples(tokenizer, records):
    """Reference ``(ids, loss_start)`` per record: [BOS] prompt response EOS, loss from response."""
    info = tokenizer_info(load_tokenizer(tokenizer))
    out = []
    for r in records:
        head = ([info.bos_id] if info.add_bos else []) + ids(tokenizer, r['prompt'])
        out.append((head + ids(tokenizer, r['response']) + [info.eos_id], len(head)))
    return out


def segments(rows):
    for row in rows:
        start = 0
        for n in row['doc_lens'].tolist():
            yield row, start, n
            start += n


def test_loss_masks_cover_exactly_the_responses(any_tokenizer, dolly_jsonl, tmp_path):
    records = read_jsonl(dolly_jsonl)
    tok = load_tokenizer(any_tokenizer)
    m = convert_finetune([str(dolly_jsonl)], str(tmp_path / 'out'),
                         FinetuneOptions(tokenizer=any_tokenizer, max_seq_len=L, workers=1))
    rows = read_rows(tmp_path / 'out')
    expected = expected_examples(any_tokenizer, records)
    by_ids = defaultdict(list)
    for i, (ex, loss_start) in enumerate(expected):
        by_ids[tuple(ex)].append((i, loss_start))
    seen, loss_tokens = [], 0
    for row, start, n in segments(rows):
        seg = row['input_ids'][start:start + n].tolist()
        i, loss_start = by_ids[tuple(seg)].pop(0)  # every segment is one whole example
        seen.append(i)
        row_spans = [(s - start, e - start) for s, e in spans(row) if start <= s < start + n]
        assert row_spans == [(loss_start, n)]
        assert tok.decode(seg[loss_start:]) == records[i]['response'] + tok.eos_token
        loss_tokens += n - loss_start
    too_long = [i for i, (ex, _) in enumerate(expected) if len(ex) > L]
    assert sorted(seen) == sorted(set(range(len(records))) - set(too_long))
    c = m.counts
    assert m.dropped == {'too_long': len(too_long)} and len(too_long) > 0
    assert c.documents_read == 1000 and c.documents_written == len(seen)
    assert c.loss_tokens == loss_tokens and c.rows == len(rows)
    assert c.rows * L == c.tokens + c.pad_tokens
    assert sum(int(r['doc_lens'].sum()) for r in rows) == c.tokens
    pad_id = tokenizer_info(tok).pad_id
    assert all((r['input_ids'][r['doc_lens'].sum():] == pad_id).all() for r in rows)
    # first-fit packing leaves under 5% of the row space as padding
    assert c.pad_tokens < 0.05 * c.rows * L


def test_packer_first_fit_with_window():
    p = Packer(10, window=2)
    ex = lambda n: (np.arange(n), np.zeros(0, np.int32))  # noqa: E731
    out = []
    for n in (6, 5, 4, 3, 7, 2, 1):
        out += [[len(e[0]) for e in r] for r in p.add(*ex(n))]
    out += [[len(e[0]) for e in r] for r in p.flush()]
    # 6; 5 opens a row; 4 fills (6,4) -> written; 3 joins (5); 7 opens a row; 2 joins
    # (5,3) -> full, written; 1 joins (7); flush writes (7,1)
    assert out == [[6, 4], [5, 3, 2], [7, 1]]


def test_window_overflow_writes_oldest_row():
    p = Packer(10, window=1)
    ex = lambda n: (np.arange(n), np.zeros(0, np.int32))  # noqa: E731
    assert p.add(*ex(6)) == []
    closed = p.add(*ex(7))  # opens a second row: window of 1 exceeded, the oldest goes
    assert [len(e[0]) for e in closed[0]] == [6]
    closed = p.add(*ex(4))  # fits nowhere (7+4 > 10): a new row, the row of 7 is written
    assert [len(e[0]) for e in closed[0]] == [7]
    assert [[len(e[0]) for e in r] for r in p.flush()] == [[4]]


def test_no_pack_truncate_and_loss_on_prompt(dolly_jsonl, tmp_path):
    records = read_jsonl(dolly_jsonl, 200)
    src = write_jsonl(tmp_path / 'in.jsonl', records)
    L2 = 128
    m = convert_finetune([str(src)], str(tmp_path / 'out'),
                         FinetuneOptions(max_seq_len=L2, workers=1, pack=False, too_long='truncate',
                                         loss_on_prompt=True))
    exp = expected_examples('foundrymix-bpe-8k', records)
    rows = read_rows(tmp_path / 'out')
    assert len(rows) == m.counts.rows == 200  # one example per row, none dropped
    assert m.dropped == {'truncated_tokens': sum(max(0, len(e) - L2) for e, _ in exp)}
    for row, (ex, _) in zip(rows, exp):
        n = min(len(ex), L2)
        assert row['doc_lens'].tolist() == [n]
        assert row['input_ids'][:n].tolist() == ex[:n]
        assert spans(row) == [(1, n)]  # the first token is never a target


def test_workers_give_identical_rows(dolly_jsonl, tmp_path):
    rows = []
    for w, mode in ((1, None), (2, 'threads'), (2, 'processes')):
        out = tmp_path / f'w{w}-{mode}'
        convert_finetune([str(dolly_jsonl)], str(out),
                         FinetuneOptions(max_seq_len=256, workers=w, parallel=mode, chunk_bytes=32 << 10))
        rows.append((read_rows(out), (out / 'index.json').read_bytes()))
    (r1, index1), *others = rows
    assert len(r1) > 0
    for r2, index2 in others:
        assert len(r1) == len(r2) and index1 == index2
        for a, b in zip(r1, r2):
            assert all(np.array_equal(a[k], b[k]) for k in ('input_ids', 'loss_spans', 'doc_lens'))


CHATS = [
    {'messages': [{'role': 'system', 'content': 'Be brief.'},
                  {'role': 'user', 'content': 'What is 2+2?'},
                  {'role': 'assistant', 'content': 'Four.'},
                  {'role': 'user', 'content': 'And 3+3?'},
                  {'role': 'assistant', 'content': 'Six.'}]},
    {'prompt': 'Say hi.', 'completion': 'Hi!'},
]


@pytest.mark.parametrize('chat_loss', ['all', 'last'])
def test_chat_template_turns(any_tokenizer, tmp_path, chat_loss):
    src = write_jsonl(tmp_path / 'chat.jsonl', CHATS)
    tok = load_tokenizer(any_tokenizer)
    convert_finetune([str(src)], str(tmp_path / 'out'),
                     FinetuneOptions(tokenizer=any_tokenizer, max_seq_len=256, workers=1, chat_loss=chat_loss,
                                     pack=False))
    chat_row, pr_row = read_rows(tmp_path / 'out')
    trained = [tok.decode(chat_row['input_ids'][s:e].tolist()) for s, e in spans(chat_row)]
    if tok.chat_template:  # bundled: ChatML; the turn's end marker is trained, not the header
        turns = ['Four.<|im_end|>\n', 'Six.<|im_end|>\n<|endoftext|>']
    else:  # plain template "role: content\n"
        turns = ['Four.\n', 'Six.\n' + tok.eos_token]
    assert trained == (turns if chat_loss == 'all' else turns[1:])
    assert [tok.decode(pr_row['input_ids'][s:e].tolist()) for s, e in spans(pr_row)] == ['Hi!' + tok.eos_token]


def reference_rows(tokenizer, records, max_seq_len, too_long):
    """The rows of ``convert finetune`` computed the plain way: HF Python tokenization per
    text, one list per example, first-fit packing over a window of 64 open rows."""
    info = tokenizer_info(load_tokenizer(tokenizer))
    open_rows, rows = [], []
    for r in records:
        prompt = ([info.bos_id] if info.add_bos else []) + ids(tokenizer, r['prompt'])
        ex = prompt + ids(tokenizer, r['response']) + [info.eos_id]
        ex_spans = [max(1, len(prompt)), len(ex)]
        if len(ex) > max_seq_len:
            if too_long == 'drop':
                continue
            ex, ex_spans = ex[:max_seq_len], [ex_spans[0], max_seq_len]
            if ex_spans[0] >= max_seq_len:
                continue  # no loss token left
        for row in open_rows:
            if sum(len(e) for e, _ in row) + len(ex) <= max_seq_len:
                row.append((ex, ex_spans))
                break
        else:
            open_rows.append([(ex, ex_spans)])
            row = open_rows[-1]
            if len(open_rows) > 64 and sum(len(e) for e, _ in row) < max_seq_len:
                rows.append(open_rows.pop(0))
        if sum(len(e) for e, _ in row) == max_seq_len:
            rows.append(row)
            open_rows.remove(row)
    out = []
    for row in rows + open_rows:
        tokens, row_spans, pos = [], [], 0
        for e, (s, t) in row:
            tokens += e
            row_spans += [pos + s, pos + t]
            pos += len(e)
        out.append((tokens + [info.pad_id] * (max_seq_len - pos), row_spans, [len(e) for e, _ in row]))
    return out


@pytest.mark.parametrize('too_long', ['drop', 'truncate'])
def test_rows_equal_plain_reference(any_tokenizer, dolly_jsonl, tmp_path, too_long):
    """Every row, bit for bit, equals the plain per-example computation (the converter
    assembles a chunk's examples in one array and packs views of it)."""
    records = read_jsonl(dolly_jsonl, 600)
    src = write_jsonl(tmp_path / 'in.jsonl', records)
    convert_finetune([str(src)], str(tmp_path / 'out'),
                     FinetuneOptions(tokenizer=any_tokenizer, max_seq_len=256, too_long=too_long,
                                     workers=2, chunk_bytes=64 << 10))
    rows = read_rows(tmp_path / 'out')
    expected = reference_rows(any_tokenizer, records, 256, too_long)
    assert len(rows) == len(expected) > 100
    for row, (tokens, row_spans, lens) in zip(rows, expected):
        assert row['input_ids'].tolist() == tokens
        assert row['loss_spans'].tolist() == row_spans
        assert row['doc_lens'].tolist() == lens


def test_default_parallel_mode_follows_the_records(dolly_jsonl, tmp_path):
    """Threads for prompt/response examples (Rust work), processes for chats and
    --preprocess (Python work that holds the GIL); --parallel wins."""
    from foundrymix.convert.common import prepare
    from foundrymix.convert.finetune import FINETUNE
    chats = write_jsonl(tmp_path / 'chats.jsonl', CHATS[:1] * 20)
    cases = [(dolly_jsonl, {}, 'threads'), (chats, {}, 'processes'),
             (chats, {'prompt_template': '{messages[0].content}', 'response_template': 'ok'}, 'threads'),
             (dolly_jsonl, {'preprocess': 'json:loads'}, 'processes'),
             (chats, {'parallel': 'threads'}, 'threads')]
    for src, kw, mode in cases:
        o = FinetuneOptions(**kw)
        assert FINETUNE.parallel_mode(prepare([str(src)], str(tmp_path / 'o'), o, 2), o) == mode, (src, kw)


def test_progress_bar_counts_records_read_and_shows_written_and_dropped(dolly_jsonl, tmp_path, capsys):
    """The bar ends at the records read (it counted kept examples: '688 docs' of 1,000)."""
    import re

    records = read_jsonl(dolly_jsonl)[:200]
    src = write_jsonl(tmp_path / 'in.jsonl', records)
    L2 = 128
    too_long = sum(len(ex) > L2 for ex, _ in expected_examples('foundrymix-bpe-8k', records))
    assert 0 < too_long < len(records)
    convert_finetune([str(src)], str(tmp_path / 'out'), FinetuneOptions(max_seq_len=L2, workers=1, progress=True))
    final = capsys.readouterr().err.split('\r')[-1]
    shown = re.search(r'(\d[\d,]*) docs.*?(\d[\d,]*) written, (\d[\d,]*) dropped', final)
    assert shown, final
    assert [int(x.replace(',', '')) for x in shown.groups()] == [200, 200 - too_long, too_long]
