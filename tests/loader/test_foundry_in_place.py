"""LLM-Foundry token shards used in place (a stream with only ``local:`` and ``tokenizer:``).

The shards are written as LLM-Foundry's ``convert_dataset_json`` writes them (documents
tokenized, an EOS after each, concatenated, cut into rows of ``concat_tokens``; one ``tokens``
column, ``ndarray:int32``). Checked against an independent source: ``foundrymix adopt`` of
the same directory (the converter path, itself tested against LLM-Foundry's own rows) gives,
row for row, the rows the loader reads in place; the plan's counts are the rows written;
nothing is written into the user's directory; rows of another length are refused.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import DEMO_TOKENIZER, SAMPLES

from foundrymix.cli import main
from foundrymix.config import ConfigError
from foundrymix.loader.mixer import StreamMixer

SEQ = 128
pytestmark = pytest.mark.filterwarnings('ignore')


def write_foundry(out, size_limit: int = 20_000, cut_last: bool = False, compression=None) -> int:
    """Six arXiv papers' starts as LLM-Foundry writes them (``ConcatTokensDataset`` rows of
    ``SEQ`` with ``--eos_text '<|endoftext|>'``: tests/foundry_fixtures.py); returns the rows."""
    from foundry_fixtures import concat_tokens, write_foundry_pretrain

    with open(SAMPLES / 'arxiv_sample.jsonl', encoding='utf-8') as f:
        texts = [json.loads(line)['text'][:6000] for line in list(f)[:6]]
    rows = concat_tokens(texts, DEMO_TOKENIZER, SEQ, eos_text='<|endoftext|>')
    if cut_last:
        rows[-1] = rows[-1][:-5]
    write_foundry_pretrain(out, rows, compression=compression, size_limit=size_limit)
    return len(rows)


def listing(directory) -> dict[str, tuple[int, int]]:
    return {p: (os.stat(os.path.join(directory, p)).st_size, os.stat(os.path.join(directory, p)).st_mtime_ns)
            for p in sorted(os.listdir(directory))}


def test_foundry_tokens_read_in_place_equal_adopts_rows(tmp_path, capsys):
    src = tmp_path / 'foundry'
    n = write_foundry(src, compression='zstd')  # LLM-Foundry's default compression
    before = listing(src)
    assert len([p for p in before if p.endswith('.mds.zstd')]) > 2
    mixer = StreamMixer.from_dict({'streams': {'c4': {'local': str(src), 'tokenizer': DEMO_TOKENIZER}},
                                   'shuffle': False, 'num_workers': 0})
    plan = mixer.plan(4, '1ep')
    [stream] = plan.streams
    assert (stream.rows, stream.rows_per_epoch) == (n, n - n % 4)
    assert mixer.max_seq_len == SEQ
    store = mixer.build_store()
    in_place = [store.get_row(i) for i in range(n)]
    # the converter's reading of the same shards, into a dataset of its own
    assert main(['adopt', str(src), '--out', str(tmp_path / 'adopted'), '--tokenizer', DEMO_TOKENIZER]) == 0
    capsys.readouterr()
    adopted = StreamMixer.from_dict({'streams': {'a': {'local': str(tmp_path / 'adopted')}}}).build_store()
    assert len(adopted) == n
    for i in range(n):
        want = adopted.get_row(i)
        assert in_place[i]['input_ids'].tolist() == want['input_ids'].tolist(), i
        assert in_place[i]['doc_lens'].tolist() == want['doc_lens'].tolist(), i
        assert in_place[i]['loss_spans'].tolist() == want['loss_spans'].tolist(), i
    assert sum(len(r['doc_lens']) for r in in_place) > n  # documents were found (EOS), not one per row
    # an epoch through the loader trains the plan's rows, each once
    loader = mixer.build_dataloader(4)
    seen = [int(s) for b in loader for s in b['sample_id']]
    loader.release()
    assert sorted(seen) == list(range(n - n % 4))
    store.release()
    adopted.release()
    assert listing(src) == before  # nothing written into the user's directory


def test_foundry_tokens_need_the_tokenizer_and_rows_of_one_length(tmp_path):
    src = tmp_path / 'foundry'
    write_foundry(src)
    with pytest.raises(ConfigError, match=r'train_loader.streams.c4: LLM-Foundry token shards .* give the '
                                          r'tokenizer they were made with, train_loader.streams.c4.tokenizer'):
        StreamMixer.from_dict({'streams': {'c4': {'local': str(src)}}}).validate()
    uneven = tmp_path / 'uneven'
    write_foundry(uneven, cut_last=True)
    last = sorted(p for p in os.listdir(uneven) if p.endswith('.mds'))[-1]
    with pytest.raises(ConfigError, match=f"train_loader.streams.c4: {last}: rows of another length than "
                                          f"shard 0's {SEQ} tokens"):
        StreamMixer.from_dict({'streams': {'c4': {'local': str(uneven), 'tokenizer': DEMO_TOKENIZER}}}).validate()


@pytest.mark.parametrize('where', ['stream', 'loader'])
def test_foundry_tokens_on_s3_are_read_in_place_as_the_local_copy(tmp_path, where):
    """The same shards uploaded to a real S3 endpoint (moto on 127.0.0.1): the plan fetches
    index.json and shard 0, and every row equals the local one."""
    from helpers import moto_s3

    src = tmp_path / 'foundry'
    n = write_foundry(src)
    local = StreamMixer.from_dict({'streams': {'c4': {'local': str(src), 'tokenizer': DEMO_TOKENIZER}}})
    want = [local.build_store().get_row(i)['input_ids'].tolist() for i in range(n)]
    with moto_s3('fmx-foundry') as s3:
        for f in sorted(src.iterdir()):
            s3['client'].upload_file(str(f), 'fmx-foundry', f'c4/{f.name}')
        stream = {'remote': 's3://fmx-foundry/c4'}
        loader = {'cache_root': str(tmp_path / 'cache')}
        # the stream's own tokenizer: no foundrymix.json asked for; the loader's: asked, not found
        (stream if where == 'stream' else loader)['tokenizer'] = DEMO_TOKENIZER
        remote = StreamMixer.from_dict({'streams': {'c4': stream}, **loader})
        plan = remote.plan(4, '1ep')
        assert plan.streams[0].rows == n and plan.max_seq_len == SEQ
        store = remote.build_store()
        assert [store.get_row(i)['input_ids'].tolist() for i in range(n)] == want
        store.release()


def test_a_training_yaml_with_only_local_and_its_tokenizer_plans_and_says_what_it_read(tmp_path, capsys):
    """As a migrated LLM-Foundry YAML has it: the top-level tokenizer, the stream only local:."""
    import yaml

    src = tmp_path / 'foundry'
    n = write_foundry(src)
    cfg = {'max_seq_len': SEQ, 'tokenizer': DEMO_TOKENIZER, 'global_train_batch_size': 4, 'max_duration': '1ep',
           'train_loader': {'streams': {'c4': {'local': str(src)}}}}
    (tmp_path / 'c.yaml').write_text(yaml.safe_dump(cfg))
    assert main(['plan', str(tmp_path / 'c.yaml')]) == 0
    out = ' '.join(capsys.readouterr().out.split())  # the table wraps long lines
    assert (f'c4: LLM-Foundry token shards read in place (tokens: int32, rows of {SEQ}, tokenizer '
            f'{DEMO_TOKENIZER}); documents end after each EOS (id 0); nothing is written into {src}') in out
    assert f'rows trained per stream over the run: c4 {n - n % 4:,}' in out


def test_remote_and_local_plan_says_local_is_the_download_cache_and_it_is(tmp_path, capsys):
    """``remote:`` + ``local:`` as in Foundry: ``local`` is where the files are downloaded, and
    the plan says so -- not that nothing is written there, in the call that writes index.json."""
    import yaml

    from helpers import moto_s3
    src, local = tmp_path / 'foundry', tmp_path / 'local'
    n = write_foundry(src)
    with moto_s3('fmx-foundry-local') as s3:
        for f in sorted(src.iterdir()):
            s3['client'].upload_file(str(f), 'fmx-foundry-local', f'c4/{f.name}')
        cfg = {'max_seq_len': SEQ, 'tokenizer': DEMO_TOKENIZER, 'global_train_batch_size': 4,
               'max_duration': '1ep', 'train_loader': {
                   'cache_root': str(tmp_path / 'cache'),
                   'streams': {'c4': {'remote': 's3://fmx-foundry-local/c4', 'local': str(local)}}}}
        (tmp_path / 'c.yaml').write_text(yaml.safe_dump(cfg))
        assert main(['plan', str(tmp_path / 'c.yaml')]) == 0
    out = ' '.join(capsys.readouterr().out.split())
    assert 'nothing is written into' not in out
    assert (f'c4: LLM-Foundry token shards read in place (tokens: int32, rows of {SEQ}, tokenizer '
            f'{DEMO_TOKENIZER}); documents end after each EOS (id 0); s3://fmx-foundry-local/c4 is read; its '
            f'files are downloaded into {local} (the download cache, as LLM-Foundry uses local:)') in out
    assert (local / 'index.json').is_file()  # what the sentence says
    assert f'c4 {n - n % 4:,}' in out
