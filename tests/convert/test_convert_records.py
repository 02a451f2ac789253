"""Shard hashes streaming can validate, chat roles checked against the template, and where
skipped records were (manifest and summary)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import xxhash

from convert_helpers import read_rows, write_jsonl
from foundrymix.cli import main
from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
from foundrymix.format.schema import Manifest

L = 128


def _index_hashes(out) -> list[tuple[str, dict[str, str]]]:
    index = json.loads((out / 'index.json').read_text())
    return [(s['raw_data']['basename'], s['raw_data']['hashes']) for s in index['shards']]


def test_supported_hashes_are_streamings():
    from streaming.base.hashing import get_hashes

    from foundrymix.convert.writer import supported_hashes
    assert supported_hashes() == get_hashes()


def test_index_holds_hashes_of_the_shard_bytes(arxiv_jsonl, tmp_path):
    import hashlib
    out = tmp_path / 'out'
    m = convert_pretrain([str(arxiv_jsonl)], str(out),
                         PretrainOptions(max_seq_len=L, workers=1, size_limit='256kb', hash=('sha1',)))
    assert m.options['hashes'] == ['sha1', 'xxh3_64']
    shards = _index_hashes(out)
    assert len(shards) > 3
    for name, hashes in shards:
        data = (out / name).read_bytes()
        assert hashes == {'xxh3_64': xxhash.xxh3_64(data).hexdigest(), 'sha1': hashlib.sha1(data).hexdigest()}


@pytest.mark.parametrize('algo', ['xxh3_64', 'sha1'])
def test_streaming_validates_downloaded_shards(arxiv_jsonl, tmp_path, algo):
    """streaming checks hashes when it copies a shard from ``remote`` into its cache: the
    converter's output passes, a shard with one flipped byte is refused."""
    from streaming import StreamingDataset
    out = tmp_path / 'remote'
    convert_pretrain([str(arxiv_jsonl)], str(out),
                     PretrainOptions(max_seq_len=L, workers=1, size_limit='256kb', hash=('sha1',)))
    ds = StreamingDataset(remote=str(out), local=str(tmp_path / f'cache-{algo}'), validate_hash=algo,
                          shuffle=False, batch_size=1)
    want = read_rows(out)
    assert len(ds) == len(want)
    for i in range(len(ds)):
        assert np.array_equal(ds[i]['input_ids'], want[i]['input_ids'])
    bad = tmp_path / 'bad'
    shutil.copytree(out, bad)
    name = _index_hashes(bad)[0][0]
    data = bytearray((bad / name).read_bytes())
    data[-1] ^= 1
    (bad / name).write_bytes(bytes(data))
    ds = StreamingDataset(remote=str(bad), local=str(tmp_path / f'cache-bad-{algo}'), validate_hash=algo,
                          shuffle=False, batch_size=1)
    with pytest.raises(ValueError, match='Checksum failure'):
        ds[0]


def test_unknown_hash_is_refused(capsys, arxiv_jsonl, tmp_path):
    rc = main(['convert', 'pretrain', str(arxiv_jsonl), '-o', str(tmp_path / 'o'), '--hash', 'crc99',
               '--no-progress'])
    err = capsys.readouterr().err
    assert rc == 2 and "--hash 'crc99' is not a hash streaming supports" in err and 'sha1' in err
    assert not (tmp_path / 'o').exists()
    rc = main(['convert', 'pretrain', str(arxiv_jsonl), '-o', str(tmp_path / 'o'), '--hash', 'md5',
               '--hash', 'sha256', '--no-progress', '--max-seq-len', str(L)])
    assert rc == 0 and set(_index_hashes(tmp_path / 'o')[0][1]) == {'xxh3_64', 'md5', 'sha256'}


CHAT_OK = {'messages': [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'},
                        {'role': 'assistant', 'content': 'Hello!'}]}


def _chat(role: str) -> dict:
    return {'messages': [{'role': role, 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello!'}]}


def test_unknown_chat_roles(capsys, tmp_path):
    """The bundled tokenizer's ChatML template: system, user, assistant (no tool)."""
    src = write_jsonl(tmp_path / 'chat.jsonl', [CHAT_OK, _chat('wizard'), CHAT_OK, _chat('USER'),
                                                 _chat('tool')])
    rc = main(['convert', 'finetune', str(src), '-o', str(tmp_path / 'out'), '--no-progress',
               '--workers', '1', '--max-seq-len', '64'])
    err = capsys.readouterr().err
    assert rc == 2 and (f"{src}:2: field 'messages': unknown role 'wizard' "
                        f"(allowed: system, user, assistant)") in err
    m = convert_finetune([str(src)], str(tmp_path / 'out'),
                         FinetuneOptions(max_seq_len=64, workers=1, on_error='skip'))
    assert m.skipped == {'unknown_role': 3} and m.counts.documents_written == 2
    assert m.skipped_at == {'unknown_role': [f'{src}:2', f'{src}:4', f'{src}:5']}


ASSISTANT_FIRST = {'messages': [{'role': 'assistant', 'content': 'How can I help?'},
                                 {'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello!'}]}


@pytest.mark.parametrize('tokenizer', ['bundled', 'spm'])
def test_a_chat_that_starts_with_the_assistant_is_a_bad_record(capsys, tmp_path, spm_tokenizer, tokenizer):
    """Through forked workers (chats' default): one line naming file and line, exit 2, no
    output; with ``--on-error skip`` counted and located like any bad record, the other chats
    written (the chat template's tokenizer and the plain template alike)."""
    src = write_jsonl(tmp_path / 'chat.jsonl', [CHAT_OK, CHAT_OK, ASSISTANT_FIRST, CHAT_OK])
    tok = [] if tokenizer == 'bundled' else ['--tokenizer', spm_tokenizer]
    argv = ['convert', 'finetune', str(src), '--no-progress', '--workers', '2', '--max-seq-len', '64', *tok]
    rc = main([*argv, '-o', str(tmp_path / 'out')])
    err = capsys.readouterr().err
    assert rc == 2 and err.splitlines() == [
        f"foundrymix convert: error: {src}:3: field 'messages[0]': the chat starts with an assistant "
        f"message; a chat starts with a system or user message (the prompt its first reply answers)"]
    assert not (tmp_path / 'out').exists()
    assert main([*argv, '-o', str(tmp_path / 'skip'), '--on-error', 'skip']) == 0
    m = Manifest.read(str(tmp_path / "skip"))
    assert m.skipped == {'assistant_first': 1} and m.skipped_at == {'assistant_first': [f'{src}:3']}
    assert (m.counts.documents_read, m.counts.documents_written) == (4, 3)


def test_a_chat_the_template_refuses_is_a_bad_record(capsys, tmp_path):
    """A template's own ``raise_exception`` (Llama-2 style: roles must alternate) is the record's
    one line with the template's words, or ``template_error`` skipped with ``--on-error skip``
    (was: jinja2's TemplateError traceback)."""
    from foundrymix.tokenizer import load_tokenizer
    tok_dir = tmp_path / 'alternating'
    load_tokenizer('foundrymix-bpe-8k').save_pretrained(tok_dir)
    guard = ("{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
             "{{ raise_exception('Conversation roles must alternate') }}{% endif %}{% endfor %}")
    template = tok_dir / 'chat_template.jinja'
    template.write_text(guard + template.read_text())
    twice = {'messages': [{'role': 'user', 'content': 'Hi'}, {'role': 'user', 'content': 'Hi?'},
                          {'role': 'assistant', 'content': 'Hello!'}]}
    src = write_jsonl(tmp_path / 'chat.jsonl', [CHAT_OK, twice, CHAT_OK])
    argv = ['convert', 'finetune', str(src), '--no-progress', '--workers', '1', '--max-seq-len', '64',
            '--tokenizer', str(tok_dir)]
    assert main([*argv, '-o', str(tmp_path / 'out')]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"foundrymix convert: error: {src}:2: field 'messages': the tokenizer's chat template refused this "
        f"chat: Conversation roles must alternate"]
    assert main([*argv, '-o', str(tmp_path / 'skip'), '--on-error', 'skip']) == 0
    m = Manifest.read(str(tmp_path / 'skip'))
    assert m.skipped == {'template_error': 1} and m.skipped_at == {'template_error': [f'{src}:2']}
    assert m.counts.documents_written == 2


def test_plain_template_allows_tool_role(spm_tokenizer, tmp_path):
    """SentencePiece has no chat template: the plain one renders any role, tool included."""
    src = write_jsonl(tmp_path / 'chat.jsonl', [CHAT_OK, _chat('tool'), _chat('Assistant')])
    m = convert_finetune([str(src)], str(tmp_path / 'out'),
                         FinetuneOptions(tokenizer=spm_tokenizer, max_seq_len=64, workers=1, on_error='skip'))
    assert m.skipped == {'unknown_role': 1} and m.counts.documents_written == 2
    assert m.skipped_at == {'unknown_role': [f'{src}:3']}


GOOD = '{"text": "A perfectly fine document about cats."}\n'


def test_skip_locations_in_manifest_and_summary(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv('COLUMNS', '400')  # the summary table, wide enough for tmp paths
    src = tmp_path / 'data.jsonl'
    lines = [GOOD] * 40
    for i in range(2, 40, 3):  # 13 malformed lines: 2, 5, ..., 38
        lines[i - 1] = '{"text": \n'
    lines[6] = '{"text": 5}\n'   # line 7
    lines[20] = '{"body": "x"}\n'  # line 21
    src.write_text(''.join(lines), encoding='utf-8')
    rc = main(['convert', 'pretrain', str(src), '-o', str(tmp_path / 'out'), '--workers', '2',
               '--max-seq-len', '8', '--on-error', 'skip'])
    err = capsys.readouterr().err
    assert rc == 0
    m = Manifest.read(str(tmp_path / 'out'))
    malformed = [i for i in range(2, 40, 3)]
    assert m.skipped == {'malformed_json': 13, 'not_string': 1, 'missing_field': 1}
    assert m.skipped_at == {'malformed_json': [f'{src}:{i}' for i in malformed[:10]],
                            'not_string': [f'{src}:7'], 'missing_field': [f'{src}:21']}
    for where in (f'{src}:2', f'{src}:29', f'{src}:7', f'{src}:21', '(+3 more)'):
        assert where in err, where
    # a manifest written before skipped_at existed reads back with none
    d = json.loads((tmp_path / 'out' / 'foundrymix.json').read_text())
    del d['skipped_at']
    assert Manifest.from_dict(d).skipped_at == {}


def _worker_sigterm(chunk) -> bool:
    import signal
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_worker_processes_die_on_sigterm(monkeypatch):
    """Importing composer installs a SIGTERM handler (sys.exit) that forked workers inherit;
    stopping the pool with SIGTERM then could wait forever for a worker. Workers reset it."""
    import signal
    import sys

    from foundrymix.convert.pipeline import ordered_map
    from foundrymix.convert.readers import Chunk
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        chunks = [Chunk('jsonl', f'c{i}') for i in range(4)]
        with ordered_map(_worker_sigterm, chunks, 2, lambda: None, (), mode='processes') as results:
            assert [ok for _, ok in results] == [True] * 4
    finally:
        signal.signal(signal.SIGTERM, previous)
