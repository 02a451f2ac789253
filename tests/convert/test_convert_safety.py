"""Convert never harms or re-reads what the user owns: overlapping --out and inputs, URLs as
--out, earlier output inside an input directory, JSON documents taken as JSON Lines, and two
conversions into the same --out. Every case runs the real converter on real files and checks
the user's files byte for byte afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from convert_helpers import read_rows, tree_hash, write_jsonl
from foundrymix.cli import main
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
from foundrymix.format.schema import Manifest

L = 64
GOOD = '{"text": "A perfectly fine document about cats and dogs."}\n'


def convert(capsys, *argv) -> tuple[int, str]:
    rc = main(['convert', 'pretrain', *argv, '--no-progress', '--workers', '1', '--max-seq-len', str(L)])
    return rc, capsys.readouterr().err


@pytest.fixture
def corpus(tmp_path):
    data = tmp_path / 'data'
    (data / 'sub').mkdir(parents=True)
    (data / 'a.jsonl').write_text(GOOD * 30, encoding='utf-8')
    (data / 'sub' / 'b.jsonl').write_text(GOOD * 10, encoding='utf-8')
    return data


def _overlap_cases(tmp_path, data):
    """(inputs, out, the two paths the error must name) for each way of overlapping."""
    link = tmp_path / 'link-to-data'
    link.symlink_to(data, target_is_directory=True)
    return {
        'out_is_input_dir': ([str(data)], str(data), (str(data), str(data))),
        'out_contains_input_file': ([str(data / 'sub' / 'b.jsonl')], str(data),
                                    (str(data / 'sub' / 'b.jsonl'), str(data))),
        'out_is_link_to_input_dir': ([str(data)], str(link), (str(data), str(link))),
        'out_inside_input_dir': ([str(data)], str(data / 'sub' / 'mds'),
                                 (str(data / 'sub' / 'mds'), str(data))),
        'out_inside_globbed_dir': ([str(tmp_path / 'da*')], str(data / 'mds'), (str(data / 'mds'), str(data))),
    }


@pytest.mark.parametrize('case', ['out_is_input_dir', 'out_contains_input_file', 'out_is_link_to_input_dir',
                                  'out_inside_input_dir', 'out_inside_globbed_dir'])
def test_overwrite_never_deletes_inputs(capsys, tmp_path, corpus, case):
    inputs, out, named = _overlap_cases(tmp_path, corpus)[case]
    before = tree_hash(tmp_path)
    rc, err = convert(capsys, *inputs, '-o', out, '--overwrite')
    assert rc == 2 and err.startswith('foundrymix convert: error: '), err
    assert all(p in err for p in named), err
    assert tree_hash(tmp_path) == before  # nothing deleted, changed or created


def test_input_linked_into_out_is_refused(capsys, tmp_path, corpus):
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'keep.jsonl').write_text(GOOD * 5)
    (corpus / 'sub' / 'linked.jsonl').symlink_to(out / 'keep.jsonl')
    before = tree_hash(tmp_path)
    rc, err = convert(capsys, str(corpus), '-o', str(out), '--overwrite')
    assert rc == 2 and f'input {corpus / "sub" / "linked.jsonl"} is inside the output directory {out}' in err
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize('url', ['gs://bucket/x', 'file:///tmp/x'])
def test_url_out_is_refused(capsys, tmp_path, monkeypatch, corpus, url):
    """Only s3:// is uploaded to (tests/convert/test_convert_s3.py); other schemes are refused
    before os.path can turn them into local folders."""
    monkeypatch.chdir(tmp_path)
    before = tree_hash(tmp_path)
    rc, err = convert(capsys, str(corpus / 'a.jsonl'), '-o', url)
    assert rc == 2 and f'--out {url}: only s3://bucket/prefix is supported as a remote output' in err
    assert 'convert to a local directory, then copy it' in err
    assert tree_hash(tmp_path) == before  # no local folder 'gs:' appeared


def test_url_input_is_refused(capsys, tmp_path):
    rc, err = convert(capsys, 's3://bucket/data.jsonl', '-o', str(tmp_path / 'out'))
    assert rc == 2 and 's3://bucket/data.jsonl: reading inputs from object stores is not supported' in err


def test_earlier_output_and_partials_in_input_dir_are_not_read(tmp_path, corpus):
    first = convert_pretrain([str(corpus / 'a.jsonl')], str(tmp_path / 'first'),
                             PretrainOptions(max_seq_len=L, workers=1))
    # an earlier output (foundrymix), a bare MDS output, a partial and a JSON document
    # inside the input directory: none of them is input
    convert_pretrain([str(corpus / 'a.jsonl')], str(corpus / 'sub' / 'old-out'),
                     PretrainOptions(max_seq_len=L, workers=1))
    os.makedirs(corpus / 'mds')
    (corpus / 'mds' / 'index.json').write_text('{"shards": [], "version": 2}')
    (corpus / 'mds' / 'notes.jsonl').write_text(GOOD)
    os.makedirs(corpus / '.out.partial-99999')
    (corpus / '.out.partial-99999' / 'x.jsonl').write_text(GOOD)
    (corpus / 'config.json').write_text(json.dumps({'text': 'a config', 'nested': {'a': 1}}, indent=2))
    before = tree_hash(corpus)
    m = convert_pretrain([str(corpus)], str(tmp_path / 'second'),
                         PretrainOptions(max_seq_len=L, workers=1, on_error='skip'))
    assert m.inputs == [str(corpus / 'a.jsonl'), str(corpus / 'sub' / 'b.jsonl')]
    assert m.skipped == {} and m.counts.documents_read == 40
    assert first.counts.documents_read == 30
    assert tree_hash(corpus) == before


def test_output_dir_named_as_input_is_refused(capsys, tmp_path, corpus):
    out = tmp_path / 'out'
    convert_pretrain([str(corpus / 'a.jsonl')], str(out), PretrainOptions(max_seq_len=L, workers=1))
    for spec, marker in ((out, 'foundrymix.json'), (out / 'index.json', 'foundrymix.json'),
                         (out / 'foundrymix.json', 'foundrymix.json')):
        rc, err = convert(capsys, str(spec), '-o', str(tmp_path / 'again'))
        assert rc == 2 and f'{spec}: ' in err and 'a foundrymix output directory' in err, err
        assert f'(it holds {marker}), not an input' in err
    assert not (tmp_path / 'again').exists()


def test_json_documents_are_not_json_lines(capsys, tmp_path):
    pretty = tmp_path / 'pretty.json'
    pretty.write_text(json.dumps([{'text': 'one'}, {'text': 'two'}], indent=2))
    rc, err = convert(capsys, str(pretty), '-o', str(tmp_path / 'out'), '--on-error', 'skip')
    assert rc == 2 and f'{pretty}: not JSON Lines' in err and 'write one object per line' in err
    array = tmp_path / 'array.json'
    array.write_text(json.dumps([{'text': 'one'}]))
    rc, err = convert(capsys, str(array), '-o', str(tmp_path / 'out'))
    assert rc == 2 and f'{array}: not JSON Lines' in err
    # JSON Lines named .json explicitly (or by a *.json glob) is read
    lines = write_jsonl(tmp_path / 'lines.json', [{'text': 'one two three'}] * 40)
    m = convert_pretrain([str(lines)], str(tmp_path / 'o1'), PretrainOptions(max_seq_len=L, workers=1))
    assert m.counts.documents_read == 40
    m = convert_pretrain([str(tmp_path / 'lines*.json')], str(tmp_path / 'o2'),
                         PretrainOptions(max_seq_len=L, workers=1))
    assert m.inputs == [str(lines)]
    # but a directory holding only .json files has no input
    d = tmp_path / 'only-json'
    d.mkdir()
    (d / 'lines.json').write_bytes(lines.read_bytes())
    rc, err = convert(capsys, str(d), '-o', str(tmp_path / 'o3'))
    assert rc == 2 and f'{d}: no supported input files found' in err and '.json only when named' in err


def test_stale_partials_of_dead_processes_only_are_removed(tmp_path, corpus):
    live = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
    dead = subprocess.Popen([sys.executable, '-c', 'pass'])
    dead.wait()
    try:
        live_partial = tmp_path / f'.out.partial-{live.pid}-0123abcd'
        dead_partial = tmp_path / f'.out.partial-{dead.pid}-0123abcd'
        old_style = tmp_path / f'.out.partial-{dead.pid}'
        for p in (live_partial, dead_partial, old_style):
            p.mkdir()
            (p / 'shard.00000.mds').write_bytes(b'in progress')
        before = tree_hash(live_partial)
        convert_pretrain([str(corpus)], str(tmp_path / 'out'), PretrainOptions(max_seq_len=L, workers=1))
        assert tree_hash(live_partial) == before
        assert not dead_partial.exists() and not old_style.exists()
        assert sorted(os.listdir(tmp_path)) == sorted(['data', 'out', live_partial.name])
    finally:
        live.kill()
        live.wait()


def test_output_that_appears_meanwhile_is_left_alone(tmp_path, corpus):
    """A second conversion into the same --out publishes first: this one fails at its
    rename with a clear error, and the other output is untouched."""
    from foundrymix.convert.output import OutputExistsError
    from foundrymix.convert.writer import ShardWriter
    from foundrymix.format.schema import encode_row
    from foundrymix.tokenizer import load_tokenizer, tokenizer_info

    out = tmp_path / 'out'
    info = tokenizer_info(load_tokenizer('foundrymix-bpe-8k'))
    manifest = Manifest(kind='pretrain', max_seq_len=L, token_dtype='uint16', tokenizer=info)
    row = encode_row(list(range(L)), [(0, L)], [L], 'uint16')
    with pytest.raises(OutputExistsError, match='output directory appeared while converting'):
        with ShardWriter(str(out), L, 'uint16') as writer:
            for _ in range(5):
                writer.write(row)
            manifest.counts.rows = 5
            convert_pretrain([str(corpus)], str(out), PretrainOptions(max_seq_len=L, workers=1))
            other = tree_hash(out)
            writer.finish(manifest)
    assert tree_hash(out) == other
    assert sorted(os.listdir(tmp_path)) == ['data', 'out']  # this run's partial is gone
    # with overwrite the later run replaces it
    with ShardWriter(str(out), L, 'uint16', overwrite=True) as writer:
        convert_pretrain([str(corpus)], str(out), PretrainOptions(max_seq_len=L, workers=1, overwrite=True))
        for _ in range(5):
            writer.write(row)
        writer.finish(manifest)
    assert len(read_rows(out)) == 5 and sorted(os.listdir(tmp_path)) == ['data', 'out']


def test_two_cli_conversions_into_one_out(tmp_path, arxiv_jsonl):
    """Two real processes converting into the same --out at once: the one that publishes
    second fails cleanly (no traceback), and the published output is complete."""
    big = tmp_path / 'big.jsonl'
    big.write_bytes(arxiv_jsonl.read_bytes() * 3)
    out = tmp_path / 'out'
    cmd = [sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(big), '-o', str(out),
           '--max-seq-len', '256', '--workers', '1', '--no-progress']
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    err = next(e for rc, e in results if rc == 2)
    assert 'Traceback' not in err and err.startswith('foundrymix convert: error: '), err
    # normally both run at once and the later one is refused up front by the first one's
    # claim on --out (foundrymix.claims); if the first was done before the second started,
    # it is refused as a non-empty --out; the rename check is the last line of defence
    assert ('is in use by a live run' in err or 'output directory appeared while converting' in err
            or 'not empty; pass --overwrite' in err), err
    assert sorted(os.listdir(tmp_path)) == ['big.jsonl', 'out']
    m = Manifest.read(str(out))
    assert len(read_rows(out)) == m.counts.rows > 0
