"""``foundrymix inspect DIR``: the manifest as a table (or JSON), and rows decoded as text.

``--decode K`` prints the first K rows segment by segment, tokens without loss between ``⟦`` and
``⟧``, read with the loader's checks. A remote directory downloads only the files needed, each
within ``--timeout``, into a temporary directory removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Iterator
import tempfile

import numpy as np

from foundrymix.errors import MissingError
from foundrymix.format.schema import CorruptRowError
from foundrymix.format.schema import MANIFEST_NAME, Manifest, decode_row
from foundrymix.format.shards import (INDEX_NAME, check_shard_files, is_not_found, iter_shard_rows, read_index,
                                     shard_files_error, shard_name, shard_raw_bytes, stored_name)
from foundrymix.s3.remote import download
from foundrymix.tokenizer import load_tokenizer
from foundrymix.tools.verify import is_remote

NO_LOSS_OPEN, NO_LOSS_CLOSE = '⟦', '⟧'


def render_row(row: dict[str, Any], tok: Any) -> list[str]:
    """Text of each segment of a stored row, no-loss spans bracketed."""
    d = decode_row(row)
    ids, has_loss = d['input_ids'], d['labels'] != -100
    out, start = [], 0
    for n in np.asarray(row['doc_lens']).tolist():
        parts = []
        seg = slice(start, start + n)
        flags = has_loss[seg]
        cuts = np.flatnonzero(np.diff(flags.astype(np.int8))) + 1
        for lo, hi in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [n]))):
            text = tok.decode(ids[seg][lo:hi].tolist(), skip_special_tokens=False)
            parts.append(text if flags[lo] else f'{NO_LOSS_OPEN}{text}{NO_LOSS_CLOSE}')
        out.append(''.join(parts))
        start += n
    return out


def iter_checked_rows(directory: str, manifest: Manifest) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(shard file, row within the shard, stored row) of a local directory, in order, each checked
    as the loader checks it: a damaged shard or row raises naming the shard file and row."""
    index = read_index(directory)
    sample = 0
    for shard in index['shards']:
        name = shard_name(shard)
        problems = check_shard_files(directory, {'shards': [shard]})
        if problems:
            raise shard_files_error(os.path.basename(os.path.normpath(directory)), directory, problems)
        with open(os.path.join(directory, stored_name(shard)), 'rb') as f:  # what the loader reads
            data = shard_raw_bytes(shard, f.read())
        for result in iter_shard_rows(data, shard, manifest.tokenizer.vocab_size, manifest.max_seq_len):
            if result.problem is not None:
                raise CorruptRowError(shard=name, row=result.row, sample_id=sample + result.row,
                                      problem=result.problem, directory=directory)
            yield name, result.row, result.value
        sample += int(shard['samples'])


def _decode(directory: str, manifest: Manifest, k: int) -> None:
    tok = load_tokenizer(manifest.tokenizer.name)
    print(f'no loss on text in {NO_LOSS_OPEN}...{NO_LOSS_CLOSE}')
    rows = iter_checked_rows(directory, manifest)
    for r, (_, _, row) in zip(range(k), rows):
        n_real = int(np.sum(row['doc_lens']))
        for s, text in enumerate(render_row(row, tok)):
            print(f'--- row {r}, segment {s} ---')
            print(text)
        print(f'--- row {r}: {manifest.max_seq_len - n_real} padding tokens ---')


def _fetch_remote(url: str, directory: str, decode: int, timeout: float) -> None:
    """Download what ``inspect`` shows of remote ``url`` into ``directory``: the manifest, and
    for ``--decode`` the index and the shards holding the first ``decode`` rows."""
    url = url.rstrip('/')

    def get(basename: str, what: str) -> None:
        try:
            download(f'{url}/{basename}', os.path.join(directory, basename), timeout)
        except ConnectionError as e:
            if is_not_found(e):
                raise MissingError(f'{url}/{basename}: no {what} ({e}). Is {url!r} a directory '
                                        f'made by `foundrymix convert`?') from e
            raise

    get(MANIFEST_NAME, 'foundrymix manifest')
    if not decode:
        return
    get(INDEX_NAME, INDEX_NAME)
    rows = 0
    for shard in read_index(directory)['shards']:
        if rows >= decode:
            break
        get(stored_name(shard), 'shard file listed in index.json')
        rows += int(shard['samples'])


def _run(args: argparse.Namespace) -> int:
    if not is_remote(args.dir):
        return _show(args.dir, args.dir, args)
    with tempfile.TemporaryDirectory(prefix='foundrymix-inspect-') as tmp:
        try:
            _fetch_remote(args.dir, tmp, args.decode, args.timeout)
        except ConnectionError as e:  # foundrymix.s3.remote.RemoteError: URL, S3 code, what to check
            print(f'foundrymix inspect: error: {e}', file=sys.stderr)
            return 2
        return _show(tmp, args.dir.rstrip('/'), args)


def _show(directory: str, title: str, args: argparse.Namespace) -> int:
    manifest = Manifest.read(directory)
    if args.json:
        print(manifest.to_json(), end='')
    else:
        from rich.console import Console

        from foundrymix.convert.report import manifest_table
        Console(file=sys.stdout).print(manifest_table(manifest, title))
        print('inputs:', *manifest.inputs, sep='\n  ')
        print('options:', json.dumps(manifest.options, sort_keys=True))
    if args.decode:
        _decode(directory, manifest, args.decode)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser('inspect', help='show a converted directory: manifest and decoded rows')
    p.add_argument('dir', help='a foundrymix output directory, or a remote one (s3://bucket/prefix)')
    p.add_argument('--json', action='store_true', help='print the manifest as JSON')
    p.add_argument('--decode', type=int, default=0, metavar='K',
                   help='print the first K rows as text, no-loss spans marked')
    p.add_argument('--timeout', type=float, default=60.0,
                   help='seconds per remote file download (default %(default)s)')
    p.set_defaults(func=_run)
