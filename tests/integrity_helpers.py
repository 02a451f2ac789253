"""Real shards and real damage to their bytes, for the integrity and verify tests.

Streams are made by the real converter (``convert_pretrain``, bundled tokenizer);
"with hashes" streams are converted with streaming's ``MDSWriter`` recording
``xxh3_64`` and ``sha1`` for every shard file (what ``MDSWriter(hashes=[...])`` writes;
the converter's own option for it is added elsewhere). Damage is done to the files
exactly where the MDS layout puts the bytes: ``[uint32 rows][uint32 offsets x rows+1]
[config json][rows]``, each row ``[uint32 size per variable column][column bytes...]``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from helpers import SAMPLES, SMALL_SEQ

HASHES = ('sha1', 'xxh3_64')


def paper_jsonl(root: Path) -> Path:
    """The first 12,000 characters of one arXiv paper (22 rows of 128 tokens)."""
    with open(SAMPLES / 'arxiv_sample.jsonl', encoding='utf-8') as f:
        paper = json.loads(f.readline())['text'][:12000]
    path = root / 'paper.jsonl'
    path.write_text(json.dumps({'text': paper}) + '\n', encoding='utf-8')
    return path


def convert_paper(out: Path, hashes: tuple[str, ...] = (), compression: str | None = None) -> Path:
    """Convert the paper with the real converter into small shards, recording ``hashes``
    (``--hash``; the converter always records its default ``xxh3_64`` too)."""
    from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain

    out.parent.mkdir(parents=True, exist_ok=True)
    src = paper_jsonl(out.parent)
    convert_pretrain([str(src)], str(out), PretrainOptions(
        max_seq_len=SMALL_SEQ, workers=1, size_limit='4kb', compression=compression,
        hash=tuple(hashes)))
    return out


def strip_hashes(stream: Path) -> Path:
    """A stream as a conversion without shard hashes leaves it (older conversions, other MDS
    writers): none in ``index.json``, none in ``foundrymix.json``'s ``options.hashes``."""
    strip_index_hashes(stream)
    path = stream / 'foundrymix.json'
    manifest = json.loads(path.read_text())
    manifest.setdefault('options', {})['hashes'] = []
    path.write_text(json.dumps(manifest))
    return stream


def strip_index_hashes(stream: Path) -> Path:
    """Remove the recorded shard hashes from ``index.json`` only (an index rewritten after
    the conversion: ``foundrymix.json`` still says they were written)."""
    path = stream / 'index.json'
    index = json.loads(path.read_text())
    for shard in index['shards']:
        for key in ('raw_data', 'zip_data'):
            if shard.get(key):
                shard[key]['hashes'] = {}
    path.write_text(json.dumps(index))
    return stream


def copy_stream(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def index_of(stream: Path) -> dict:
    return json.loads((stream / 'index.json').read_text())


def shard_path(stream: Path, k: int) -> Path:
    return stream / index_of(stream)['shards'][k]['raw_data']['basename']


def first_row_of_shard(stream: Path, k: int) -> int:
    """Global index (within the stream) of the first row of shard ``k``."""
    return sum(s['samples'] for s in index_of(stream)['shards'][:k])


def offsets(data: bytes) -> np.ndarray:
    n = int(np.frombuffer(data[:4], np.uint32)[0])
    return np.frombuffer(data[4:4 + 4 * (n + 1)], np.uint32).astype(np.int64)


def token_bytes(stream: Path, k: int, row: int) -> tuple[int, int]:
    """Byte range of ``input_ids`` of ``row`` of (uncompressed) shard ``k``."""
    entry = index_of(stream)['shards'][k]
    data = shard_path(stream, k).read_bytes()
    pos = int(offsets(data)[row])
    var_sizes = []
    for size in entry['column_sizes']:
        if size is None:
            var_sizes.append(int(np.frombuffer(data[pos:pos + 4], np.uint32)[0]))
            pos += 4
    it = iter(var_sizes)
    for name, size in zip(entry['column_names'], entry['column_sizes']):
        size = size or next(it)
        if name == 'input_ids':
            return pos, pos + size
        pos += size
    raise AssertionError('no input_ids column')


def patch(path: Path, at: int, new: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + len(new)] = new
    path.write_bytes(bytes(data))


def flip_bits(stream: Path, k: int, row: int, token: int) -> tuple[int, int]:
    """Flip the lowest bit of token ``token`` of a row (id stays < vocab); (old id, new id)."""
    start, _ = token_bytes(stream, k, row)
    path = shard_path(stream, k)
    at = start + 2 * token  # uint16 tokens, little-endian: low byte first
    old = int(np.frombuffer(path.read_bytes()[at:at + 2], np.uint16)[0])
    patch(path, at, bytes([path.read_bytes()[at] ^ 1]))
    return old, old ^ 1


def set_tokens_ff(stream: Path, k: int, row: int, token: int, count: int = 4) -> None:
    """Set ``count`` tokens from position ``token`` of a row to 0xFFFF (65535 >= any vocab here)."""
    start, _ = token_bytes(stream, k, row)
    patch(shard_path(stream, k), start + 2 * token, b'\xff' * (2 * count))


def truncate(stream: Path, k: int, cut: int) -> tuple[int, int]:
    """Cut ``cut`` bytes off the end of shard ``k``; (old size, new size)."""
    path = shard_path(stream, k)
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    return len(data), len(data) - cut


def first_row_cut(stream: Path, k: int, new_size: int) -> int:
    """The first row of shard ``k`` (from its intact bytes) that ends past ``new_size``."""
    ends = offsets(shard_path(stream, k).read_bytes())[1:]
    return int(np.argmax(ends > new_size))


def corrupt_offset(stream: Path, k: int, row: int, value: int = 5) -> None:
    """Overwrite the offset where ``row`` begins (and ``row - 1`` ends) with ``value``."""
    patch(shard_path(stream, k), 4 * (1 + row), np.uint32(value).tobytes())


def rank_one_only(stream: Path) -> tuple[int, int, list[int]]:
    """(global batch G, shard k, first row of each shard): unshuffled on 2 ranks, the first
    global batch holding shard ``k``'s rows gives them to rank 1 only (the shard starts in
    the second half of a batch), and that batch is inside the epoch."""
    counts = [s['samples'] for s in index_of(stream)['shards']]
    starts = [sum(counts[:k]) for k in range(len(counts))]
    for g in (4, 6, 8, 10, 12):
        for k, s in enumerate(starts[1:], 1):
            if s % g >= g // 2 and s // g < sum(counts) // g:
                return g, k, starts
    raise AssertionError(f'no shard starts in rank 1\'s half of a batch: {starts}')


def shard_hash_error(stream: Path, shard: str, name: str = 'arxiv') -> str:
    """The loader's message for a local shard whose bytes do not match index.json's xxh3_64."""
    return (f"stream '{name}' ({stream}): shard file {shard} does not match the xxh3_64 hash its "
            f'index.json records: the bytes changed after conversion (a damaged copy or disk); no '
            f'row of it was read. Re-copy the stream from where it came from, or re-run '
            f'`foundrymix convert` into {stream} with --overwrite; `foundrymix verify {stream}` '
            f'checks every shard')
