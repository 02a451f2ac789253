"""``foundrymix adopt``: LLM-Foundry / streaming MDS -> foundrymix datasets without re-tokenizing.

The reference is always ``convert`` of the raw corpus the MDS was made from: adopting
Foundry's token shards must give the same rows, bit for bit, as ``convert pretrain`` of
that corpus when the separators match (Foundry: ``--eos_text`` = the EOS token, no
``--bos_text``; its tokenizer call adds BOS iff the tokenizer does, as foundrymix does).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from convert_helpers import read_jsonl, read_rows, write_jsonl
from foundry_fixtures import (concat_tokens, write_foundry_finetune, write_foundry_pretrain,
                              write_foundry_turns, write_raw_text)
from helpers import DEMO_TOKENIZER
from foundrymix.cli import main
from foundrymix.convert.adopt import AdoptArgs, adopt
from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
from foundrymix.errors import UserError
from foundrymix.format.schema import Manifest
from foundrymix.tokenizer import load_tokenizer
from foundrymix.tools.verify import verify

L = 128
#: documents of the arxiv sample used (each is ~18k tokens: ~800 rows of L, many shards)
N_DOCS = 6


def _arxiv(tmp_path, arxiv_jsonl):
    records = read_jsonl(arxiv_jsonl, limit=N_DOCS)
    return [r['text'] for r in records], write_jsonl(tmp_path / 'arxiv.jsonl', records)


def _eos_text(tokenizer: str) -> str:
    return load_tokenizer(tokenizer).eos_token


def _same_rows(a, b) -> None:
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        for col in ('input_ids', 'loss_spans', 'doc_lens'):
            np.testing.assert_array_equal(np.asarray(x[col]), np.asarray(y[col]), err_msg=f'row {i} {col}')


def test_foundry_tokens_equal_convert_pretrain(tmp_path, arxiv_jsonl, any_tokenizer):
    """Row for row: adopt(Foundry's token shards) == convert pretrain(raw), across many shards."""
    texts, arxiv_jsonl = _arxiv(tmp_path, arxiv_jsonl)
    rows = concat_tokens(texts, any_tokenizer, L, eos_text=_eos_text(any_tokenizer))
    src = write_foundry_pretrain(tmp_path / 'foundry', rows, size_limit=1 << 13)  # ~15 rows a shard
    assert len(os.listdir(src)) > 10
    ref = convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'ref'),
                           PretrainOptions(tokenizer=any_tokenizer, max_seq_len=L, workers=2))
    [(split, m)] = adopt(AdoptArgs(source=str(src), out=str(tmp_path / 'out'), tokenizer=any_tokenizer,
                                   common={'workers': 2}))
    assert split.rows == len(rows) == ref.counts.rows == m.counts.rows
    _same_rows(read_rows(tmp_path / 'out'), read_rows(tmp_path / 'ref'))
    # adopt writes whole batches of rows (LeanMDSWriter.write_batch), convert one row at a time:
    # the same shard files and index, byte for byte
    files = sorted(n for n in os.listdir(tmp_path / 'ref') if n != 'foundrymix.json')
    assert sorted(n for n in os.listdir(tmp_path / 'out') if n != 'foundrymix.json') == files
    for name in files:
        assert (tmp_path / 'out' / name).read_bytes() == (tmp_path / 'ref' / name).read_bytes(), name
    assert m.max_seq_len == L and m.counts.tail_tokens == 0
    assert m.tokenizer == ref.tokenizer
    assert m.options['source']['inferred'].startswith('documents end after each EOS')
    assert m.options['source']['columns'] == {'tokens': 'ndarray:int32'}
    # every document whose EOS lies in the kept stream, plus the one Foundry cut at the end
    stream = np.concatenate(rows)
    assert m.counts.documents_read == m.counts.documents_written == int((stream == ref.tokenizer.eos_id).sum()) + 1
    assert verify(str(tmp_path / 'out')).intact


def test_foundry_tokens_recut_shorter(tmp_path, arxiv_jsonl):
    """A shorter --max-seq-len re-cuts the same stream: the first rows of convert(raw) at that length."""
    texts, arxiv_jsonl = _arxiv(tmp_path, arxiv_jsonl)
    rows = concat_tokens(texts, DEMO_TOKENIZER, L, eos_text='<|endoftext|>')
    src = write_foundry_pretrain(tmp_path / 'foundry', rows, compression=None)
    convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'ref'), PretrainOptions(max_seq_len=48))
    [(_, m)] = adopt(AdoptArgs(tokenizer=DEMO_TOKENIZER, source=str(src), out=str(tmp_path / 'out'), max_seq_len=48))
    n = len(rows) * L // 48
    assert m.counts.rows == n and m.counts.tail_tokens == len(rows) * L - n * 48
    _same_rows(read_rows(tmp_path / 'out'), read_rows(tmp_path / 'ref')[:n])


def test_foundry_tokens_never_import_transformers(tmp_path, spm_tokenizer):
    """Adopting token shards needs only the tokenizer's ids: read with `tokenizers` alone
    (importing transformers took 6-15 s of the CLI's start), giving the very TokenizerInfo
    that the transformers path gives; tokenizers it might load differently (SentencePiece,
    a special token not among tokenizer.json's added tokens) go through transformers."""
    import json
    import shutil
    import subprocess
    import sys
    from foundrymix.tokenizer import BUNDLED_DIR, describe_tokenizer, tokenizer_info
    src = write_foundry_pretrain(tmp_path / 'foundry', [np.asarray([5, 0, 9, 7, 0, 3], dtype=np.int32)] * 4)
    code = ('import sys; from foundrymix.convert.adopt import AdoptArgs, adopt; '
            f'[(_, m)] = adopt(AdoptArgs(tokenizer={DEMO_TOKENIZER!r}, source={str(src)!r}, '
            f'out={str(tmp_path / "out")!r})); '
            "print(repr(m.tokenizer), 'transformers' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f'{tokenizer_info(load_tokenizer(DEMO_TOKENIZER))!r} False'
    other = tmp_path / 'tok'
    shutil.copytree(BUNDLED_DIR / DEMO_TOKENIZER, other)
    for name in ('tokenizer_config.json', 'special_tokens_map.json'):
        config = json.loads((other / name).read_text())
        (other / name).write_text(json.dumps(dict(config, pad_token='[PAD]')))
    for name in (str(other), spm_tokenizer):
        assert describe_tokenizer(name) == tokenizer_info(load_tokenizer(name))
    assert describe_tokenizer(str(other)).vocab_size == 8193  # transformers added [PAD]


def test_foundry_tokens_from_another_tokenizer_refused(tmp_path):
    src = write_foundry_pretrain(tmp_path / 'foundry', [np.asarray([5, 0, 9000, 7], dtype=np.int32)])
    with pytest.raises(UserError, match=r"shard\.00000\.mds\.zstd:row 0: token id 9000 is outside the "
                                        r"vocabulary of tokenizer 'foundrymix-bpe-8k' \(8,192 ids\)"):
        adopt(AdoptArgs(tokenizer=DEMO_TOKENIZER, source=str(src), out=str(tmp_path / 'out')))
    assert not (tmp_path / 'out').exists()


def test_foundry_finetune_splits_cli(tmp_path, dolly_jsonl, capsys):
    """The CLI (its parser and entry point, in-process) on a Foundry finetune root: splits
    found and listed, one dataset each, equal to convert finetune of the same records;
    `convert` on that root points to adopt."""
    records = read_jsonl(dolly_jsonl, limit=150)
    root = write_foundry_finetune(tmp_path / 'foundry', {'train': records[:100], 'val': records[100:]})
    assert main(['adopt', str(root), '--out', str(tmp_path / 'out'), '--max-seq-len', '256',
                 '--tokenizer', DEMO_TOKENIZER]) == 0
    out = capsys.readouterr().out
    assert 'train: 100 rows in 1 shard(s) (prompt: str, response: str) -> LLM-Foundry finetune text' in out
    assert 'val: 50 rows in 1 shard(s)' in out
    for split, part in (('train', records[:100]), ('val', records[100:])):
        convert_finetune([str(write_jsonl(tmp_path / f'{split}.jsonl', part))], str(tmp_path / f'ref-{split}'),
                         FinetuneOptions(max_seq_len=256))
        _same_rows(read_rows(tmp_path / 'out' / split), read_rows(tmp_path / f'ref-{split}'))
        m = Manifest.read(str(tmp_path / 'out' / split))
        assert m.kind == 'finetune' and m.options['source']['split'] == split
    before = sorted(p.relative_to(root) for p in root.rglob('*'))
    for out in (root, root / 'train' / 'x'):  # the source, or inside it: refused, nothing touched
        with pytest.raises(ValueError, match='Choose'):
            adopt(AdoptArgs(tokenizer=DEMO_TOKENIZER, source=str(root), out=str(out)))
    assert sorted(p.relative_to(root) for p in root.rglob('*')) == before
    with pytest.raises(UserError, match=r'holds MDS shards \(train/index.json, val/index.json\), not raw '
                                        r'input files; use them as they are with: foundrymix adopt'):
        convert_pretrain([str(root)], str(tmp_path / 'c'), PretrainOptions())


def test_foundry_turns_equal_convert_finetune(tmp_path, dolly_jsonl):
    """Tokenized Foundry finetune shards (turns) give convert finetune's rows on the raw records."""
    records = read_jsonl(dolly_jsonl, limit=120)
    src = write_foundry_turns(tmp_path / 'turns', records, DEMO_TOKENIZER)
    convert_finetune([str(write_jsonl(tmp_path / 'ft.jsonl', records))], str(tmp_path / 'ref'),
                     FinetuneOptions(max_seq_len=256))
    [(_, m)] = adopt(AdoptArgs(tokenizer=DEMO_TOKENIZER, source=str(src), out=str(tmp_path / 'out'), max_seq_len=256))
    _same_rows(read_rows(tmp_path / 'out'), read_rows(tmp_path / 'ref'))
    assert m.kind == 'finetune' and m.counts.documents_read == 120


def test_raw_text_zstd(tmp_path, arxiv_jsonl):
    """streaming's raw-text MDS (zstd) goes through the normal pretrain path."""
    texts, arxiv_jsonl = _arxiv(tmp_path, arxiv_jsonl)
    src = write_raw_text(tmp_path / 'text', texts, size_limit=1 << 14)
    assert any(n.endswith('.mds.zstd') for n in os.listdir(src))
    convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'ref'), PretrainOptions(max_seq_len=L))
    [(_, m)] = adopt(AdoptArgs(tokenizer=DEMO_TOKENIZER, source=str(src), out=str(tmp_path / 'out'), max_seq_len=L))
    _same_rows(read_rows(tmp_path / 'out'), read_rows(tmp_path / 'ref'))
    assert m.counts.documents_read == len(texts)


def test_unmanifested_mds_points_to_adopt(tmp_path):
    """inspect/verify/plan read Manifest or the index: MDS without a manifest names adopt."""
    src = write_raw_text(tmp_path / 'text', ['hello world'])
    with pytest.raises(FileNotFoundError, match='foundrymix adopt'):
        Manifest.read(str(src))
    with pytest.raises(FileNotFoundError, match='foundrymix adopt'):
        verify(str(src))


@pytest.mark.parametrize('encoding,lengths', [('ndarray:int32', [16, 16, 16]), ('ndarray:int32:16', [16, 16]),
                                              ('ndarray:uint16', [300, 300]), ('ndarray:int32', [16, 9, 16])])
def test_ndarray_rows_equals_streaming_decode(tmp_path, encoding, lengths):
    """The one-view read of token shards gives streaming's own row decoding (or declines)."""
    from streaming import MDSWriter
    from foundrymix.convert.mds_input import read_column_arrays, read_shard
    from foundrymix.format.mds import ndarray_rows
    from foundrymix.format.shards import read_index
    dtype = encoding.split(':')[1]
    rng = np.random.default_rng(0)
    with MDSWriter(out=str(tmp_path / 'm'), columns={'tokens': encoding}, compression='zstd') as w:
        for n in lengths:
            w.write({'tokens': rng.integers(0, 60000, size=n).astype(dtype)})
    _, rows = read_shard(str(tmp_path / 'm'), 0)
    expect = np.concatenate([r['tokens'] for r in rows])
    _, values, row_lens = read_column_arrays(str(tmp_path / 'm'), 0, 'tokens')
    np.testing.assert_array_equal(values, expect)
    assert values.dtype == expect.dtype and row_lens.tolist() == lengths
    import zstandard
    shard = read_index(str(tmp_path / 'm'))['shards'][0]
    data = zstandard.decompress((tmp_path / 'm' / shard['zip_data']['basename']).read_bytes())
    assert (ndarray_rows(data, shard) is None) == (len(set(lengths)) > 1)


def test_splits_to_s3(tmp_path, dolly_jsonl, monkeypatch):
    """--out s3://: one complete dataset per split under the prefix, byte for byte the local one."""
    from helpers import moto_s3
    records = read_jsonl(dolly_jsonl, limit=60)
    root = write_foundry_finetune(tmp_path / 'foundry', {'train': records[:40], 'val': records[40:]})
    adopt(AdoptArgs(tokenizer=DEMO_TOKENIZER, source=str(root), out=str(tmp_path / 'local'), max_seq_len=256))
    staging = tmp_path / 'tmp'
    staging.mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, 'tempdir', str(staging))
    with moto_s3('fmx-adopt') as s3:
        adopt(AdoptArgs(tokenizer=DEMO_TOKENIZER, source=str(root), out='s3://fmx-adopt/ft', max_seq_len=256))
        client = s3['client']
        keys = sorted(o['Key'] for o in client.list_objects_v2(Bucket='fmx-adopt')['Contents'])
        local = sorted(f'ft/{p.relative_to(tmp_path / "local")}' for p in (tmp_path / 'local').rglob('*')
                       if p.is_file())
        assert keys == local
        for key in keys:
            if not key.endswith('foundrymix.json'):  # the manifest records its own --out
                body = client.get_object(Bucket='fmx-adopt', Key=key)['Body'].read()
                assert body == (tmp_path / 'local' / key[3:]).read_bytes(), key
        assert verify('s3://fmx-adopt/ft/val').intact


def test_source_on_s3_equals_the_local_copy(tmp_path, arxiv_jsonl, monkeypatch):
    """adopt s3://bucket/prefix (splits under it, zstd token shards): the same output, byte for byte,
    as adopting the local folder it was uploaded from; the manifest names the URL; the copy made
    on the way is gone afterwards; an empty prefix is refused with what is missing."""
    import tempfile

    from helpers import moto_s3
    texts, _ = _arxiv(tmp_path, arxiv_jsonl)
    rows = concat_tokens(texts[:2], DEMO_TOKENIZER, L, eos_text=_eos_text(DEMO_TOKENIZER))
    root = tmp_path / 'foundry'
    write_foundry_pretrain(root / 'train', rows[:-20], size_limit=1 << 14)
    write_foundry_pretrain(root / 'val', rows[-20:])
    adopt(AdoptArgs(tokenizer=DEMO_TOKENIZER, source=str(root), out=str(tmp_path / 'local')))
    staging = tmp_path / 'tmp'
    staging.mkdir()
    monkeypatch.setattr(tempfile, 'tempdir', str(staging))
    with moto_s3('fmx-src') as s3:
        for p in sorted(root.rglob('*')):
            if p.is_file():
                s3['client'].upload_file(str(p), 'fmx-src', f'corpus/{p.relative_to(root)}')
        s3['client'].put_object(Bucket='fmx-src', Key='corpus/notes.txt', Body=b'not fetched')
        done = adopt(AdoptArgs(tokenizer=DEMO_TOKENIZER, source='s3://fmx-src/corpus/', out=str(tmp_path / 'out')))
        with pytest.raises(UserError, match=r'^s3://fmx-src/nothing: no MDS dataset there \(no index.json under'):
            adopt(AdoptArgs(tokenizer=DEMO_TOKENIZER, source='s3://fmx-src/nothing', out=str(tmp_path / 'out2')))
    assert [(s.name, m.options['source']['path']) for s, m in done] == [
        ('train', 's3://fmx-src/corpus/train'), ('val', 's3://fmx-src/corpus/val')]
    files = sorted(str(p.relative_to(tmp_path / 'local')) for p in (tmp_path / 'local').rglob('*') if p.is_file())
    assert files == sorted(str(p.relative_to(tmp_path / 'out')) for p in (tmp_path / 'out').rglob('*') if p.is_file())
    for name in files:
        if not name.endswith('foundrymix.json'):  # the manifest records its source path
            assert (tmp_path / 'out' / name).read_bytes() == (tmp_path / 'local' / name).read_bytes(), name
    assert sum(m.counts.rows for _, m in done) == len(rows)
    assert [p.name for p in staging.iterdir()] == ['foundrymix-claims']  # the copy is gone
    assert not (tmp_path / 'out2').exists()


def test_convert_from_mds_is_adopt(tmp_path, arxiv_jsonl, capsys):
    """`convert pretrain DIR --from-mds` writes what `adopt DIR` writes; the wrong kind, several
    inputs and a text-only option are refused, one line each, nothing written."""
    texts, _ = _arxiv(tmp_path, arxiv_jsonl)
    rows = concat_tokens(texts[:2], DEMO_TOKENIZER, L, eos_text=_eos_text(DEMO_TOKENIZER))
    src = write_foundry_pretrain(tmp_path / 'foundry', rows, size_limit=1 << 14)
    tok = ['--tokenizer', DEMO_TOKENIZER]
    assert main(['adopt', str(src), '--out', str(tmp_path / 'a'), '--no-progress', *tok]) == 0
    assert main(['convert', 'pretrain', str(src), '--from-mds', '--out', str(tmp_path / 'c'), '--no-progress',
                 *tok]) == 0
    names = sorted(os.listdir(tmp_path / 'a'))
    assert names == sorted(os.listdir(tmp_path / 'c')) and len(names) > 2
    for name in names:
        if name != 'foundrymix.json':
            assert (tmp_path / 'a' / name).read_bytes() == (tmp_path / 'c' / name).read_bytes()
    assert Manifest.read(str(tmp_path / 'c')).max_seq_len == L  # the source's rows, not convert's 2048
    capsys.readouterr()
    for argv, message in [
        (['convert', 'finetune', str(src), '--from-mds'],
         f'{src}: holds LLM-Foundry pretrain tokens (tokens: ndarray:int32); that is `foundrymix convert '
         f'pretrain --from-mds` (or `foundrymix adopt`)'),
        (['convert', 'pretrain', str(src), str(src), '--from-mds'],
         '--from-mds: give one MDS folder (or folder of splits), got 2 inputs'),
        (['convert', 'pretrain', str(src), '--from-mds', '--text-field', 'body'],
         '--text-field: not used with --from-mds (the MDS columns are read as they are; see `foundrymix '
         'adopt -h`); leave it out')]:
        assert main([*argv, '--out', str(tmp_path / 'x'), *tok]) == 2
        assert capsys.readouterr().err == f'foundrymix convert: error: {message}\n'
    assert not (tmp_path / 'x').exists()


def test_token_outside_the_vocabulary_names_shard_row_and_value(tmp_path):
    """Shards made with a bigger vocabulary: refused with the shard file, the row and the id."""
    rows = [np.arange(L, dtype=np.int32) + 5 for _ in range(6)]
    rows[4][7] = 9000  # the demo tokenizer has 8,192 ids
    src = write_foundry_pretrain(tmp_path / 'foundry', rows, compression=None)
    with pytest.raises(UserError) as err:
        adopt(AdoptArgs(tokenizer=DEMO_TOKENIZER, source=str(src), out=str(tmp_path / 'out')))
    assert str(err.value) == (f"{src / 'shard.00000.mds'}:row 4: token id 9000 is outside the vocabulary of "
                              f"tokenizer '{DEMO_TOKENIZER}' (8,192 ids); the shards were made with another "
                              f"tokenizer: pass it with --tokenizer")
    assert not (tmp_path / 'out').exists()


def test_adopt_without_tokenizer_is_refused(tmp_path, dolly_jsonl, capsys):
    """Foundry's shards do not record their tokenizer: without --tokenizer adopt (and `convert
    --from-mds`) refuses in one line naming --tokenizer, instead of tokenizing with the bundled
    demo tokenizer in silence; nothing is written."""
    records = read_jsonl(dolly_jsonl, limit=20)
    root = write_foundry_finetune(tmp_path / 'foundry', {'train': records})
    tokens = write_foundry_pretrain(tmp_path / 'tokens', [np.arange(L, dtype=np.int32)] * 3)
    for argv, what in [
        (['adopt', str(root)], f'{root / "train"}: holds LLM-Foundry finetune text (prompt, response: str), '
                               f'which adopt tokenizes'),
        (['convert', 'finetune', str(root), '--from-mds'],
         f'{root / "train"}: holds LLM-Foundry finetune text (prompt, response: str), which adopt tokenizes'),
        (['adopt', str(tokens)], f'{tokens}: holds LLM-Foundry pretrain tokens (tokens: ndarray:int32), whose '
                                 f'documents adopt finds by the EOS/BOS ids of the tokenizer')]:
        assert main([*argv, '--out', str(tmp_path / 'out')]) == 2
        command = 'convert' if argv[0] == 'convert' else 'adopt'
        assert capsys.readouterr().err == (
            f'foundrymix {command}: error: {what}; the shards do not record their tokenizer: pass --tokenizer '
            f'NAME_OR_DIR, the one they were made with (a bundled name, a local tokenizer directory or a cached '
            f'Hub name)\n')
    assert not (tmp_path / 'out').exists()
    # plain `convert` keeps its default tokenizer (the bundled one), as documented
    assert main(['convert', 'finetune', str(write_jsonl(tmp_path / 'ft.jsonl', records)), '--out',
                 str(tmp_path / 'plain'), '--no-progress']) == 0
    assert Manifest.read(str(tmp_path / 'plain')).tokenizer.name == DEMO_TOKENIZER


@pytest.mark.parametrize('kind', ['tokens', 'turns'])
def test_adopted_token_ids_are_said_to_be_kept_as_they_are(kind, tmp_path, dolly_jsonl, arxiv_jsonl, capsys):
    """Adopted token ids get no BOS/EOS inserted: the summary says so (not 'EOS inserted: yes' for
    turns, nor '(--no-eos)' when it was not given), and the EOS ids in the rows are exactly the
    source's (counted here in the source shards and the written rows)."""
    eos = load_tokenizer(DEMO_TOKENIZER).eos_token_id
    if kind == 'tokens':
        texts, _ = _arxiv(tmp_path, arxiv_jsonl)
        rows = concat_tokens(texts[:2], DEMO_TOKENIZER, L, eos_text=_eos_text(DEMO_TOKENIZER))
        src = write_foundry_pretrain(tmp_path / 'src', rows)
        source_eos = int((np.concatenate(rows) == eos).sum())
        how = 'documents end after each EOS (id 0; the first after the start is in shard 0)'
    else:
        records = read_jsonl(dolly_jsonl, limit=40)
        src = write_foundry_turns(tmp_path / 'src', records, DEMO_TOKENIZER)
        tok = load_tokenizer(DEMO_TOKENIZER)
        source_eos = sum((tok(r['prompt'])['input_ids'] + tok(r['response'], add_special_tokens=False)['input_ids']
                          + [eos]).count(eos) for r in records)
        how = "each example's turns as LLM-Foundry's tokenizer call made them"
    assert main(['adopt', str(src), '--out', str(tmp_path / 'out'), '--tokenizer', DEMO_TOKENIZER,
                 '--max-seq-len', '2048' if kind == 'turns' else str(L)]) == 0  # no example dropped
    err = ' '.join(capsys.readouterr().err.split())  # the summary, as rich wrapped it
    assert f"separators: none inserted: the source's token ids are kept as they are ({how})." in err
    assert 'inserted before' not in err and 'inserted after' not in err and '--no-eos' not in err
    written = read_rows(tmp_path / 'out')
    assert Manifest.read(str(tmp_path / 'out')).dropped == {}
    assert sum(int((np.asarray(r['input_ids'])[:sum(r['doc_lens'])] == eos).sum()) for r in written) == source_eos


def test_token_shards_without_a_separator_of_the_tokenizer_are_warned(tmp_path, capsys):
    """No EOS/BOS id of --tokenizer in the shards: one document per stream, and a warning that
    says what that may mean (another tokenizer, a several-id --eos_text) instead of silence."""
    rows = [(np.arange(L, dtype=np.int32) * 7 + i) % 8000 + 5 for i in range(6)]  # ids 5..8004: no EOS (0)
    src = write_foundry_pretrain(tmp_path / 'foundry', rows)
    assert main(['adopt', str(src), '--out', str(tmp_path / 'out'), '--tokenizer', DEMO_TOKENIZER]) == 0
    err = ' '.join(capsys.readouterr().err.split())
    assert (f"warning: neither EOS (id 0) nor BOS between tokens of tokenizer '{DEMO_TOKENIZER}' in the shards, "
            f"so every row is one document. If the documents had separators, they were not its single EOS/BOS "
            f"ids: the shards were made with another tokenizer (pass it with --tokenizer) or with an "
            f"--eos_text/--bos_text of several ids (adopt finds single ids only).") in err
    m = Manifest.read(str(tmp_path / 'out'))
    assert m.options['source']['inferred'].startswith('neither EOS') and m.counts.rows == 6


def _damaged(tmp_path, damage: str):
    """Foundry token shards (40 windows, ~7 a shard), damaged as a bad copy or a hand-edited index
    leaves them: (source, the one line adopt must give)."""
    import json
    src = write_foundry_pretrain(tmp_path / 'foundry', [np.arange(L, dtype=np.int32) + 5 for _ in range(40)],
                                 compression=None, size_limit=4096)
    index = json.loads((src / 'index.json').read_text())
    shard = index['shards'][1]
    path = src / shard['raw_data']['basename']
    size = path.stat().st_size
    assert len(index['shards']) > 2 and size == shard['raw_data']['bytes']
    if damage == 'truncated':
        path.write_bytes(path.read_bytes()[:size // 2])
        return src, (f'{src}: 1 shard file(s) do not match index.json: {path}: {size // 2:,} bytes, index.json '
                     f'records {size:,} (truncated). adopt reads what index.json records: copy the dataset '
                     f'again from where it was written (an incomplete copy?)')
    if damage == 'samples':
        header = int(np.frombuffer(path.read_bytes()[:4], np.uint32)[0])  # the rows the shard holds
        shard['samples'] = header + 3
        (src / 'index.json').write_text(json.dumps(index))
        return src, (f'{path}: shard header says {header:,} rows, index.json records {header + 3:,}: index.json '
                     f'does not describe this shard; copy the dataset again from where it was written, or '
                     f'rewrite it')
    for s in index['shards']:
        s['column_encodings'] = ['ndarray:int64']  # the shards hold int32
    (src / 'index.json').write_text(json.dumps(index))
    return src, (f'{src / "shard.00000.mds"}: row 0 cannot be read as the columns index.json declares (tokens: '
                 f'ndarray:int64): ValueError: cannot reshape array of size {L // 2} into shape ({L},); the '
                 f'column_encodings do not match how the shards were written (e.g. ndarray:int64 for int32 '
                 f'tokens): correct them in index.json, or write the dataset again')


@pytest.mark.parametrize('damage', ['truncated', 'samples', 'encoding'])
def test_damaged_mds_is_one_line_naming_the_shard(tmp_path, capsys, damage):
    """A truncated shard (checked against index.json's sizes before anything is converted, as
    plan/train/verify check a stream), an index overstating a shard's rows, a misdeclared column
    encoding: one line naming the shard and what to do, exit 2, nothing written (were numpy or
    streaming ValueError tracebacks)."""
    src, line = _damaged(tmp_path, damage)
    assert main(['adopt', str(src), '-o', str(tmp_path / 'out'), '--tokenizer', DEMO_TOKENIZER,
                 '--no-progress']) == 2
    assert capsys.readouterr().err.splitlines() == [f'foundrymix adopt: error: {line}']
    assert not (tmp_path / 'out').exists()
