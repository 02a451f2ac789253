"""``foundrymix inspect DIR``: the manifest as a table (or JSON), and rows decoded as text.

``--decode K`` prints the first K rows, segment by segment (documents or packed
examples), with the tokens that carry no loss (labels ``-100``) between ``⟦`` and ``⟧``,
so a finetune row shows its prompts bracketed and its responses bare.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from foundrymix.schema import Manifest, decode_row

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


def _decode(directory: str, manifest: Manifest, k: int) -> None:
    from streaming import LocalDataset

    from foundrymix.tokenizer import load_tokenizer
    tok = load_tokenizer(manifest.tokenizer.name)
    ds = LocalDataset(local=directory)
    print(f'no loss on text in {NO_LOSS_OPEN}...{NO_LOSS_CLOSE}')
    for r in range(min(k, len(ds))):
        row = ds[r]
        n_real = int(np.sum(row['doc_lens']))
        for s, text in enumerate(render_row(row, tok)):
            print(f'--- row {r}, segment {s} ---')
            print(text)
        print(f'--- row {r}: {manifest.max_seq_len - n_real} padding tokens ---')


def _run(args: argparse.Namespace) -> int:
    manifest = Manifest.read(args.dir)
    if args.json:
        print(manifest.to_json(), end='')
    else:
        from rich.console import Console

        from foundrymix.convert.report import manifest_table
        Console(file=sys.stdout).print(manifest_table(manifest, args.dir))
        print('inputs:', *manifest.inputs, sep='\n  ')
        print('options:', json.dumps(manifest.options, sort_keys=True))
    if args.decode:
        _decode(args.dir, manifest, args.decode)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser('inspect', help='show a converted directory: manifest and decoded rows')
    p.add_argument('dir', help='a foundrymix output directory')
    p.add_argument('--json', action='store_true', help='print the manifest as JSON')
    p.add_argument('--decode', type=int, default=0, metavar='K',
                   help='print the first K rows as text, no-loss spans marked')
    p.set_defaults(func=_run)
