"""convert --holdout: OUT/eval and OUT/train hold exactly the records the hash rule picks,
and ``plan`` reports what an evaluation on ``{local: OUT, split: eval}`` reads.

The rule is recomputed here from the input records (sha256 of each record's sorted JSON),
and each side's records are recovered from its rows by matching them against an independent
tokenization of every input record (the HF Python API, not the converter's path).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from convert_helpers import ids, read_jsonl, read_rows, write_jsonl
from foundrymix.cli import main
from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
from foundrymix.format.schema import Manifest
from foundrymix.loader.mixer import StreamMixer
from foundrymix.tokenizer import DEMO_TOKENIZER, load_tokenizer, tokenizer_info
from foundrymix.train.config import PlanConfig

L = 4096  # every Dolly/HH example fits: none is dropped, so each side's rows hold all its records


def sha(record: dict) -> int:
    text = json.dumps(record, sort_keys=True, ensure_ascii=False, default=str)
    return int(hashlib.sha256(text.encode('utf-8')).hexdigest(), 16)


def key(record: dict) -> str:
    return json.dumps(record, sort_keys=True)


@pytest.fixture(scope='module')
def records(dolly_jsonl) -> list[dict]:
    """The Dolly/HH sample and exact duplicates of 40 of its records (spread over the file)."""
    base = read_jsonl(dolly_jsonl)
    return base + [base[i] for i in range(0, 1000, 25)]


@pytest.fixture(scope='module')
def by_ids(records) -> dict[tuple[int, ...], str]:
    """Each record by the tokens of its example: prompt, response, EOS (no BOS in this tokenizer)."""
    eos = tokenizer_info(load_tokenizer(DEMO_TOKENIZER)).eos_id
    return {tuple(ids(DEMO_TOKENIZER, r['prompt']) + ids(DEMO_TOKENIZER, r['response']) + [eos]): key(r)
            for r in records}


def side_records(directory, by_ids: dict) -> Counter:
    """The multiset of input records whose example is in ``directory``'s rows (each row holds
    whole examples back to back, ``doc_lens`` long)."""
    got: Counter = Counter()
    for row in read_rows(directory):
        start = 0
        for n in row['doc_lens'].tolist():
            got[by_ids[tuple(row['input_ids'][start:start + n].tolist())]] += 1
            start += n
    return got


def convert(path, out, holdout, **kw) -> Manifest:
    return convert_finetune([str(path)], str(out), FinetuneOptions(max_seq_len=L, holdout=holdout, **kw))


def test_fraction_split_is_the_hash_rule(records, by_ids, tmp_path):
    path = write_jsonl(tmp_path / 'in.jsonl', records)
    train = convert(path, tmp_path / 'out', '5%', workers=1)
    held = Counter(key(r) for r in records if sha(r) / 2 ** 256 < 0.05)
    rest = Counter(key(r) for r in records if sha(r) / 2 ** 256 >= 0.05)
    assert 30 < sum(held.values()) < 80  # about 5 % of 1040
    assert side_records(tmp_path / 'out' / 'eval', by_ids) == held
    assert side_records(tmp_path / 'out' / 'train', by_ids) == rest
    assert not set(held) & set(rest)  # no record (nor a duplicate of one) on both sides
    duplicated = {key(records[i]) for i in range(0, 1000, 25)}
    assert sum(held[k] == 2 for k in duplicated) + sum(rest[k] == 2 for k in duplicated) == 40
    evals = Manifest.read(str(tmp_path / 'out' / 'eval'))
    assert evals.counts.documents_read == evals.counts.documents_written == sum(held.values())
    assert train.counts.documents_read == train.counts.documents_written == sum(rest.values())
    assert evals.options['holdout'] == {**train.options['holdout'], 'side': 'eval'}
    assert train.options['holdout']['side'] == 'train' and train.options['holdout']['fraction'] == 0.05


def test_same_split_for_any_workers_chunking_and_order(records, by_ids, tmp_path):
    path = write_jsonl(tmp_path / 'in.jsonl', records)
    shuffled = records[:]
    random.Random(3).shuffle(shuffled)
    path2 = write_jsonl(tmp_path / 'shuffled.jsonl', shuffled)
    convert(path, tmp_path / 'a', '0.03', workers=1)
    convert(path, tmp_path / 'b', '0.03', workers=2, parallel='processes', chunk_bytes=32 << 10)
    convert(path2, tmp_path / 'c', '0.03', workers=2, parallel='threads', chunk_bytes=16 << 10)
    for side in ('eval', 'train'):
        a = read_rows(tmp_path / 'a' / side)
        b = read_rows(tmp_path / 'b' / side)
        assert len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
        assert side_records(tmp_path / 'c' / side, by_ids) == side_records(tmp_path / 'a' / side, by_ids)


def test_count_holds_out_the_smallest_hashes(records, by_ids, tmp_path):
    path = write_jsonl(tmp_path / 'in.jsonl', records)
    convert(path, tmp_path / 'out', '100', workers=2)
    cutoff = sorted(sha(r) for r in records)[99]
    held = Counter(key(r) for r in records if sha(r) <= cutoff)
    assert 100 <= sum(held.values()) <= 101  # one more only for a duplicate of the 100th
    assert side_records(tmp_path / 'out' / 'eval', by_ids) == held
    assert sum(side_records(tmp_path / 'out' / 'train', by_ids).values()) == len(records) - sum(held.values())


def test_columnar_inputs_hash_every_column(records, by_ids, tmp_path):
    """A parquet record is hashed whole (here with a column the conversion does not read), as a
    JSON line is: records equal in prompt and response but not in ``id`` are different records."""
    rows = [{'id': i, **r} for i, r in enumerate(records)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / 'in.parquet', row_group_size=200)
    convert(tmp_path / 'in.parquet', tmp_path / 'out', '10%', workers=2)
    held = [r for r in rows if sha(r) / 2 ** 256 < 0.1]
    plain = [{k: v for k, v in r.items() if k != 'id'} for r in held]
    assert side_records(tmp_path / 'out' / 'eval', by_ids) == Counter(key(r) for r in plain)
    assert Manifest.read(str(tmp_path / 'out' / 'train')).counts.documents_read == len(rows) - len(held)


def test_pretrain_eval_rows_are_the_held_out_documents(arxiv_jsonl, tmp_path):
    docs = read_jsonl(arxiv_jsonl)
    convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'out'),
                     PretrainOptions(max_seq_len=256, workers=2, holdout='3'))
    held = sorted(docs, key=sha)[:3]
    eos = tokenizer_info(load_tokenizer(DEMO_TOKENIZER)).eos_id
    stream = [t for d in docs if d in held for t in ids(DEMO_TOKENIZER, d['text']) + [eos]]
    rows = read_rows(tmp_path / 'out' / 'eval')
    assert np.concatenate([r['input_ids'] for r in rows]).tolist() == stream[:len(rows) * 256]
    m = Manifest.read(str(tmp_path / 'out' / 'eval'))
    assert m.counts.documents_read == 3 and m.counts.rows == len(stream) // 256
    assert Manifest.read(str(tmp_path / 'out' / 'train')).counts.documents_read == 17


@pytest.mark.parametrize('value, says', [
    ('0', 'above 0, below 1'), ('150%', 'above 0, below 1'), ('1.0', 'above 0, below 1'),
    ('0%', 'above 0, below 1'), ('-3', 'above 0, below 1'), ('half', 'above 0, below 1'),
    ('20', 'the inputs hold 20 readable documents'), ('500', 'the inputs hold 20 readable documents'),
])
def test_bad_values_are_refused_in_one_line(arxiv_jsonl, tmp_path, capsys, value, says):
    out = tmp_path / 'out'
    rc = main(['convert', 'pretrain', str(arxiv_jsonl), '--out', str(out), '--holdout', value, '--no-progress'])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f'--holdout {value}' in err[0] and says in err[0], err
    assert not out.exists()


def test_an_empty_eval_side_is_refused(arxiv_jsonl, tmp_path, capsys):
    docs = read_jsonl(arxiv_jsonl)
    fraction = min(sha(d) for d in docs) / 2 ** 256 / 2  # below every document's hash
    rc = main(['convert', 'pretrain', str(arxiv_jsonl), '--out', str(tmp_path / 'out'),
               '--holdout', repr(fraction), '--no-progress'])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and 'no documents fell in the eval split' in err[0], err
    assert not (tmp_path / 'out' / 'eval').exists() and not (tmp_path / 'out' / 'train').exists()


@pytest.fixture(scope='module')
def dolly_split(dolly_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp('split') / 'dolly'
    convert_finetune([str(dolly_jsonl)], str(out), FinetuneOptions(max_seq_len=256, workers=2, holdout='5%'))
    return out


@pytest.mark.parametrize('world, eval_batch, subset', [(1, 3, 8), (2, None, -1), (1, 5, -1)])
def test_plan_reports_the_batches_the_evaluator_reads(dolly_split, tmp_path, capsys, world, eval_batch, subset):
    """``plan``'s eval set against the real eval loader (the trainer's: the ``eval_loader``'s
    streams at the eval batch on each rank), counted batch by batch, and the rows in the index."""
    cfg = {'max_seq_len': 256, 'global_train_batch_size': 8, 'max_duration': '1ep',
           'train_loader': {'streams': {'dolly': {'local': str(dolly_split), 'split': 'train'}}},
           'eval_loader': {'streams': {'dolly_eval': {'local': str(dolly_split), 'split': 'eval'}}},
           'eval_subset_num_batches': subset}
    if eval_batch is not None:
        cfg['device_eval_batch_size'] = eval_batch
    path = tmp_path / 'c.yaml'
    path.write_text(yaml.safe_dump(cfg))
    assert main(['plan', str(path), '--json', '--world-size', str(world)]) == 0
    got = json.loads(capsys.readouterr().out)['eval']
    rows = len(read_rows(dolly_split / 'eval'))
    per_rank = eval_batch or 8 // world
    loader = StreamMixer(PlanConfig.from_dict(cfg).eval_loader, 'eval_loader').build_dataloader(
        batch_size=per_rank, world_size=world, rank=world - 1, rewind=True)
    sizes = [len(b['input_ids']) for b in loader]
    assert set(sizes) == {per_rank}
    batches = len(sizes) if subset < 0 else min(subset, len(sizes))
    assert got == {'rows': rows, 'rows_per_stream': {'dolly_eval': rows}, 'global_batch_size': per_rank * world,
                   'batches': batches, 'rows_evaluated': batches * per_rank * world,
                   'left_out_by_batches': rows - len(sizes) * per_rank * world,
                   'left_out_by_subset': (len(sizes) - batches) * per_rank * world}
    assert got['left_out_by_batches'] + got['left_out_by_subset'] > 0  # each case leaves some out
    assert main(['plan', str(path), '--world-size', str(world)]) == 0
    assert (f"eval: {rows} rows (dolly_eval {rows}) in global batches of {per_rank * world}: {batches} batches "
            f"per evaluation") in capsys.readouterr().out


def test_s3_out_gets_both_sides_as_two_prefixes(arxiv_jsonl, tmp_path):
    """``--out s3://bucket/p --keep-local DIR``: ``p/eval`` and ``p/train`` uploaded, ``DIR/eval``
    and ``DIR/train`` kept, each byte for byte the local conversion's side."""
    from helpers import moto_s3

    def files(directory):
        return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}

    options = dict(max_seq_len=256, workers=1, size_limit='16kb', holdout='0.2')
    convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'local'), PretrainOptions(**options))
    with moto_s3('fmx-holdout') as s3:
        convert_pretrain([str(arxiv_jsonl)], (str(tmp_path / 'kept'), 's3://fmx-holdout/p'),
                         PretrainOptions(**options))
        client = s3['client']
        for side in ('eval', 'train'):
            keys = [o['Key'] for o in client.list_objects_v2(Bucket='fmx-holdout', Prefix=f'p/{side}/')['Contents']]
            uploaded = {k.rsplit('/', 1)[1]: client.get_object(Bucket='fmx-holdout', Key=k)['Body'].read()
                        for k in keys}
            assert uploaded == files(tmp_path / 'local' / side) == files(tmp_path / 'kept' / side)
            assert len(uploaded) > 3  # several shards, index and manifest
