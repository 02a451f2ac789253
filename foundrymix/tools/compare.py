"""``foundrymix compare RUN_A RUN_B``: is a resumed run the straight run (docs/resume.md)? Part by
part, reading only: sample logs (a global batch as a set of rows, then its tokens digest),
per-stream counts, final weights."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from foundrymix.errors import MissingError, UserError
from foundrymix.train.export import load_checkpoint
from foundrymix.train.report import SUMMARY_NAME, load_summary

PARTS = ('samples', 'accounting', 'weights')
SAMPLE_LOG_KEYS = ('batch', 'sample_ids', 'stream_ids')
COUNTS = ('samples', 'tokens', 'loss_tokens')


@dataclass
class Result:
    """One part's verdict: ``difference`` None when equal; ``detail`` says what was compared."""

    part: str
    difference: Optional[str]
    detail: str

    def line(self) -> str:
        text = f'equal ({self.detail})' if self.difference is None else f'differ: {self.difference}'
        return f'{self.part + ":":<11} {text}'


# ------------------------------------------------------------------ finding the files
def _files(run: str, pattern: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(run), '**', pattern), recursive=True))


def _is_sample_log(path: str) -> bool:
    try:
        with open(path, encoding='utf-8') as f:
            first = next((line for line in f if line.strip()), '')
        line = json.loads(first)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(line, dict) and all(k in line for k in SAMPLE_LOG_KEYS)


def _only(run: str, found: list[str], what: str, advice: str) -> str:
    """The one file of ``found``, or a refusal naming what was found instead."""
    if len(found) != 1:
        listing = f'found {len(found)}: {", ".join(found)}' if found else 'found none'
        raise MissingError(f'{run}: expected one {what} below it, {listing}; {advice}')
    return found[0]


def find_sample_log(run: str) -> str:
    return _only(run, [p for p in _files(run, '*.jsonl') if _is_sample_log(p)],
                 'sample log (*.jsonl written by the sample_log callback)',
                 'add callbacks.sample_log to the run, or leave samples out with --parts')


def find_summary(run: str) -> str:
    return _only(run, _files(run, SUMMARY_NAME), SUMMARY_NAME, 'leave accounting out with --parts')


def find_checkpoint(run: str) -> str:
    """The run's last checkpoint: Composer's ``latest-rank0.pt`` symlink, else the
    ``ep<e>-ba<b>-rank0.pt`` with the most batches."""
    latest = _files(run, 'latest-rank0.pt')
    if len(latest) == 1:
        return latest[0]
    if len(latest) > 1:
        raise UserError(f'{run}: several save folders below it ({", ".join(latest)}); name the '
                        f'checkpoints with --checkpoint-a/--checkpoint-b')
    batches = {p: int(m.group(1)) for p in _files(run, 'ep*-ba*-rank0.pt')
               if (m := re.search(r'-ba(\d+)-rank0\.pt$', p))}
    if not batches:
        raise MissingError(f'{run}: no checkpoint below it (latest-rank0.pt or '
                           f'ep*-ba*-rank0.pt); name one with --checkpoint-a/--checkpoint-b, or '
                           f'leave weights out with --parts')
    return max(batches, key=lambda p: batches[p])


# ------------------------------------------------------------------ the three parts
def _read_log(path: str) -> list[dict[str, Any]]:
    out = []
    with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise UserError(f'{path}:{n}: not a sample-log line ({e})') from None
    return out


def _rows(line: dict[str, Any]) -> list[tuple[Any, Any, Any]]:
    """A log line's rows in rank order: (sample id, stream id, stage id or None)."""
    ids, streams = line['sample_ids'], line.get('stream_ids', [])
    stages = line.get('stage_ids') or [None] * len(ids)
    return [(i, streams[r] if r < len(streams) else None, stages[r]) for r, i in enumerate(ids)]


def _only_in(mine: list[tuple[Any, Any, Any]], theirs: list[tuple[Any, Any, Any]]) -> Optional[int]:
    """The first row (rank order) of ``mine`` that ``theirs`` does not hold (as a multiset)."""
    left = Counter(theirs)
    for r, row in enumerate(mine):
        if left[row]:
            left[row] -= 1
        else:
            return r
    return None


def _tokens_comparable(x: dict[str, Any], y: dict[str, Any]) -> bool:
    """Whether two lines' ``tokens`` may be compared: both present and made alike (order-free
    digests; or, from an older foundrymix, rank-order digests of rows in the same order)."""
    if 'tokens' not in x or 'tokens' not in y:
        return False
    order = x.get('tokens_order', 'rank'), y.get('tokens_order', 'rank')
    return order[0] == order[1] and (order[0] != 'rank' or x['sample_ids'] == y['sample_ids'])


def compare_samples(a: str, b: str, names: Optional[list[str]] = None,
                    ranks: Optional[int] = None) -> Result:
    """The first batch whose rows (sample, stream, stage ids) differ as a multiset, naming a row
    only A has and one only B has; else the first whose ``tokens`` digest differs (ids only,
    said so, for logs without digests)."""
    la, lb = _read_log(a), _read_log(b)

    def stream(i: Any) -> str:
        return names[i] if names and isinstance(i, int) and 0 <= i < len(names) else f'stream {i}'

    def row(rows: list[tuple[Any, Any, Any]], r: Optional[int]) -> str:
        if r is None:
            return 'absent'
        sample, of, stage = rows[r]
        return f'sample {sample} ({stream(of)}' + (f', stage {stage}' if stage is not None else '') + ')'

    def where(r: int, n: int) -> str:
        if ranks and n % ranks == 0:
            return f'row {r} of {n} (rank {r // (n // ranks)} of {ranks}, its row {r % (n // ranks)})'
        return f'row {r} of {n} (rank order)'
    compared = 0
    for x, y in zip(la, lb):
        if x['batch'] != y['batch']:
            return Result('samples', f'the logs\' batches go {x["batch"]} (A) and {y["batch"]} '
                          f'(B) at the same line', '')
        rx, ry = _rows(x), _rows(y)
        ax, by = _only_in(rx, ry), _only_in(ry, rx)
        if ax is not None or by is not None:
            n = max(len(rx), len(ry))
            if ax is not None and by is not None and ax != by:
                return Result('samples', f'batch {x["batch"]}: A {row(rx, ax)} at {where(ax, len(rx))} is '
                              f'not in B\'s batch, B {row(ry, by)} at row {by} is not in A\'s', '')
            r = ax if ax is not None else by
            return Result('samples', f'batch {x["batch"]}, {where(r, n)}: A {row(rx, ax)}, B {row(ry, by)}', '')
        if _tokens_comparable(x, y):
            compared += 1
            if x['tokens'] != y['tokens']:
                return Result('samples', f'batch {x["batch"]}: the same sample ids, different tokens '
                              f'(digest {x["tokens"]} (A), {y["tokens"]} (B)): the rows\' data differed '
                              f'between the runs (a shard rewritten, damaged or from another copy)', '')
    if len(la) != len(lb):
        longer, n = ('A', len(la)) if len(la) > len(lb) else ('B', len(lb))
        first = (la if len(la) > len(lb) else lb)[min(len(la), len(lb))]['batch']
        return Result('samples', f'A logs {len(la)} batches, B {len(lb)}: from batch {first} '
                      f'only {longer} has them ({n} in all)', '')
    detail = f'{len(la)} batches, {sum(len(x["sample_ids"]) for x in la)} samples'
    if la and not all('tokens' in x for x in la + lb):
        detail += '; ids only: a log has no token digests'
    elif compared < len(la):
        detail += (f'; tokens compared in {compared} of {len(la)} batches (the others\' digests were '
                   f'made in rank order by an older foundrymix, over rows in another order)')
    return Result('samples', None, detail)


def compare_accounting(a: str, b: str) -> Result:
    """The first stream (run-wide order) whose samples, tokens or loss tokens differ."""
    sa, sb = load_summary(a)[0]['streams'], load_summary(b)[0]['streams']
    if list(sa) != list(sb):
        return Result('accounting', f'streams A {", ".join(sa)}; B {", ".join(sb)}', '')
    for name in sa:
        for key in COUNTS:
            if sa[name].get(key) != sb[name].get(key):
                return Result('accounting', f'stream {name}: {key} A {sa[name].get(key)}, '
                              f'B {sb[name].get(key)}', '')
    return Result('accounting', None, f'{len(sa)} streams: ' + ', '.join(
        f'{n} {sa[n]["samples"]:,} samples' for n in sa))


def compare_weights(a: str, b: str, ckpt_a: dict[str, Any], ckpt_b: dict[str, Any]) -> Result:
    """The first tensor (state-dict order) whose shape, dtype or values differ."""
    import torch

    wa, wb = ckpt_a['state']['model'], ckpt_b['state']['model']
    if list(wa) != list(wb):
        only = [k for k in wa if k not in wb] + [k for k in wb if k not in wa]
        return Result('weights', f'different tensors (first only in one: '
                      f'{only[0] if only else "the order differs"})', '')
    for key in wa:
        x, y = wa[key], wb[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            return Result('weights', f'{key}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} '
                          f'{y.dtype}', '')
        if not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item()
            n = sum(1 for k in wa if not torch.equal(wa[k], wb[k]))
            return Result('weights', f'{key}: max abs diff {diff:.6g} ({n} of {len(wa)} tensors '
                          f'differ)', '')
    return Result('weights', None, f'{len(wa)} tensors bitwise equal: {a} and {b}')


# ------------------------------------------------------------------ the command
def compare_runs(run_a: str, run_b: str, parts: tuple[str, ...] = PARTS,
                 checkpoint_a: Optional[str] = None,
                 checkpoint_b: Optional[str] = None) -> list[Result]:
    """Every requested part of two runs (all inputs found before anything is compared)."""
    for run in (run_a, run_b):
        if not os.path.isdir(run):
            raise MissingError(f'{run}: no such run directory')
    for c in (checkpoint_a, checkpoint_b):
        if c is not None and not os.path.isfile(c):
            raise MissingError(f'{c}: no such checkpoint file')
    logs = (find_sample_log(run_a), find_sample_log(run_b)) if 'samples' in parts else None
    try:  # also for the samples' message: stream names in the accounting's run-wide order
        summaries: Optional[tuple[str, str]] = (find_summary(run_a), find_summary(run_b))
    except MissingError:
        if 'accounting' in parts:
            raise
        summaries = None
    weights = ((checkpoint_a or find_checkpoint(run_a), checkpoint_b or find_checkpoint(run_b))
               if 'weights' in parts else ())
    ckpts = [load_checkpoint(p) for p in weights]
    out = []
    if logs:
        names = list(load_summary(summaries[0])[0]['streams']) if summaries else None
        rng = ckpts[0].get('rng') if ckpts else None  # one RNG state per rank: the ranks, for the message
        out.append(compare_samples(*logs, names=names, ranks=len(rng) if isinstance(rng, list) and rng else None))
    if 'accounting' in parts:
        out.append(compare_accounting(*summaries))
    if weights:
        out.append(compare_weights(*weights, *ckpts))
    return out


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(',') if p.strip())
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f'{text!r}: parts are {", ".join(PARTS)} (comma-separated)')
    return parts


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        'compare', help='compare two runs: sample logs, per-stream counts, final weights',
        description='Compare two training runs (e.g. a resumed run with a straight one): their '
                    'sample logs, stream_accounting.json and final weights. Prints equal or the '
                    'first difference per part; exit 0 if all equal, 1 if different, 2 on bad input.')
    p.add_argument('run_a', metavar='RUN_A', help='a run directory (holding its sample log, '
                                                  'report and save_folder)')
    p.add_argument('run_b', metavar='RUN_B', help='the other run directory')
    p.add_argument('--parts', type=_parts, default=','.join(PARTS),
                   help='what to compare, comma-separated (default: %(default)s)')
    p.add_argument('--checkpoint-a', help='the checkpoint of RUN_A to compare (default: its last)')
    p.add_argument('--checkpoint-b', help='the checkpoint of RUN_B to compare (default: its last)')
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    results = compare_runs(args.run_a, args.run_b, args.parts, args.checkpoint_a, args.checkpoint_b)
    for r in results:
        print(r.line())
    return 0 if all(r.difference is None for r in results) else 1
