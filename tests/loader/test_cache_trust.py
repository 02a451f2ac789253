"""Nothing read back from foundrymix's cache changes what trains unless it is verified.

What the loader reads back from its cache directory: the records of verified shard files
(``shard-hashes/``) and the shards it unpacked there (a compressed local stream's; a remote
stream's copies are in ``test_s3_cache_integrity.py``). Each is damaged here, bit by bit, and
each time the run either reads exactly the good rows or stops naming the damaged shard --
never other rows. (The other things the cache holds are locks, claims and the ``cache_limit``
account: they decide who fetches and when, never which bytes a row has; and the tokenizer
memo, sealed with a digest: ``tests/train/test_start_records.py``.)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from foundrymix.loader.cache import CorruptLocalShardError
from foundrymix.loader.cache.hashes import record_path
from foundrymix.loader.mixer import StreamMixer
from integrity_helpers import convert_paper, copy_stream, flip_bits


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / 'fm-cache'
    monkeypatch.setenv('FOUNDRYMIX_CACHE', str(root))
    return root


def rows(directory: Path) -> list[bytes]:
    """Every row's token bytes, read through the loader's store (a new store each time)."""
    store = StreamMixer.from_dict({'streams': {'s': {'local': str(directory)}}}).build_store()
    try:
        return [bytes(store[i]['input_ids'].tobytes()) for i in range(len(store))]
    finally:
        store.release()


def test_a_damaged_hash_record_never_passes_a_damaged_shard(tmp_path, cache, small_streams):
    arxiv = copy_stream(small_streams['arxiv'], tmp_path / 'arxiv')
    good = rows(arxiv)  # every shard verified and recorded
    record = Path(record_path(None, str(arxiv)))
    kept = record.read_bytes()
    flip_bits(arxiv, 1, 3, token=10)  # the shard now differs from the one recorded
    refused = 0
    for i in range(0, len(kept) * 8, 11):  # every 11th single-bit flip of the record
        data = bytearray(kept)
        data[i // 8] ^= 1 << (i % 8)
        record.write_bytes(bytes(data))
        with pytest.raises(CorruptLocalShardError, match='shard file shard.00001.mds does not match'):
            rows(arxiv)
        refused += 1
    assert refused >= 100 and len(good) > 0


def test_a_damaged_unpacked_shard_is_unpacked_again_and_the_users_directory_is_untouched(
        tmp_path, cache):
    """A compressed local stream is unpacked into the cache, never into its directory; a
    flipped bit in the unpacked copy is found at the next open and the shard unpacked again."""
    zstd = convert_paper(tmp_path / 'zstd' / 'arxiv', compression='zstd')
    plain = convert_paper(tmp_path / 'plain' / 'arxiv')
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in zstd.iterdir()}
    want = rows(plain)
    assert rows(zstd) == want
    unpacked = [p for p in (cache / 'unpacked').rglob('*.mds')]
    assert len(unpacked) == len([n for n in before if n.endswith('.zstd')])
    for copy in unpacked:
        data = bytearray(copy.read_bytes())
        data[len(data) // 2] ^= 0x04
        copy.write_bytes(bytes(data))
    assert rows(zstd) == want
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in zstd.iterdir()} == before
    assert not any(n.endswith('.mds') for n in os.listdir(zstd))
