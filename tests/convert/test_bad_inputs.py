"""Bad inputs the real ``foundrymix`` command line met with a raw traceback (exit 1) before:
each now stops with one line naming the file (and line), exit 2, and nothing published;
with ``--on-error skip`` the record-level (and file-level) ones are counted instead.

One table, one ``python -m foundrymix.cli`` process per case (the user's own path: the
standalone start-up, the CLI's error printing), about 2 s each. Running as root makes
``chmod 000`` readable: there the permission cases drop root's file-access capabilities
with ``setpriv`` (util-linux), and are skipped where that is not possible.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest

from convert_helpers import read_rows
from helpers import mode_prefix
from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
from foundrymix.convert.readers import InputError, plan_chunks, read_records

REPO = Path(__file__).resolve().parents[2]
DOC = 'Document {i} about cats and dogs: {h}.'  # a hash each: data that compresses little
N_DOCS = 3000


def docs_jsonl(n: int = N_DOCS) -> bytes:
    return ''.join(json.dumps({'text': DOC.format(i=i, h=hashlib.sha256(b'%d' % i).hexdigest())}) + '\n'
                   for i in range(n)).encode()


def truncated_gz(d: Path) -> Path:
    p = d / 'cut.jsonl.gz'
    data = gzip.compress(docs_jsonl(), mtime=0)
    p.write_bytes(data[:len(data) // 2])
    return p


def truncated_zst(d: Path) -> Path:
    import zstandard
    p = d / 'cut.jsonl.zst'
    data = zstandard.ZstdCompressor().compress(docs_jsonl())
    p.write_bytes(data[:len(data) // 2])
    return p


def surrogate(d: Path) -> Path:
    p = d / 'surrogate.jsonl'
    p.write_text('{"text": "fine"}\n{"text": "bad \\ud800 here"}\n{"text": "fine again"}\n')
    return p


def surrogate_ft(d: Path) -> Path:
    p = d / 'surrogate_ft.jsonl'
    p.write_text('{"prompt": "p", "response": "r"}\n{"prompt": "p", "response": "r \\udc00"}\n'
                 '{"prompt": "p", "response": "r"}\n')
    return p


def good(d: Path) -> Path:
    p = d / 'good.jsonl'
    p.write_text('{"text": "a fine document with several words in it"}\n')
    return p


def unreadable(d: Path) -> Path:
    p = good(d)
    p.chmod(0)
    return p


def unreadable_dir(d: Path) -> Path:
    locked = d / 'locked'
    locked.mkdir()
    good(locked)
    locked.chmod(0)
    return locked


def readonly_dir(d: Path) -> Path:
    (d / 'ro').mkdir()
    (d / 'ro').chmod(0o555)
    return d / 'ro'


def not_parquet(d: Path) -> Path:
    p = d / 'data.parquet'
    p.write_text('this is not parquet\n')
    return p


def corrupt_parquet(d: Path) -> Path:
    """Five row groups of 1,000 rows; 200 bytes in the second one overwritten."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    p = d / 'data.parquet'
    pq.write_table(pa.table({'text': [f'hello world here {i}' for i in range(5000)]}), p, row_group_size=1000)
    data = bytearray(p.read_bytes())
    data[len(data) // 3:len(data) // 3 + 200] = b'\xff' * 200
    p.write_bytes(bytes(data))
    return p


def truncated_dataset(d: Path) -> Path:
    """A dataset saved with ``save_to_disk`` whose ``.arrow`` file was cut in half."""
    from datasets import Dataset
    Dataset.from_dict({'text': ['hello world here'] * 1000}).save_to_disk(str(d / 'ds'))
    (arrow,) = (d / 'ds').glob('*.arrow')
    arrow.write_bytes(arrow.read_bytes()[:arrow.stat().st_size // 2])
    return d / 'ds'


def not_gzip(d: Path) -> Path:
    p = d / 'plain.jsonl.gz'
    p.write_bytes(docs_jsonl(3))  # not compressed at all
    return p


def compressed(suffix: str, name: str, data: bytes) -> Callable[[Path], Path]:
    """A maker of a file ``name`` holding ``data`` compressed as ``suffix`` (gz, zst)."""
    def make(d: Path) -> Path:
        import zstandard
        p = d / name
        p.write_bytes(gzip.compress(data, mtime=0) if suffix == 'gz' else zstandard.ZstdCompressor().compress(data))
        return p
    return make


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Path], Path]  # writes the bad input under a fresh directory, returns it
    argv: tuple[str, ...]  # {in}: the made path, {d}: the directory, {out}: d/out
    message: str  # expected in the one error line ({in}, {d} filled in)
    skipped: Optional[tuple[str, int, str]] = None  # with --on-error skip: reason, count, first at
    obeys_modes: bool = False  # needs file modes enforced (not plain root)


P = ('convert', 'pretrain', '{in}', '-o', '{out}', '--max-seq-len', '32')
F = ('convert', 'finetune', '{in}', '-o', '{out}', '--max-seq-len', '32')
CUT = 'replace the file, or pass --on-error skip to convert the lines before the damage'
CASES = [
    Case('gz-truncated', truncated_gz, P,
         '{in}: the gzip data ends early (a truncated file?) after line ',
         ('truncated_file', 1, '{in}')),
    Case('zst-truncated', truncated_zst, P,
         '{in}: the zstd data ends early (a truncated file?) after line ', ('truncated_file', 1, '{in}')),
    Case('gz-not-gzip', not_gzip, P,
         "{in}: not valid gzip data (Not a gzipped file (b'{\"')) before its first line ends; " + CUT,
         ('corrupt_file', 1, '{in}')),
    Case('gz-named-jsonl', compressed('gz', 'data.jsonl', docs_jsonl(50)), P,
         '{in}: holds gzip-compressed data, not text (its name ends in .jsonl); rename it to {in}.gz '
         '(read as compressed JSON Lines)'),
    Case('zst-named-jsonl', compressed('zst', 'data.jsonl', docs_jsonl(50)), P,
         '{in}: holds zstd-compressed data, not text (its name ends in .jsonl); rename it to {in}.zst '
         '(read as compressed JSON Lines)'),
    Case('gz-named-txt', compressed('gz', 'doc.txt', b'a fine document with several words in it'), P,
         '{in}: holds gzip-compressed data, not text (its name ends in .txt); rename it to {in}.gz and '
         'decompress it (gunzip {in}.gz)'),
    Case('surrogate-pretrain', surrogate, P,
         "{in}:2: field 'text': a lone UTF-16 surrogate \\ud800 at character 4, not valid Unicode (half of an "
         "escaped pair, or bytes decoded with surrogateescape?)",
         ('invalid_unicode', 1, '{in}:2')),
    Case('surrogate-finetune', surrogate_ft, F,
         "{in}:2: field 'response': a lone UTF-16 surrogate \\udc00 at character 2",
         ('invalid_unicode', 1, '{in}:2')),
    Case('not-parquet', not_parquet, P, '{in}: not a readable parquet file (Parquet magic bytes not found'),
    Case('parquet-corrupt-row-group', corrupt_parquet, P,
         '{in}: row group 1 (from row 1000) cannot be read (Corrupt snappy compressed data.); replace the file, '
         'or pass --on-error skip to convert the other row groups', ('corrupt_file', 1, '{in}')),
    Case('dataset-truncated-arrow', truncated_dataset, P, '{in}: this saved dataset cannot be read (Expected to '
         'be able to read'),
    Case('max-seq-len-overflow', good, (*P[:-1], '99999999999999999999'),
         '--max-seq-len 99999999999999999999 is too large: rows store token positions as int32, '
         'so at most 2,147,483,647'),
    Case('workers-overflow', good, (*P, '--workers', '99999999999999999999'),
         '--workers must be 0 (all cores) to 4,096, got 99999999999999999999'),
    Case('compression-unknown', good, (*P[:-1], '4', '--compression', 'zstd:99'),  # rows to write
         "--compression 'zstd:99' is not a shard compression streaming supports (choose from br[:0-11], "
         "bz2[:1-9], gz[:0-9], snappy, zstd[:1-22])"),
    Case('out-under-a-file', good, (*P[:4], '{in}/sub/out', *P[5:]),
         '{in}/sub/out: cannot be created, {in} is a file, not a directory'),
    Case('empty-tokenizer-dir', lambda d: (d / 'tok').mkdir() or good(d), (*P, '--tokenizer', '{d}/tok'),
         '{d}/tok: not a tokenizer directory (it holds none of config.json, tokenizer.json'),
    Case('unreadable-input', unreadable, P, '{in}: cannot read this input (permission denied)',
         obeys_modes=True),
    Case('unreadable-input-dir', unreadable_dir, P, '{in}: cannot list this directory (permission denied)',
         obeys_modes=True),
    Case('unwritable-out-parent', readonly_dir, ('convert', 'pretrain', '{d}/input.jsonl', '-o', '{in}/out',
                                                 '--max-seq-len', '32'),
         '{in}/out: cannot be created, no permission to write in {in}; choose another --out, or make '
         '{in} writable', obeys_modes=True),
    Case('unreadable-tokenizer-dir', lambda d: unreadable_dir(d) and good(d), (*P, '--tokenizer', '{d}/locked'),
         '{d}/locked: cannot list this tokenizer directory (permission denied)', obeys_modes=True),
]


def cli(argv: list[str], prefix: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, 'PYTHONPATH': str(REPO), 'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1',
           'TOKENIZERS_PARALLELISM': 'false'}
    workers = [] if '--workers' in argv else ['--workers', '1']
    return subprocess.run([*prefix, sys.executable, '-m', 'foundrymix.cli', *argv, '--no-progress', *workers],
                          capture_output=True, text=True, env=env, cwd=str(REPO),
                          timeout=120)


def fill(text: str, made: Path, d: Path) -> str:
    return text.replace('{in}', str(made)).replace('{out}', str(d / 'out')).replace('{d}', str(d))


@pytest.mark.parametrize('case', CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_located_line_exit_2(tmp_path, case):
    prefix = mode_prefix() if case.obeys_modes else []
    if prefix is None:
        pytest.skip('root without setpriv: file modes are not enforced')
    good(tmp_path).rename(tmp_path / 'input.jsonl')
    made = case.make(tmp_path)
    try:
        r = cli([fill(a, made, tmp_path) for a in case.argv], prefix)
    finally:
        for p in (made, tmp_path / 'locked', tmp_path / 'ro'):  # let pytest clean up
            if p.exists():
                p.chmod(0o755)
    assert 'Traceback' not in r.stderr, r.stderr
    assert r.returncode == 2, r.stderr
    assert r.stderr.count('\n') == 1 and r.stderr.startswith('foundrymix convert: error: '), r.stderr
    assert fill(case.message, made, tmp_path) in r.stderr
    assert not (tmp_path / 'out').exists()  # nothing published
    if case.skipped is None:
        return
    # --on-error skip, in-process (the CLI's path to the converter is the same; no second
    # start-up), beside a good file so that rows remain
    finetune = case.argv[1] == 'finetune'
    convert, options = (convert_finetune, FinetuneOptions) if finetune else (convert_pretrain, PretrainOptions)
    other = tmp_path / 'other.jsonl'
    other.write_text('{"prompt": "a prompt", "response": "a response"}\n' if finetune else
                     '{"text": "a fine document with several words in it"}\n')
    m = convert([str(made), str(other)], str(tmp_path / 'out'), options(max_seq_len=4, workers=1, on_error='skip'))
    reason, count, first_at = case.skipped
    assert m.skipped == {reason: count}
    assert m.skipped_at == {reason: [fill(first_at, made, tmp_path)]}


def test_truncated_gz_under_skip_converts_exactly_the_whole_lines_before_the_cut(tmp_path):
    """The lines before a truncation are converted as if the file ended there: the rows equal
    those of a plain ``.jsonl`` of exactly those lines (the decompressed prefix, cut at its
    last newline, decompressed with ``zlib``), and the refusal says how many were read."""
    made = truncated_gz(tmp_path)
    with pytest.raises(InputError) as err:
        convert_pretrain([str(made)], str(tmp_path / 'out'), PretrainOptions(max_seq_len=32, workers=1))
    m = convert_pretrain([str(made)], str(tmp_path / 'out'), PretrainOptions(max_seq_len=32, workers=1,
                                                                             on_error='skip'))
    data = zlib.decompressobj(wbits=31).decompress(made.read_bytes())  # all that can be decompressed
    whole = data[:data.rfind(b'\n') + 1]
    n = whole.count(b'\n')
    assert 0 < n < N_DOCS and whole == docs_jsonl(n)
    (tmp_path / 'ref.jsonl').write_bytes(whole)
    ref = convert_pretrain([str(tmp_path / 'ref.jsonl')], str(tmp_path / 'ref'),
                           PretrainOptions(max_seq_len=32, workers=1))
    assert m.counts.documents_read == n + 1  # the truncation is one skipped record
    assert m.skipped == {'truncated_file': 1} and m.counts.rows == ref.counts.rows > 0
    got, want = read_rows(tmp_path / 'out'), read_rows(tmp_path / 'ref')
    assert len(got) == len(want) and all(np.array_equal(g[k], w[k]) for g, w in zip(got, want) for k in w)
    assert str(err.value).startswith(f'{made}: the gzip data ends early (a truncated file?) after line {n:,}: '
                                     f'lines 1-{n:,} were read, the rest of line {n + 1:,} is lost; ')


def test_truncated_safetensors_of_a_pretrained_model_is_named(tmp_path):
    """``model.pretrained: DIR`` whose ``model.safetensors`` was cut short (a copy that
    did not finish): the model loader names the file (was safetensors' traceback)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from foundrymix.tokenizer import DEMO_TOKENIZER, load_tokenizer, tokenizer_info
    from foundrymix.train.model import ModelConfigError, build_hf_model
    from foundrymix.train.model_spec import ModelSpec

    info = tokenizer_info(load_tokenizer(DEMO_TOKENIZER))
    config = LlamaConfig(vocab_size=info.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / 'model')
    weights = tmp_path / 'model' / 'model.safetensors'
    spec = ModelSpec.from_dict({'pretrained': str(tmp_path / 'model')})
    assert build_hf_model(spec, info, 32) is not None  # whole: loads
    data = weights.read_bytes()
    for cut, why in ((len(data) // 2, 'incomplete metadata, file not fully covered'),
                     (10, 'invalid header length')):
        weights.write_bytes(data[:cut])
        with pytest.raises(ModelConfigError) as err:
            build_hf_model(spec, info, 32)
        assert str(err.value) == (f'model.pretrained: {weights}: not a whole safetensors file (Error while '
                                  f'deserializing header: {why}); a truncated copy? Copy or save the model again')


def test_lone_surrogate_made_by_preprocess_is_a_located_bad_record(tmp_path, monkeypatch):
    """A ``--preprocess`` function that decodes bytes with ``surrogateescape`` (a Latin-1
    ``é`` read as UTF-8 becomes ``\\udce9``) makes a record the tokenizer refuses: it is
    that record's error too, located by its input line."""
    (tmp_path / 'redecode.py').write_text(
        "def redecode(rec):\n    return {'text': rec['text'].encode('latin-1').decode('utf-8', 'surrogateescape')}\n")
    monkeypatch.chdir(tmp_path)
    src = tmp_path / 'in.jsonl'
    src.write_text('{"text": "fine words"}\n{"text": "a caf\\u00e9"}\n{"text": "more fine words"}\n')
    options = dict(max_seq_len=4, workers=1, preprocess='redecode:redecode')
    with pytest.raises(InputError) as err:
        convert_pretrain([str(src)], str(tmp_path / 'out'), PretrainOptions(**options))
    assert str(err.value) == (f"{src}:2: field 'text': a lone UTF-16 surrogate \\udce9 at character 5, not valid "
                              f"Unicode (half of an escaped pair, or bytes decoded with surrogateescape?)")
    m = convert_pretrain([str(src)], str(tmp_path / 'out'), PretrainOptions(**options, on_error='skip'))
    assert m.skipped == {'invalid_unicode': 1} and m.skipped_at == {'invalid_unicode': [f'{src}:2']}


def test_compression_check_accepts_exactly_what_streaming_does():
    """The torch-free ``--compression`` check against streaming's own codec list."""
    from streaming.base.compression import get_compressions

    from foundrymix.convert.writer import supported_compressions
    assert supported_compressions() == set(get_compressions())


@pytest.mark.parametrize('suffix', ['gz', 'zst'])
def test_multi_member_compressed_files_are_read_whole(tmp_path, suffix):
    """Concatenated gzip members / zstd frames (``cat a.gz b.gz``, pzstd) are one file, not a
    truncation: every line is read, in order (the reader checks each member's end)."""
    import zstandard
    compress = (lambda b: gzip.compress(b, mtime=0)) if suffix == 'gz' else zstandard.ZstdCompressor().compress
    p = tmp_path / f'multi.jsonl.{suffix}'
    p.write_bytes(compress(docs_jsonl(1500)) + compress(docs_jsonl(3000)[len(docs_jsonl(1500)):]))
    got = [rec for chunk in plan_chunks([str(p)], 1 << 16) for _, _, rec in read_records(chunk, ('text',))[1]]
    assert [json.dumps(r) + '\n' for r in got] == docs_jsonl(3000).decode().splitlines(keepends=True)


@pytest.mark.parametrize('suffix', ['gz', 'zst'])
def test_compressed_jsonl_renamed_as_advised_converts_as_the_plain_file(tmp_path, suffix):
    """The advice of the refusal above works: the renamed file gives the plain file's rows."""
    plain = tmp_path / 'plain.jsonl'
    plain.write_bytes(docs_jsonl(200))
    (tmp_path / 'in').mkdir()
    misnamed = compressed(suffix, 'data.jsonl', plain.read_bytes())(tmp_path / 'in')
    options = PretrainOptions(max_seq_len=32, workers=1)
    with pytest.raises(Exception) as e:  # a directory input is checked the same way
        convert_pretrain([str(tmp_path / 'in')], str(tmp_path / 'out'), options)
    assert str(e.value).endswith(f'rename it to {misnamed}.{suffix} (read as compressed JSON Lines)')
    misnamed.rename(f'{misnamed}.{suffix}')
    convert_pretrain([str(tmp_path / 'in')], str(tmp_path / 'out'), options)
    convert_pretrain([str(plain)], str(tmp_path / 'want'), options)
    got, want = read_rows(tmp_path / 'out'), read_rows(tmp_path / 'want')
    assert len(got) == len(want) > 0
    assert all(g.keys() == w.keys() and all(np.array_equal(g[k], w[k]) for k in w) for g, w in zip(got, want))
