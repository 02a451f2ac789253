"""A damaged shard of a remote stream is never trained on, not even by the next run.

Against a real S3 endpoint (moto's server on 127.0.0.1), real converted shards and real
damage to their bytes (``integrity_helpers``). The harm was in the *rerun*: streaming
0.13 checks ``validate_hash`` only right after a download and leaves a file that fails it
in the cache, and counts any cached file as present -- so the same command run again
(after a pre-emption) exited 0 having trained the damaged rows. The loader now hashes
every shard file when first opened. Checked here:

* a shard that is damaged in the remote: the run stops naming stream, shard, remote URL
  and what to do, and the cache no longer holds it; the advice followed (``foundrymix
  verify s3://...``, ``foundrymix convert ... --out s3://... --overwrite``), the same
  command run again reads exactly the good rows (two real processes);
* a cached shard changed in place (same size) with ``validate_hash`` and without it (the
  hash the converter records), and one truncated: the next run removes it, says so,
  downloads it again and reads exactly the good rows.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cache_reader
from foundrymix.cli import main
from foundrymix.loader.storage import CorruptShardError
from foundrymix.loader.mixer import StreamMixer
from helpers import ROOT, SMALL_SEQ, moto_s3
from integrity_helpers import convert_paper, flip_bits, index_of, shard_path, truncate

BUCKET = 'fmx-cache-integrity'
BATCH = 4
METADATA = ['foundrymix.json', 'index.json']
CONVERT_OPTIONS = ['--max-seq-len', str(SMALL_SEQ), '--workers', '1', '--size-limit', '4kb']


@pytest.fixture(scope='module')
def s3():
    with moto_s3(BUCKET) as server:
        yield server


@pytest.fixture(scope='module')
def good(tmp_path_factory) -> Path:
    """The paper converted by the real converter (xxh3_64 recorded): shards of 13 + 9 rows."""
    return convert_paper(tmp_path_factory.mktemp('good') / 'arxiv')


@pytest.fixture(scope='module')
def good_zstd(tmp_path_factory) -> Path:
    return convert_paper(tmp_path_factory.mktemp('good-zstd') / 'arxiv', compression='zstd')


def upload(s3, directory: Path, prefix: str) -> str:
    for f in sorted(directory.iterdir()):
        s3['client'].upload_file(str(f), BUCKET, f'{prefix}/{f.name}')
    return f's3://{BUCKET}/{prefix}'


def cfg(stream: dict, **knobs) -> dict:
    return {'streams': {'ds': stream}, 'shuffle': True, 'shuffle_seed': 5, 'num_workers': 0, **knobs}


def read(config: dict) -> dict:
    """One epoch, in this process: sample ids per batch and a sha256 of every batch tensor."""
    loader = StreamMixer.from_dict(config).build_dataloader(batch_size=BATCH)
    try:
        return cache_reader.summary(loader)
    finally:
        dataset = loader.storage
        del loader
        gc.collect()
        dataset.release()


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def assert_only_good_shards(stream_dir: Path, good: Path) -> None:
    """The cache holds the metadata, no copy of the damaged shard 1, and any other shard
    byte-equal to the good one."""
    names = listing(stream_dir)
    assert [n for n in names if not n.startswith('shard.')] == METADATA, names
    assert 'shard.00001.mds' not in names, names
    for n in names:
        if n.startswith('shard.'):
            assert (stream_dir / n).read_bytes() == (good / n).read_bytes(), n


def run_reader(tmp_path: Path, name: str, config: dict, env: dict) -> subprocess.CompletedProcess:
    """``python tests/cache_reader.py SPEC`` -- one real run of the loader."""
    spec = tmp_path / f'{name}.json'
    spec.write_text(json.dumps({'loader': config, 'batch': BATCH, 'out': str(tmp_path / f'{name}.out')}))
    return subprocess.run([sys.executable, str(ROOT / 'tests' / 'cache_reader.py'), str(spec)],
                          env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # four real loader processes (~30 s under load)
def test_shard_damaged_in_the_remote_is_removed_named_and_read_right_after_reupload(
        tmp_path, s3, good, monkeypatch, capsys):
    bad = shutil.copytree(good, tmp_path / 'bad')
    flip_bits(bad, 1, 2, token=10)  # a valid token id, just the wrong one: only the hash sees it
    assert shard_path(bad, 1).stat().st_size == shard_path(good, 1).stat().st_size
    url = upload(s3, bad, 'damaged')
    cache = tmp_path / 'cache'
    config = cfg({'remote': url}, cache_root=str(cache), validate_hash='xxh3_64')
    stream_dir = Path(StreamMixer.from_dict(config).config.stream_dir('ds'))
    want = read(cfg({'local': str(good)}))
    # the flip shows in a batch (read with the local shard hashes off: they refuse it)
    assert read(cfg({'local': str(bad)}, hash_local_shards=False))['sha256'] != want['sha256']
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1')

    # Run 1: stops, naming the shard and what to do; the damaged copy is gone from the cache.
    first = run_reader(tmp_path, 'run1', config, env)
    assert first.returncode != 0
    message = (
        f"foundrymix.loader.storage.CorruptShardError: stream 'ds' ({stream_dir}), shard shard.00001.mds: {url}/shard.00001.mds "
        f'does not match the xxh3_64 hash its index.json records: the shard in the remote is damaged '
        f'(or was replaced without its index.json). Removed it from the cache '
        f'({stream_dir}/shard.00001.mds). Re-upload the shard: re-run `foundrymix convert` on the '
        f'same inputs with `--out {url} --overwrite`; `foundrymix verify {url}` checks every shard '
        f'of the remote')
    assert first.stderr.splitlines()[-1] == message, first.stderr[-3000:]
    assert 'transient' not in first.stderr
    # the damaged copy is gone; shard 0 (good) may be there too, read before shard 1
    assert_only_good_shards(stream_dir, good)

    # The same command again, remote not fixed yet: the same error, never the damaged rows.
    again = run_reader(tmp_path, 'run1b', config, env)
    assert again.stderr.splitlines()[-1] == message, again.stderr[-3000:]
    assert_only_good_shards(stream_dir, good)

    # The advice, followed: verify names the shard, convert --overwrite re-uploads, verify passes.
    capsys.readouterr()
    assert main(['verify', url]) == 1
    out = capsys.readouterr().out
    assert f'{url}/shard.00001.mds: xxh3_64 hash ' in out and 'does not match' in out
    paper = good.parent / 'paper.jsonl'  # the input convert_paper converted
    assert main(['convert', 'pretrain', str(paper), '--out', url, '--overwrite', *CONVERT_OPTIONS]) == 0
    assert main(['verify', url]) == 0

    # Run 2, the same command: exactly the good rows.
    second = run_reader(tmp_path, 'run2', config, env)
    assert second.returncode == 0, second.stderr[-3000:]
    got = json.loads((tmp_path / 'run2.out').read_text())
    assert got['sample_ids'] == want['sample_ids'] and got['sha256'] == want['sha256']
    assert shard_path(stream_dir, 1).read_bytes() == shard_path(good, 1).read_bytes()


def test_compressed_shard_damaged_in_the_remote_is_named_from_a_worker(tmp_path, s3, good_zstd):
    """The compressed file is hashed before it is unpacked; the error crosses a DataLoader worker."""
    bad = shutil.copytree(good_zstd, tmp_path / 'bad')
    zip_name = index_of(bad)['shards'][1]['zip_data']['basename']
    data = bytearray((bad / zip_name).read_bytes())
    data[100] ^= 0x10
    (bad / zip_name).write_bytes(bytes(data))
    url = upload(s3, bad, 'damaged-zstd')
    config = cfg({'remote': url}, cache_root=str(tmp_path / 'cache'), validate_hash='xxh3_64',
                 num_workers=1)
    stream_dir = Path(StreamMixer.from_dict(config).config.stream_dir('ds'))
    with pytest.raises(CorruptShardError) as err:
        read(config)
    assert str(err.value).startswith(
        f"stream 'ds' ({stream_dir}), shard shard.00001.mds: {url}/{zip_name} does not match the "
        f'xxh3_64 hash its index.json records: the shard in the remote is damaged (or was replaced '
        f'without its index.json). Removed it from the cache ({stream_dir}/{zip_name}). ')
    assert 'shard.00001.mds' not in listing(stream_dir) and zip_name not in listing(stream_dir)


def test_compressed_shard_damaged_in_a_local_stream_is_named_as_local_and_left_in_place(tmp_path, good_zstd):
    """A local zstd stream's damaged file is the user's: named as the local stream's (not a
    remote to re-upload to), with the local fixes, and not removed."""
    bad = shutil.copytree(good_zstd, tmp_path / 'bad')
    zip_name = index_of(bad)['shards'][1]['zip_data']['basename']
    data = bytearray((bad / zip_name).read_bytes())
    data[100] ^= 0x10
    (bad / zip_name).write_bytes(bytes(data))
    with pytest.raises(CorruptShardError) as err:
        read(cfg({'local': str(bad)}, cache_root=str(tmp_path / 'cache'), validate_hash='xxh3_64'))
    assert f'shard shard.00001.mds: {bad}/{zip_name} does not match the xxh3_64 hash its index.json ' \
           f'records: the shard in the local stream is damaged (or was replaced without its index.json). ' \
           f'Nothing of it was unpacked or used (the file is left as it is). Restore the file from a ' \
           f'good copy of the stream, or re-convert: re-run `foundrymix convert` on the same inputs ' \
           f'with `--out {bad} --overwrite`; `foundrymix verify {bad}` checks every shard of the local ' \
           f'stream' in str(err.value)
    assert 'remote' not in str(err.value) and 'upload' not in str(err.value)
    assert (bad / zip_name).read_bytes() == bytes(data)


@pytest.mark.parametrize('knobs', [{'validate_hash': 'xxh3_64'}, {}])
def test_cached_shard_changed_in_place_is_hashed_removed_and_downloaded_again(
        tmp_path, s3, good, caplog, knobs):
    """With validate_hash and without it (issue 39: the cache served a flipped bit when
    validate_hash was not set): the hash index.json records is checked at first open."""
    url = upload(s3, good, 'flip-cached')
    config = cfg({'remote': url}, cache_root=str(tmp_path / 'cache'), **knobs)
    want = read(cfg({'local': str(good)}))
    assert read(config) == want
    stream_dir = Path(StreamMixer.from_dict(config).config.stream_dir('ds'))
    assert listing(stream_dir) == METADATA + ['shard.00000.mds', 'shard.00001.mds']

    flip_bits(stream_dir, 1, 2, token=10)  # same size: only the hash can tell
    cached = shard_path(stream_dir, 1)
    with caplog.at_level(logging.WARNING, logger='foundrymix.loader'):
        got = read(config)
    assert [r.getMessage() for r in caplog.records] == [
        f"stream 'ds': cached shard file {cached}: its xxh3_64 hash does not match the one "
        f'index.json records; removed it ({cached}), it is downloaded again when needed']
    assert got == want
    assert cached.read_bytes() == shard_path(good, 1).read_bytes()


def test_cached_shard_truncated_is_removed_and_downloaded_again(tmp_path, s3, good, caplog):
    """No validate_hash: the size index.json records is still checked, and the shard fetched again."""
    url = upload(s3, good, 'cut-cached')
    config = cfg({'remote': url}, cache_root=str(tmp_path / 'cache'))
    want = read(cfg({'local': str(good)}))
    assert read(config) == want
    stream_dir = Path(StreamMixer.from_dict(config).config.stream_dir('ds'))
    old, new = truncate(stream_dir, 0, 100)
    cached = shard_path(stream_dir, 0)
    with caplog.at_level(logging.WARNING, logger='foundrymix.loader'):
        got = read(config)
    assert [r.getMessage() for r in caplog.records] == [
        f"stream 'ds': cached shard file {cached}: {new:,} bytes, index.json records {old:,}; "
        f'removed it ({cached}), it is downloaded again when needed']
    assert got == want
    assert cached.read_bytes() == shard_path(good, 0).read_bytes()
