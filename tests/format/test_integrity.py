"""Damaged shards are named, not trained on: index checks, shard files vs index, row checks.

Real shards from the real converter, real damage to their bytes (see
``integrity_helpers``). For each kind of damage: what the cheap stat check
(``check_shard_files``) sees, and what the loader (``StreamMixer.build_dataloader``)
does -- raise :class:`CorruptRowError` / ``ShardFilesError`` naming stream, shard
file and row before the model sees a bad row. Bit flips that keep token ids valid are
the one damage only shard hashes can see (``foundrymix verify``, tests/tools/test_verify.py;
the loader hashes local shards before their first row, tests/loader/test_local_shard_hash.py).
The loader tests here turn that hash check off (``hash_local_shards: false``): it would
refuse every damaged shard first, and the row checks behind it are what they test.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from foundrymix.cli import main
from foundrymix.loader.cache import CorruptLocalShardError
from foundrymix.loader.storage import ShardPrepareError
from foundrymix.loader.mixer import StreamMixer
from foundrymix.format.schema import CorruptRowError
from foundrymix.format.schema import Manifest, check_row
from foundrymix.format.shards import (IndexFileError, ShardFilesError, ShardProblem, check_shard_files,
                               hashes_in_index, read_index, validate_hash_problem)
from foundrymix.config import ConfigError
from integrity_helpers import (HASHES, convert_paper, copy_stream, corrupt_offset, first_row_cut, strip_hashes,
                               first_row_of_shard, flip_bits, index_of, set_tokens_ff, shard_path,
                               token_bytes, truncate)

VOCAB = 8192  # the bundled foundrymix-bpe-8k


@pytest.fixture(scope='module')
def hashed(tmp_path_factory) -> Path:
    """The paper converted with xxh3_64 and sha1 recorded per shard (22 rows, shards of 13 + 9)."""
    return convert_paper(tmp_path_factory.mktemp('hashed') / 'arxiv', HASHES)


@pytest.fixture(scope='module')
def hashed_zstd(tmp_path_factory) -> Path:
    return convert_paper(tmp_path_factory.mktemp('hashed-zstd') / 'arxiv', HASHES, 'zstd')


@pytest.fixture
def streams(tmp_path, small_streams) -> dict[str, Path]:
    """A private copy of the small arxiv (pretrain) and dolly (finetune) streams, to damage."""
    return {name: copy_stream(src, tmp_path / name) for name, src in small_streams.items()}


def loader_cfg(paths: dict[str, Path], **extra) -> dict:
    """A loader over ``paths`` whose local shards are not hashed first (the row checks'
    tests; ``extra`` may turn the hashes back on)."""
    return {'streams': {name: {'local': str(p)} for name, p in paths.items()},
            'shuffle': False, 'num_workers': 0, 'hash_local_shards': False, **extra}


def read_all(cfg: dict, batch_size: int = 4, epochs: int = 1) -> list[dict]:
    loader = StreamMixer.from_dict(cfg).build_dataloader(batch_size, epochs=epochs)
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def rows_of(stream: Path) -> int:
    return Manifest.read(str(stream)).counts.rows


# ---------------------------------------------------------------- intact
def test_intact_streams_pass_every_check(streams, hashed):
    for stream in (*streams.values(), hashed):
        index = read_index(str(stream))
        assert len(index['shards']) >= 2
        assert check_shard_files(str(stream), index) == []
    assert hashes_in_index(index_of(hashed)) == set(HASHES)
    assert hashes_in_index(index_of(streams['arxiv'])) == {'xxh3_64'}  # the converter's default
    batches = read_all(loader_cfg(streams), batch_size=1)
    total = rows_of(streams['arxiv']) + rows_of(streams['dolly'])
    assert sorted(int(b['sample_id']) for b in batches) == list(range(total))


# ---------------------------------------------------------------- row checks
@pytest.mark.parametrize('change, problem', [
    (dict(input_ids=np.full(6, 3, np.uint16)), 'input_ids has 6 tokens, expected max_seq_len 8'),
    (dict(input_ids=np.array([1, 2, 8192, 4, 9000, 0, 0, 0], np.uint16)),
     'token id 9000 >= vocabulary size 8192 (first bad id 8192 at position 2)'),
    (dict(doc_lens=np.array([5, -1], np.int32)), 'negative document length in doc_lens [5, -1]'),
    (dict(doc_lens=np.array([5, 4], np.int32)), 'doc_lens [5, 4] sum to 9 > 8 tokens in the row'),
    (dict(loss_spans=np.array([0, 4, 6], np.int32)), 'loss_spans has odd length 3 [0, 4, 6]'),
    (dict(loss_spans=np.array([2, 9], np.int32)), 'loss span [2, 9) is outside 0 <= start <= end <= 8'),
    (dict(loss_spans=np.array([5, 4], np.int32)), 'loss span [5, 4) is outside 0 <= start <= end <= 8'),
    (dict(loss_spans=np.array([-1, 4], np.int32)), 'loss span [-1, 4) is outside 0 <= start <= end <= 8'),
])
def test_check_row_names_each_violation(change, problem):
    row = {'input_ids': np.arange(8, dtype=np.uint16), 'loss_spans': np.array([0, 3, 5, 8], np.int32),
           'doc_lens': np.array([5, 3], np.int32)}
    assert check_row(row, VOCAB, 8) is None
    assert check_row({**row, **change}, VOCAB, 8) == problem


def test_bit_flips_keeping_ids_valid_are_invisible_to_the_row_checks(streams):
    """Documented limit: a flipped bit that leaves a valid id is a valid row. Only hashes see
    it -- the loader's local shard hashes (on by default), or ``foundrymix verify``."""
    arxiv = streams['arxiv']
    old, new = flip_bits(arxiv, 1, 3, token=10)
    assert new < VOCAB and new != old
    assert check_shard_files(str(arxiv), read_index(str(arxiv))) == []  # same size
    batches = read_all(loader_cfg({'arxiv': arxiv}), batch_size=1)  # hashes off
    sample = first_row_of_shard(arxiv, 1) + 3
    got = next(b for b in batches if int(b['sample_id']) == sample)
    assert int(got['input_ids'][0, 10]) == new  # read, and trained on, without complaint
    with pytest.raises(CorruptLocalShardError, match=r"stream 'arxiv' .*shard file shard\.00001\.mds does not match"):
        read_all(loader_cfg({'arxiv': arxiv}, hash_local_shards=True))  # the default


# ---------------------------------------------------------------- the loader names bad rows
def test_ff_tokens_raise_named_error_before_the_model(streams):
    arxiv = streams['arxiv']
    set_tokens_ff(arxiv, 1, 4, token=7)
    with pytest.raises(CorruptRowError) as err:
        read_all(loader_cfg(streams))
    e = err.value
    assert (e.stream, e.shard, e.row, e.sample_id) == ('arxiv', 'shard.00001.mds', 4,
                                                       first_row_of_shard(arxiv, 1) + 4)
    assert e.problem == 'token id 65535 >= vocabulary size 8192 (first bad id 65535 at position 7)'
    assert str(e) == (f"corrupt row: stream 'arxiv' ({arxiv}), shard shard.00001.mds, row 4 "
                      f'(sample {e.sample_id}): {e.problem}')


def test_named_error_crosses_the_dataloader_worker(streams):
    """Through a worker process: torch re-raises as CorruptRowError(text); fields parse back."""
    dolly = streams['dolly']
    n_shards = len(index_of(dolly)['shards'])
    k = n_shards - 1
    set_tokens_ff(dolly, k, 0, token=0, count=1)
    with pytest.raises(CorruptRowError) as err:  # two epochs: rows an exact epoch cuts are read in the next
        read_all(loader_cfg(streams, num_workers=1), epochs=2)
    e = err.value
    sample = rows_of(streams['arxiv']) + first_row_of_shard(dolly, k)  # dolly is the second stream
    assert (e.stream, e.shard, e.row, e.sample_id) == ('dolly', f'shard.{k:05d}.mds', 0, sample)
    assert e.problem.startswith('token id 65535 >= vocabulary size 8192')
    assert 'Traceback' not in str(e)


def test_truncated_shard_named_by_size_check_and_by_the_loader(streams):
    arxiv = streams['arxiv']
    old, new = truncate(arxiv, 1, 300)
    path = shard_path(arxiv, 1)
    assert check_shard_files(str(arxiv), read_index(str(arxiv))) == [
        ShardProblem('shard.00001.mds', str(path), 'size', old, new)]
    with pytest.raises(ShardFilesError) as err:
        StreamMixer.from_dict(loader_cfg(streams)).build_dataloader(4)
    assert str(err.value).startswith(
        f"stream 'arxiv' ({arxiv}): 1 shard file(s) do not match index.json: {path}: "
        f'{new:,} bytes, index.json records {old:,} (truncated)')
    # Without the up-front check (e.g. a file cut after start-up) the row read names it.
    mixer = StreamMixer.from_dict(loader_cfg(streams))
    from foundrymix.loader.mixer import build_store
    infos = [mixer.info(n) for n in mixer.stream_names]  # read, not validated
    ds = build_store(mixer.config, infos)
    try:
        with pytest.raises(CorruptRowError) as err:
            for i in range(ds.num_samples):  # what the loader's workers do: rows by index
                ds.get_row(i)
    finally:
        ds.release()
    row = first_row_cut(arxiv, 1, new)
    assert (err.value.stream, err.value.shard, err.value.row) == ('arxiv', 'shard.00001.mds', row)
    assert err.value.sample_id == first_row_of_shard(arxiv, 1) + row
    assert err.value.problem.startswith('cannot read the row: RowBoundsError: offsets [')
    assert err.value.problem.endswith('(corrupt offsets or truncated shard)')


def test_corrupt_offsets_named_by_the_loader(streams):
    arxiv = streams['arxiv']
    corrupt_offset(arxiv, 0, 6)  # row 5 now "ends" and row 6 "begins" at byte 5, inside the offset table
    assert check_shard_files(str(arxiv), read_index(str(arxiv))) == []  # size unchanged
    with pytest.raises(CorruptRowError) as err:
        read_all(loader_cfg(streams))
    assert (err.value.stream, err.value.shard, err.value.row, err.value.sample_id) == (
        'arxiv', 'shard.00000.mds', 5, 5)
    assert err.value.problem.startswith('cannot read the row: RowBoundsError: offsets [')


def test_deleted_shard_named_before_reading(streams):
    dolly = streams['dolly']
    path = shard_path(dolly, 1)
    size = path.stat().st_size
    path.unlink()
    assert check_shard_files(str(dolly), read_index(str(dolly))) == [
        ShardProblem('shard.00001.mds', str(path), 'missing', size, None)]
    assert check_shard_files(str(dolly), read_index(str(dolly)), allow_missing=True) == []
    with pytest.raises(ShardFilesError) as err:
        StreamMixer.from_dict(loader_cfg(streams)).build_dataloader(4)
    assert str(err.value).startswith(
        f"stream 'dolly' ({dolly}): 1 shard file(s) do not match index.json: {path}: shard file "
        f'missing (index.json records {size:,} bytes)')


def test_inspect_decode_runs_the_row_checks(streams, capsys):
    arxiv = streams['arxiv']
    set_tokens_ff(arxiv, 0, 1, token=3)
    assert main(['inspect', str(arxiv), '--decode', '1']) == 0  # row 0 is intact
    capsys.readouterr()
    assert main(['inspect', str(arxiv), '--decode', '2']) == 2
    err = capsys.readouterr().err
    assert err == (f'foundrymix inspect: error: corrupt row: {arxiv}, shard shard.00000.mds, row 1 '
                   f'(sample 1): token id 65535 >= vocabulary size 8192 (first bad id 65535 at '
                   f'position 3)\n')


# ---------------------------------------------------------------- index.json
@pytest.mark.parametrize('text, message', [
    ('{"version": 2, "shards": [', 'not valid JSON'),
    ('{"version": 1, "shards": []}', 'streaming index version 1, expected 2'),
    ('{"version": 2}', 'no "shards" list'),
    ('[]', 'expected a JSON object, found list'),
])
def test_read_index_names_the_file(tmp_path, text, message):
    (tmp_path / 'index.json').write_text(text)
    with pytest.raises(IndexFileError) as err:
        read_index(str(tmp_path))
    assert str(err.value).startswith(f'{tmp_path / "index.json"}: ')
    assert message in str(err.value)


def test_read_index_names_the_bad_shard_entry(streams):
    arxiv = streams['arxiv']
    index = index_of(arxiv)
    del index['shards'][1]['raw_data']['bytes']
    (arxiv / 'index.json').write_text(json.dumps(index))
    with pytest.raises(IndexFileError, match=re.escape(
            f'{arxiv / "index.json"}: shard 1: "raw_data" must be')):
        read_index(str(arxiv))
    (arxiv / 'index.json').unlink()
    with pytest.raises(IndexFileError, match='no index.json'):
        read_index(str(arxiv))


# ---------------------------------------------------------------- validate_hash
def test_validate_hash_problem_names_stream_and_recorded_algorithms(streams, hashed):
    assert validate_hash_problem('web', index_of(hashed), 'xxh3_64') is None
    assert validate_hash_problem('web', index_of(hashed), None) is None
    assert validate_hash_problem('web', index_of(hashed), 'md5') == (
        "stream 'web': validate_hash 'md5' is not recorded in its index.json (hashes recorded for "
        "every shard: sha1, xxh3_64); streaming would fail when it fetches a shard. Use one of "
        "those, or drop validate_hash")
    assert 'hashes recorded for every shard: none (converted without shard hashes)' in \
        validate_hash_problem('web', index_of(strip_hashes(streams['arxiv'])), 'sha1')
    assert validate_hash_problem('web', index_of(hashed), 'nohash') == (
        "validate_hash 'nohash' is not a hash algorithm streaming knows")


def test_streaming_validate_hash_checks_only_fetched_or_decompressed_shards(tmp_path, streams, hashed_zstd):
    """validate_hash on local streams: an uncompressed shard is hashed at first open, a
    compressed one's zip before it is unpacked (into the cache); failures name the shard.
    (streaming 0.13 hashed only what it downloaded or decompressed, in a background thread
    whose failure used to end the epoch silently with 0 batches.)
    """
    from foundrymix.loader.cache import CorruptLocalShardError
    flip_bits(streams['arxiv'], 1, 3, token=10)
    with pytest.raises(CorruptLocalShardError, match=r"shard file shard\.00001\.mds does not match"):
        read_all(loader_cfg({'arxiv': streams['arxiv']}, validate_hash='xxh3_64'), batch_size=1)

    # An algorithm the index does not record is refused before any shard is read (streaming
    # itself would fail in its background thread, which ended the epoch silently).
    zstd = copy_stream(hashed_zstd, tmp_path / 'z1')
    with pytest.raises(ConfigError) as err:
        read_all(loader_cfg({'arxiv': zstd}, validate_hash='md5', num_workers=1))
    assert str(err.value) == (
        "train_loader.validate_hash: stream 'arxiv': validate_hash 'md5' is not recorded in its "
        "index.json (hashes recorded for every shard: sha1, xxh3_64); streaming would fail when "
        "it fetches a shard. Use one of those, or drop validate_hash")

    # A damaged zip: named before it is unpacked, and the user's directory left as it was.

    zstd = copy_stream(hashed_zstd, tmp_path / 'z2')
    zip_path = zstd / 'shard.00001.mds.zstd'
    data = bytearray(zip_path.read_bytes())
    data[100] ^= 0x10
    zip_path.write_bytes(bytes(data))
    before = sorted(os.listdir(zstd))
    with pytest.raises(ShardPrepareError) as err:
        read_all(loader_cfg({'arxiv': zstd}, validate_hash='xxh3_64'))
    assert re.search(
        rf"stream 'arxiv' \(.*\), shard shard\.00001\.mds: {re.escape(str(zip_path))} does not "
        rf"match the xxh3_64 hash its index.json records", str(err.value))
    assert sorted(os.listdir(zstd)) == before
    # intact compressed stream with a recorded algorithm: every row, no error
    batches = read_all(loader_cfg({'arxiv': copy_stream(hashed_zstd, tmp_path / 'z3')},
                                  validate_hash='xxh3_64'), batch_size=1)
    assert sum(len(b['sample_id']) for b in batches) == 22


def test_token_bytes_helper_finds_the_tokens(streams):
    """The damage helpers hit the tokens: the bytes at token_bytes() are the row's input_ids."""
    from streaming import LocalDataset
    arxiv = streams['arxiv']
    start, end = token_bytes(arxiv, 1, 3)
    stored = np.frombuffer(shard_path(arxiv, 1).read_bytes()[start:end], np.uint16)
    row = LocalDataset(local=str(arxiv))[first_row_of_shard(arxiv, 1) + 3]
    assert np.array_equal(stored, row['input_ids'])


def test_training_stops_on_the_named_row(tmp_path, streams, capsys):
    """The bug as reported: training on 0xFF tokens died in the embedding (IndexError, no
    stream or shard named). Now ``foundrymix train`` stops with the row named (DataLoader
    worker included) and no traceback. By default the shard's hash refuses it first, when
    the shard is first opened (in the worker), naming the stream and shard file."""
    pytest.importorskip('composer')  # it trains: the composer extra (scripts/test_core.sh has none)
    import yaml

    from helpers import tiny_run_config
    arxiv = streams['arxiv']
    set_tokens_ff(arxiv, 1, 4, token=7)
    cfg = tiny_run_config({'streams': {'arxiv': {'local': str(arxiv)}}, 'num_workers': 1},
                          run_name='corrupt', global_train_batch_size=2, max_duration='20ba',
                          save_folder=str(tmp_path / 'ckpt'))
    (tmp_path / 'c.yaml').write_text(yaml.safe_dump(cfg), encoding='utf-8')
    assert main(['train', str(tmp_path / 'c.yaml')]) == 2
    err = capsys.readouterr().err
    assert err.endswith(
        f"foundrymix train: error: stream 'arxiv' ({arxiv}): shard file shard.00001.mds does not "
        f'match the xxh3_64 hash its index.json records: the bytes changed after conversion (a '
        f'damaged copy or disk); no row of it was read. Re-copy the stream from where it came '
        f'from, or re-run `foundrymix convert` into {arxiv} with --overwrite; `foundrymix verify '
        f'{arxiv}` checks every shard\n')
    assert 'Traceback' not in err

    cfg['train_loader']['hash_local_shards'] = False  # the row check behind it
    (tmp_path / 'c.yaml').write_text(yaml.safe_dump(cfg), encoding='utf-8')
    assert main(['train', str(tmp_path / 'c.yaml')]) == 2
    err = capsys.readouterr().err
    assert err.endswith(
        f"foundrymix train: error: corrupt row: stream 'arxiv' ({arxiv}), shard shard.00001.mds, "
        f'row 4 (sample 17): token id 65535 >= vocabulary size 8192 (first bad id 65535 at '
        f'position 7)\n')
    assert 'Traceback' not in err and 'IndexError' not in err
