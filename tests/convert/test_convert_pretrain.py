"""convert pretrain on the real arXiv sample: rows reproduce the tokenized corpus exactly."""

from __future__ import annotations

import gzip
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zstandard
from streaming import StreamingDataset

from convert_helpers import ids, read_jsonl, read_rows, write_jsonl
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
from foundrymix.format.schema import Manifest
from foundrymix.tokenizer import load_tokenizer, tokenizer_info

L = 256


def reference_stream(tokenizer: str, texts: list[str], bos: bool, eos: bool) -> tuple[list[int], list[int]]:
    """All documents as ``[BOS] ids [EOS]`` back to back, and each document's length."""
    info = tokenizer_info(load_tokenizer(tokenizer))
    stream, lens = [], []
    for text in texts:
        doc = ([info.bos_id] if bos else []) + ids(tokenizer, text) + ([info.eos_id] if eos else [])
        stream += doc
        lens.append(len(doc))
    return stream, lens


def expected_pieces(lens: list[int], n_rows: int) -> list[list[int]]:
    """Document pieces per row, computed the slow obvious way."""
    owner = np.repeat(np.arange(len(lens)), lens)[:n_rows * L].reshape(n_rows, L)
    return [np.unique(r, return_counts=True)[1].tolist() for r in owner]


def test_rows_reproduce_tokenized_corpus(any_tokenizer, arxiv_jsonl, tmp_path):
    texts = [r['text'] for r in read_jsonl(arxiv_jsonl)]
    tok = load_tokenizer(any_tokenizer)
    add_bos = tokenizer_info(tok).add_bos
    assert add_bos == (any_tokenizer != 'foundrymix-bpe-8k')
    m = convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'out'),
                         PretrainOptions(tokenizer=any_tokenizer, max_seq_len=L, workers=1))
    stream, lens = reference_stream(any_tokenizer, texts, bos=add_bos, eos=True)
    rows = read_rows(tmp_path / 'out')
    c = m.counts
    assert len(rows) == c.rows and c.rows * L + c.tail_tokens == len(stream)
    assert c.tail_tokens < L and c.tokens == c.loss_tokens == c.rows * L and c.pad_tokens == 0
    got = np.concatenate([r['input_ids'] for r in rows])
    assert got.dtype == np.uint16
    assert got.tolist() == stream[:c.rows * L]
    assert all(r['loss_spans'].tolist() == [0, L] for r in rows)
    assert [r['doc_lens'].tolist() for r in rows] == expected_pieces(lens, c.rows)
    assert c.documents_read == c.documents_written == 20
    # decoding the first document's tokens gives its text back
    start = 1 if add_bos else 0
    assert tok.decode(got[start:lens[0] - 1].tolist()) == texts[0]
    assert m.options['separators']['bos'] == add_bos and m.options['separators']['eos']
    assert Manifest.read(str(tmp_path / 'out')) == m


#: (workers, parallel): in the calling thread, tokenizer threads, worker processes
PARALLEL_SETUPS = [(1, None), (2, 'threads'), (3, 'threads'), (2, 'processes')]


def test_workers_give_identical_rows(arxiv_jsonl, tmp_path):
    outs = []
    for w, mode in PARALLEL_SETUPS:
        out = tmp_path / f'w{w}-{mode}'
        m = convert_pretrain([str(arxiv_jsonl)], str(out),
                             PretrainOptions(max_seq_len=L, workers=w, parallel=mode, chunk_bytes=64 << 10))
        outs.append((m, read_rows(out), (out / 'index.json').read_bytes(),
                     (out / 'foundrymix.json').read_bytes()))
    m1, r1, index1, manifest1 = outs[0]
    assert 'parallel' not in m1.options and 'workers' not in m1.options
    for m2, r2, index2, manifest2 in outs[1:]:
        assert m1.counts == m2.counts and len(r1) == len(r2) == m1.counts.rows
        # shards (their hashes are in the index) and manifest are byte-identical
        assert index1 == index2 and manifest1 == manifest2
        for a, b in zip(r1, r2):
            for col in ('input_ids', 'loss_spans', 'doc_lens'):
                assert np.array_equal(a[col], b[col])


def test_threads_restore_tokenizers_parallelism(arxiv_jsonl, tmp_path, monkeypatch):
    """Workers encode single-threaded during the run; the setting comes back after."""
    for value, workers in (('true', 2), (None, 2), ('true', 1)):
        if value is None:
            monkeypatch.delenv('TOKENIZERS_PARALLELISM', raising=False)
        else:
            monkeypatch.setenv('TOKENIZERS_PARALLELISM', value)
        convert_pretrain([str(arxiv_jsonl)], str(tmp_path / f'o-{value}-{workers}'),
                         PretrainOptions(max_seq_len=L, workers=workers, parallel='threads'))
        assert os.environ.get('TOKENIZERS_PARALLELISM') == value


def test_unknown_parallel_mode(arxiv_jsonl, tmp_path):
    with pytest.raises(ValueError, match='--parallel must be one of threads, processes'):
        convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'o'), PretrainOptions(parallel='fibers'))
    assert not (tmp_path / 'o').exists()


def test_manifest_counts_match_streaming_dataset(arxiv_jsonl, tmp_path):
    out = tmp_path / 'out'
    m = convert_pretrain([str(arxiv_jsonl)], str(out), PretrainOptions(max_seq_len=1024, workers=1))
    ds = StreamingDataset(local=str(out), shuffle=False, batch_size=1)
    assert len(ds) == m.counts.rows == 352
    assert sum(int(ds[i]['doc_lens'].sum()) for i in range(len(ds))) == m.counts.tokens
    assert sorted(os.listdir(out)) == ['foundrymix.json', 'index.json', 'shard.00000.mds']


@pytest.mark.parametrize('bos,eos', [(False, True), (True, False)])
def test_separator_overrides(spm_tokenizer, arxiv_jsonl, tmp_path, bos, eos):
    texts = [r['text'] for r in read_jsonl(arxiv_jsonl, 3)]
    src = write_jsonl(tmp_path / 'in.jsonl', [{'text': t} for t in texts])
    m = convert_pretrain([str(src)], str(tmp_path / 'out'),
                         PretrainOptions(tokenizer=spm_tokenizer, max_seq_len=L, workers=1, bos=bos, eos=eos))
    stream, _ = reference_stream(spm_tokenizer, texts, bos=bos, eos=eos)
    got = np.concatenate([r['input_ids'] for r in read_rows(tmp_path / 'out')])
    assert got.tolist() == stream[:m.counts.rows * L]
    assert m.counts.rows * L + m.counts.tail_tokens == len(stream)


def test_no_separator_refused(arxiv_jsonl, tmp_path):
    with pytest.raises(ValueError, match='at least one of BOS and EOS'):
        convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'o'), PretrainOptions(bos=False, eos=False))


def _write_formats(tmp_path, texts) -> dict[str, list[str]]:
    """The same documents as gz, zst, txt files, parquet and a saved HF dataset."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset
    payload = ''.join(f'{{"text": {__import__("json").dumps(t)}}}\n' for t in texts).encode()
    (tmp_path / 'a.jsonl.gz').write_bytes(gzip.compress(payload))
    (tmp_path / 'a.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(payload))
    txt = tmp_path / 'txt'
    txt.mkdir()
    for i, t in enumerate(texts):
        (txt / f'doc{i:02d}.txt').write_text(t, encoding='utf-8')
    pq.write_table(pa.table({'text': texts}), tmp_path / 'a.parquet', row_group_size=2)
    Dataset.from_dict({'text': texts}).save_to_disk(str(tmp_path / 'hf'))
    return {'gz': [str(tmp_path / 'a.jsonl.gz')], 'zst': [str(tmp_path / 'a.jsonl.zst')],
            'txt': [str(txt)], 'parquet': [str(tmp_path / 'a.parquet')],
            'hf': [str(tmp_path / 'hf')], 'glob': [str(txt / 'doc0*.txt')]}


def test_all_input_formats_give_the_same_rows(arxiv_jsonl, tmp_path):
    texts = [r['text'] for r in read_jsonl(arxiv_jsonl, 5)]
    stream, _ = reference_stream('foundrymix-bpe-8k', texts, bos=False, eos=True)
    for fmt, inputs in _write_formats(tmp_path, texts).items():
        out = tmp_path / f'out-{fmt}'
        m = convert_pretrain(inputs, str(out), PretrainOptions(max_seq_len=L, workers=1, chunk_bytes=4096))
        got = np.concatenate([r['input_ids'] for r in read_rows(out)])
        assert got.tolist() == stream[:m.counts.rows * L], fmt
        assert m.counts.documents_read == 5 and len(m.counts.__dict__) == 7, fmt


def test_sigkill_mid_conversion_leaves_nothing_complete(arxiv_jsonl, tmp_path):
    big = tmp_path / 'big.jsonl'
    with open(big, 'wb') as f:
        for _ in range(15):
            f.write(arxiv_jsonl.read_bytes())
    out = tmp_path / 'out'
    cmd = [sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(big), '-o', str(out),
           '--max-seq-len', '256', '--workers', '1', '--size-limit', '64kb', '--no-progress']
    proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 240  # a hang guard: start-up and imports on a loaded machine
        partial = None
        while time.time() < deadline and partial is None:
            for name in os.listdir(tmp_path):
                p = tmp_path / name
                if name.startswith('.out.partial-') and any(x.endswith('.mds') for x in os.listdir(p)):
                    partial = p
            time.sleep(0.05)
        assert partial is not None, 'conversion never started writing shards'
        assert proc.poll() is None, proc.stderr.read().decode()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    assert not (partial / 'index.json').exists() and not (partial / 'foundrymix.json').exists()
    # the next run cleans the leftover and completes
    small = write_jsonl(tmp_path / 'small.jsonl', read_jsonl(arxiv_jsonl, 2))
    convert_pretrain([str(small)], str(out), PretrainOptions(max_seq_len=L, workers=1))
    assert not partial.exists() and (out / 'index.json').exists()
    shutil.rmtree(out)


def _tree_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize('tokenizer', ['foundrymix-bpe-8k', 'spm'])
def test_cli_process_matches_in_process(arxiv_jsonl, tmp_path, tokenizer, spm_tokenizer):
    """A standalone ``foundrymix convert`` loads transformers without torch and writes shards in
    a background thread; the output must be byte for byte what an in-process call writes."""
    tok = spm_tokenizer if tokenizer == 'spm' else tokenizer
    src = write_jsonl(tmp_path / 'small.jsonl', read_jsonl(arxiv_jsonl, 6))
    convert_pretrain([str(src)], str(tmp_path / 'lib'), PretrainOptions(tokenizer=tok, max_seq_len=L,
                                                                        size_limit='64kb'))
    env = {k: v for k, v in os.environ.items() if k not in ('USE_TORCH', 'USE_TF', 'USE_FLAX')}
    cmd = [sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(src), '-o',
           str(tmp_path / 'cli'), '--tokenizer', tok, '--max-seq-len', str(L), '--size-limit', '64kb',
           '--no-progress']
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert 'PyTorch' not in proc.stderr  # transformers' "no torch" advisory is silenced
    lib, cli = _tree_bytes(tmp_path / 'lib'), _tree_bytes(tmp_path / 'cli')
    assert len(lib) > 3 and lib == cli


def test_writer_thread_errors_reach_the_caller(arxiv_jsonl, tmp_path, monkeypatch):
    """A failure inside the shard-writer thread (the MDS encoder, made to fail at its 3rd row:
    a bad ``--compression``, which provoked one before, is now refused before any work)
    stops the conversion with that error, and nothing is published."""
    from foundrymix.format import mds
    real, calls = mds.LeanMDSWriter.write, []

    def failing(self, sample):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError('encoder failed at row 3')
        return real(self, sample)
    monkeypatch.setattr(mds.LeanMDSWriter, 'write', failing)
    with pytest.raises(ValueError, match='encoder failed at row 3'):
        convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'o'), PretrainOptions(max_seq_len=L))
    assert len(calls) == 3
    assert os.listdir(tmp_path) == []  # neither the output nor a partial directory


def test_dataset_dict_converts_one_split_named_by_split(arxiv_jsonl, tmp_path, capsys):
    """A saved DatasetDict (train + test) is refused without --split (both were converted into
    one dataset: test rows became training data); --split train converts exactly what
    converting the train folder alone does; a wrong or unused --split is refused."""
    from datasets import Dataset, DatasetDict

    from foundrymix.cli import main

    texts = [r['text'] for r in read_jsonl(arxiv_jsonl, limit=6)]
    DatasetDict({'train': Dataset.from_dict({'text': texts[:4]}),
                 'test': Dataset.from_dict({'text': texts[4:]})}).save_to_disk(str(tmp_path / 'corpus' / 'dd'))
    dd = tmp_path / 'corpus' / 'dd'

    def convert(*argv) -> tuple[int, str]:
        capsys.readouterr()
        rc = main(['convert', 'pretrain', *map(str, argv), '--max-seq-len', '64', '--workers', '1',
                   '--no-progress'])
        return rc, capsys.readouterr().err

    refusal = (f'foundrymix convert: error: {dd}: a DatasetDict with splits train, test; converting them '
               f'into one dataset would mix them (a test split becomes training data): pass --split NAME '
               f'to convert one (e.g. --split train), and each other split into an --out of its own\n')
    for given in (dd, tmp_path / 'corpus'):  # named, or found inside a directory
        assert convert(given, '-o', tmp_path / 'out') == (2, refusal)
    assert not (tmp_path / 'out').exists()
    assert convert(dd, '-o', tmp_path / 'out', '--split', 'validation') == (
        2, f'foundrymix convert: error: --split validation: {dd} has no such split (its splits: train, test)\n')
    assert convert(arxiv_jsonl, '-o', tmp_path / 'out', '--split', 'train') == (
        2, 'foundrymix convert: error: --split train: no input is a DatasetDict saved to disk '
           '(dataset_dict.json); leave --split out\n')
    assert not (tmp_path / 'out').exists()

    assert convert(dd, '-o', tmp_path / 'out', '--split', 'train') == (0, '')
    convert_pretrain([str(dd / 'train')], str(tmp_path / 'want'), PretrainOptions(max_seq_len=64, workers=1))
    got, want = read_rows(tmp_path / 'out'), read_rows(tmp_path / 'want')
    assert len(got) == len(want) > 0
    assert all(np.array_equal(g[k], w[k]) for g, w in zip(got, want) for k in w)
    assert Manifest.read(str(tmp_path / 'out')).counts.documents_read == 4
    assert Manifest.read(str(tmp_path / 'out')).inputs == Manifest.read(str(tmp_path / 'want')).inputs

    DatasetDict({'train': Dataset.from_dict({'text': texts[:4]})}).save_to_disk(str(tmp_path / 'one'))
    assert convert(tmp_path / 'one', '-o', tmp_path / 'one-out') == (0, '')  # one split: as is
    assert Manifest.read(str(tmp_path / 'one-out')).counts.documents_read == 4


def test_from_mds_split_adopts_that_split_only(arxiv_jsonl, tmp_path, capsys):
    """--split with --from-mds is adopt's --split: only that split is written, to OUT/<split>."""
    from foundry_fixtures import concat_tokens, write_foundry_pretrain
    from helpers import DEMO_TOKENIZER

    from foundrymix.cli import main

    texts = [r['text'] for r in read_jsonl(arxiv_jsonl, limit=2)]
    rows = concat_tokens(texts, DEMO_TOKENIZER, 64, eos_text=load_tokenizer(DEMO_TOKENIZER).eos_token)
    write_foundry_pretrain(tmp_path / 'foundry' / 'train', rows[:-5])
    write_foundry_pretrain(tmp_path / 'foundry' / 'val', rows[-5:])
    assert main(['convert', 'pretrain', str(tmp_path / 'foundry'), '--from-mds', '--split', 'val',
                 '--tokenizer', DEMO_TOKENIZER, '--out', str(tmp_path / 'out'), '--no-progress']) == 0, \
        capsys.readouterr().err
    assert os.listdir(tmp_path / 'out') == ['val']
    assert Manifest.read(str(tmp_path / 'out' / 'val')).counts.rows == 5
