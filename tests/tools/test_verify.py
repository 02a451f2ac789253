"""``foundrymix verify``: intact output passes (exit 0), each kind of damage is named (exit 1).

Real converted shards (with and without recorded hashes, plain and zstd), real damage to
their bytes (``integrity_helpers``), local and through an S3 endpoint (moto's server on
127.0.0.1, as tests/s3/test_s3.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from foundrymix.cli import main
from helpers import moto_s3
from integrity_helpers import (HASHES, convert_paper, copy_stream, corrupt_offset, first_row_cut, strip_hashes,
                               first_row_of_shard, flip_bits, index_of, set_tokens_ff, shard_path,
                               truncate)

BUCKET = 'fmx-verify'


@pytest.fixture(scope='module')
def hashed(tmp_path_factory) -> Path:
    """The paper converted with sha1 and xxh3_64 recorded per shard (22 rows: shards of 13 + 9)."""
    return convert_paper(tmp_path_factory.mktemp('hashed') / 'arxiv', HASHES)


@pytest.fixture(scope='module')
def hashed_zstd(tmp_path_factory) -> Path:
    return convert_paper(tmp_path_factory.mktemp('hashed-zstd') / 'arxiv', HASHES, 'zstd')


def run_json(capsys, location) -> tuple[int, dict]:
    code = main(['verify', str(location), '--json'])
    return code, json.loads(capsys.readouterr().out)


def shard_line(text: str, shard: str) -> list[str]:
    """Cells of the table line of ``shard``."""
    line = next(ln for ln in text.splitlines() if f' {shard} ' in ln)
    return [c.strip() for c in line.strip('│ ').split('│')]


def test_intact_with_hashes_exit_0_with_table(capsys, hashed):
    assert main(['verify', str(hashed)]) == 0
    out = capsys.readouterr().out
    sizes = [s['raw_data']['bytes'] for s in index_of(hashed)['shards']]
    assert shard_line(out, 'shard.00000.mds') == ['shard.00000.mds', '13', f'{sizes[0]:,}',
                                                  'ok (sha1, xxh3_64)', '0', 'ok']
    assert shard_line(out, 'shard.00001.mds') == ['shard.00001.mds', '9', f'{sizes[1]:,}',
                                                  'ok (sha1, xxh3_64)', '0', 'ok']
    assert 'verdict: INTACT -- 2 shards, 22 rows, 2,816 tokens, 2,816 loss tokens, as the manifest ' \
           'records\n' in out
    code, report = run_json(capsys, hashed)
    assert code == 0 and report['intact'] and report['hashes_recorded']
    assert report['found'] == report['expected'] == {'rows': 22, 'tokens': 2816, 'loss_tokens': 2816}


def test_intact_without_hashes_says_so(capsys, tmp_path, small_streams):
    dolly = strip_hashes(copy_stream(small_streams['dolly'], tmp_path / 'dolly'))
    assert main(['verify', str(dolly)]) == 0
    out = capsys.readouterr().out
    n = len(index_of(dolly)['shards'])
    assert all(shard_line(out, f'shard.{k:05d}.mds')[3] == 'no hashes recorded' for k in range(n))
    assert 'no hashes recorded, so bit flips that keep token ids below the vocabulary size cannot ' \
           'be detected' in out


def test_bit_flips_found_only_by_hashes(capsys, tmp_path, hashed, small_streams):
    damaged = copy_stream(hashed, tmp_path / 'h')
    flip_bits(damaged, 1, 3, token=10)
    code, report = run_json(capsys, damaged)
    assert code == 1 and report['verdict'] == 'corrupt'
    first, second = report['shards']
    assert first['verdict'] == 'ok'
    assert (second['verdict'], second['hash_status'], second['bad_rows'], second['rows_ok']) == (
        'corrupt', 'MISMATCH (sha1, xxh3_64)', 0, 9)  # every row still decodes and passes
    assert [p.split(' hash ')[0] for p in second['problems']] == [
        f'{damaged / "shard.00001.mds"}: sha1', f'{damaged / "shard.00001.mds"}: xxh3_64']
    # Without hashes the same flip is a valid row: verify cannot see it (documented limit).
    plain = strip_hashes(copy_stream(small_streams['arxiv'], tmp_path / 'p'))
    flip_bits(plain, 1, 3, token=10)
    assert main(['verify', str(plain)]) == 0
    assert 'no hashes recorded' in capsys.readouterr().out


def test_ff_tokens_named_by_shard_and_row(capsys, tmp_path, hashed):
    damaged = copy_stream(hashed, tmp_path / 'h')
    set_tokens_ff(damaged, 1, 4, token=7)
    assert main(['verify', str(damaged)]) == 1
    out = capsys.readouterr().out
    assert shard_line(out, 'shard.00001.mds') == [
        'shard.00001.mds', '8 / 9', f'{index_of(damaged)["shards"][1]["raw_data"]["bytes"]:,}',
        'MISMATCH (sha1, xxh3_64)', '1', 'corrupt']
    assert shard_line(out, 'shard.00000.mds')[-1] == 'ok'
    sample = first_row_of_shard(damaged, 1) + 4
    assert (f'  corrupt row: {damaged}, shard shard.00001.mds, row 4 (sample {sample}): token id '
            f'65535 >= vocabulary size 8192 (first bad id 65535 at position 7)\n') in out
    assert '  21 intact rows, foundrymix.json records 22\n' in out
    assert 'verdict: CORRUPT -- 1 of 2 shards damaged: shard.00001.mds (corrupt); totals differ ' \
           'from the manifest' in out


def test_truncated_shard(capsys, tmp_path, hashed):
    damaged = copy_stream(hashed, tmp_path / 'h')
    old, new = truncate(damaged, 1, 300)
    cut = first_row_cut(damaged, 1, new)
    code, report = run_json(capsys, damaged)
    assert code == 1
    shard = report['shards'][1]
    assert (shard['file'], shard['verdict'], shard['bytes_found'], shard['bytes_expected']) == (
        'shard.00001.mds', 'corrupt', new, old)
    assert shard['bad_rows'] == 9 - cut and shard['rows_ok'] == cut
    path = damaged / 'shard.00001.mds'
    assert shard['problems'][0] == f'{path}: {new:,} bytes, index.json records {old:,} (truncated)'
    assert f'{path}: last row ends at byte {old:,}, the shard has {new:,} bytes' in shard['problems']
    assert shard['problems'][-(9 - cut)].startswith(
        f'corrupt row: {damaged}, shard shard.00001.mds, row {cut} (sample {13 + cut}): ')
    assert report['shards'][0]['verdict'] == 'ok'


def test_corrupt_offsets(capsys, tmp_path, hashed):
    damaged = copy_stream(hashed, tmp_path / 'h')
    corrupt_offset(damaged, 0, 6)  # end of row 5 / start of row 6
    code, report = run_json(capsys, damaged)
    assert code == 1
    shard = report['shards'][0]
    assert (shard['verdict'], shard['bad_rows'], shard['rows_ok']) == ('corrupt', 2, 11)
    rows = [p for p in shard['problems'] if p.startswith('corrupt row')]
    assert rows == [
        f'corrupt row: {damaged}, shard shard.00000.mds, row 5 (sample 5): offsets '
        f'[{rows_begin(hashed, 5):,}, 5) are not inside the row data [60, '
        f'{shard["bytes_expected"]:,}) (corrupt offsets or truncated shard)',
        f'corrupt row: {damaged}, shard shard.00000.mds, row 6 (sample 6): offsets '
        f'[5, {rows_begin(hashed, 7):,}) are not inside the row data [60, '
        f'{shard["bytes_expected"]:,}) (corrupt offsets or truncated shard)']
    assert report['shards'][1]['verdict'] == 'ok'


def rows_begin(stream: Path, row: int) -> int:
    """Where ``row`` of shard 0 begins in the intact stream."""
    from integrity_helpers import offsets
    return int(offsets(shard_path(stream, 0).read_bytes())[row])


def test_deleted_shard(capsys, tmp_path, hashed):
    damaged = copy_stream(hashed, tmp_path / 'h')
    size = shard_path(damaged, 0).stat().st_size
    shard_path(damaged, 0).unlink()
    assert main(['verify', str(damaged)]) == 1
    out = capsys.readouterr().out
    assert shard_line(out, 'shard.00000.mds') == ['shard.00000.mds', '0 / 13', f'- / {size:,}', '-',
                                                  '13', 'missing']
    assert f'  {damaged / "shard.00000.mds"}: shard file missing (index.json records {size:,} bytes)\n' in out
    assert 'verdict: CORRUPT -- 1 of 2 shards damaged: shard.00000.mds (missing)' in out


def test_damaged_index_and_usage_errors(capsys, tmp_path, hashed):
    damaged = copy_stream(hashed, tmp_path / 'h')
    (damaged / 'index.json').write_text('{"version": 2, "shards": [')
    code, report = run_json(capsys, damaged)
    assert code == 1 and report['shards'] == []
    assert report['problems'][0].startswith(f'{damaged / "index.json"}: not valid JSON')
    (damaged / 'index.json').unlink()
    code, report = run_json(capsys, damaged)
    assert code == 1 and report['problems'] == [
        f'{damaged / "index.json"}: missing (an incomplete conversion or copy?)']
    # not a foundrymix directory / no such directory: usage errors, exit 2
    assert main(['verify', str(tmp_path)]) == 2
    assert 'no foundrymix manifest' in capsys.readouterr().err
    assert main(['verify', str(tmp_path / 'nothere')]) == 2
    assert capsys.readouterr().err == f'foundrymix verify: error: {tmp_path / "nothere"}: no such directory\n'


def test_compressed_stream(capsys, tmp_path, hashed_zstd):
    assert main(['verify', str(hashed_zstd)]) == 0
    out = capsys.readouterr().out
    zsize = index_of(hashed_zstd)['shards'][1]['zip_data']['bytes']
    assert shard_line(out, 'shard.00001.mds') == ['shard.00001.mds', '9', f'{zsize:,}',
                                                  'ok (sha1, xxh3_64)', '0', 'ok']
    damaged = copy_stream(hashed_zstd, tmp_path / 'z')
    zip_path = damaged / 'shard.00001.mds.zstd'
    data = bytearray(zip_path.read_bytes())
    data[100] ^= 0x10
    zip_path.write_bytes(bytes(data))
    code, report = run_json(capsys, damaged)
    assert code == 1
    shard = report['shards'][1]
    assert shard['verdict'] == 'corrupt' and shard['hash_status'].startswith('MISMATCH')
    assert shard['problems'][0].startswith(f'{zip_path}: sha1 hash ')
    assert report['shards'][0]['verdict'] == 'ok'


# ---------------------------------------------------------------- S3 (moto server)


@pytest.fixture(scope='module')
def s3():
    """A moto S3 server on 127.0.0.1, with the env streaming/boto3 read pointed at it."""
    with moto_s3(BUCKET) as server:
        yield server['client']


def upload(client, stream: Path, prefix: str) -> str:
    for f in sorted(stream.iterdir()):
        client.upload_file(str(f), BUCKET, f'{prefix}/{f.name}')
    return f's3://{BUCKET}/{prefix}'


def test_verify_s3(capsys, tmp_path, monkeypatch, s3, hashed):
    scratch = tmp_path / 'tmp'
    scratch.mkdir()
    monkeypatch.setattr(tempfile, 'tempdir', str(scratch))  # where verify's temp dir goes

    url = upload(s3, hashed, 'good')
    assert main(['verify', url]) == 0
    out = capsys.readouterr().out
    assert shard_line(out, 'shard.00001.mds')[3:] == ['ok (sha1, xxh3_64)', '0', 'ok']
    assert 'verdict: INTACT -- 2 shards, 22 rows' in out

    damaged = copy_stream(hashed, tmp_path / 'ff')
    set_tokens_ff(damaged, 1, 4, token=7)
    url = upload(s3, damaged, 'ff')
    assert main(['verify', url]) == 1
    out = capsys.readouterr().out
    assert f'  {url}/shard.00001.mds: sha1 hash ' in out
    assert (f'  corrupt row: {url}, shard shard.00001.mds, row 4 (sample 17): token id 65535 >= '
            f'vocabulary size 8192') in out

    deleted = copy_stream(hashed, tmp_path / 'del')
    shard_path(deleted, 1).unlink()
    url = upload(s3, deleted, 'del')
    code, report = run_json(capsys, url)
    assert code == 1 and [s['verdict'] for s in report['shards']] == ['ok', 'missing']
    assert report['shards'][1]['problems'] == [
        f'{url}/shard.00001.mds: shard file missing (index.json records '
        f'{index_of(hashed)["shards"][1]["raw_data"]["bytes"]:,} bytes)']

    assert main(['verify', f's3://{BUCKET}/nothere']) == 2
    assert capsys.readouterr().err.startswith(
        f'foundrymix verify: error: s3://{BUCKET}/nothere/foundrymix.json: no foundrymix manifest')
    assert os.listdir(scratch) == []  # every temporary download directory was removed


def test_loader_names_a_shard_missing_from_the_remote(tmp_path, s3, hashed):
    """A remote stream whose bucket lost a shard: streaming's download thread fails, which used
    to end the epoch quietly after 13 of 22 rows (a logged traceback, no error); now the
    loader names the stream and shard."""
    from foundrymix.loader.storage import ShardPrepareError
    from foundrymix.loader.mixer import StreamMixer
    from foundrymix.format.schema import CorruptRowError
    deleted = copy_stream(hashed, tmp_path / 'del')
    shard_path(deleted, 1).unlink()
    url = upload(s3, deleted, 'loader-del')
    cfg = {'streams': {'arxiv': {'remote': url}}, 'cache_root': str(tmp_path / 'cache'),
           'shuffle': False, 'num_workers': 0}
    with pytest.raises((ShardPrepareError, CorruptRowError)) as err:
        [b for b in StreamMixer.from_dict(cfg).build_dataloader(1)]
    text = str(err.value)
    assert "stream 'arxiv' (" in text and 'shard shard.00001.mds' in text
    assert (f'RemoteError: {url}/shard.00001.mds: S3 NoSuchKey: no such object at '
            f'{os.environ["S3_ENDPOINT_URL"]}; check the path after the bucket (the prefix)') in text


def test_index_without_the_hashes_its_manifest_records_is_named(capsys, tmp_path, small_streams, hashed):
    """index.json rewritten without hashes while foundrymix.json says the conversion wrote
    them: before, verify said INTACT (and plan/train went on with nothing to check the bytes
    against); now verify names both files, and plan refuses unless hash_local_shards is off."""
    from foundrymix.loader.mixer import StreamMixer
    from foundrymix.config import ConfigError
    from integrity_helpers import strip_index_hashes

    stripped = strip_index_hashes(copy_stream(hashed, tmp_path / 'h'))
    index, manifest = stripped / 'index.json', stripped / 'foundrymix.json'
    problem = (f'{index} records no hash for 2 of 2 shard(s) (e.g. shard.00000.mds), though {manifest} '
               f'says the conversion wrote sha1, xxh3_64: the index was rewritten after the conversion, '
               f"and nothing can check those shards' bytes")
    code, report = run_json(capsys, stripped)
    assert code == 1 and report['verdict'] == 'corrupt'
    assert report['problems'] == [f'{problem}; re-run `foundrymix convert` into {stripped} with '
                                  f'--overwrite, or restore its index.json']
    assert main(['verify', str(stripped)]) == 1
    assert 'verdict: CORRUPT -- 0 of 2 shards damaged; 1 problem(s) with manifest or index' in \
        capsys.readouterr().out

    config = {'streams': {'arxiv': {'local': str(stripped)}}}
    with pytest.raises(ConfigError) as err:
        StreamMixer.from_dict(config).plan(4)
    assert str(err.value) == (
        f'train_loader.streams.arxiv: {problem}. Re-run `foundrymix convert` into {stripped} with '
        f'--overwrite (or restore its index.json), or set train_loader.hash_local_shards: false to '
        f'train it unchecked')
    StreamMixer.from_dict({**config, 'hash_local_shards': False}).plan(4)  # the advice, followed
    # a stream converted without hashes (both files agree) is not refused
    StreamMixer.from_dict({'streams': {'dolly': {'local': str(
        strip_hashes(copy_stream(small_streams['dolly'], tmp_path / 'd')))}}}).plan(4)
