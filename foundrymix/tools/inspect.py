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

import numpy as np

from foundrymix.errors import MissingError
from foundrymix.format.schema import CorruptRowError, Manifest, decode_row
from foundrymix.format.shards import (INDEX_NAME, check_shard_files, iter_shard_rows, read_index, shard_files_error,
                                      shard_name, shard_raw_bytes, stored_name)
from foundrymix.tokenizer import load_tokenizer
from foundrymix.tools.verify import Source

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


def _fetch(source: Source, basename: str, what: str) -> None:
    """A remote directory's file, downloaded when first needed (a local one's is in place)."""
    if source.remote and source.fetch(basename) is None:
        raise MissingError(f'{source.name(basename)}: no {what}. Is {source.location!r} a directory '
                           f'made by `foundrymix convert`?')


def iter_checked_rows(source: Source, manifest: Manifest) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(shard file, row within the shard, stored row) of a directory, in order, each checked as the
    loader checks it: a damaged shard or row raises naming the shard file and row. A remote
    directory's index and shards are downloaded as the rows reach them."""
    _fetch(source, INDEX_NAME, INDEX_NAME)
    index = read_index(source.dir)
    sample = 0
    for shard in index['shards']:
        name = shard_name(shard)
        _fetch(source, stored_name(shard), 'shard file listed in index.json')
        problems = check_shard_files(source.dir, {'shards': [shard]})
        if problems:
            raise shard_files_error(os.path.basename(os.path.normpath(source.dir)), source.dir, problems)
        with open(os.path.join(source.dir, stored_name(shard)), 'rb') as f:  # what the loader reads
            data = shard_raw_bytes(shard, f.read())
        for result in iter_shard_rows(data, shard, manifest.tokenizer.vocab_size, manifest.max_seq_len):
            if result.problem is not None:
                raise CorruptRowError(shard=name, row=result.row, sample_id=sample + result.row,
                                      problem=result.problem, directory=source.location)
            yield name, result.row, result.value
        sample += int(shard['samples'])


def _decode(source: Source, manifest: Manifest, k: int) -> None:
    tok = load_tokenizer(manifest.tokenizer.name)
    print(f'no loss on text in {NO_LOSS_OPEN}...{NO_LOSS_CLOSE}')
    rows = iter_checked_rows(source, manifest)
    for r, (_, _, row) in zip(range(k), rows):
        n_real = int(np.sum(row['doc_lens']))
        for s, text in enumerate(render_row(row, tok)):
            print(f'--- row {r}, segment {s} ---')
            print(text)
        print(f'--- row {r}: {manifest.max_seq_len - n_real} padding tokens ---')


def _run(args: argparse.Namespace) -> int:
    with Source(args.dir, args.timeout) as source:  # a remote one: only the files shown are fetched
        manifest = source.manifest()
        if args.json:
            print(manifest.to_json(), end='')
        else:
            from rich.console import Console

            from foundrymix.convert.report import manifest_table
            Console(file=sys.stdout).print(manifest_table(manifest, source.location))
            print('inputs:', *manifest.inputs, sep='\n  ')
            print('options:', json.dumps(manifest.options, sort_keys=True))
        if args.decode:
            _decode(source, manifest, args.decode)
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
