"""``foundrymix verify DIR|REMOTE``: check every shard of a converted directory, byte for byte.

Local or ``s3://``: manifest and index parse with the schema's columns; every shard file has its
recorded size and hashes; every row passes :func:`~foundrymix.format.schema.check_row`; rows and
tokens equal the manifest's. One line per shard and a verdict; exit 0 iff intact, 1 if damaged,
2 for usage errors. The checks live in :mod:`foundrymix.format.shards`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from foundrymix.errors import MissingError
from foundrymix.format.advice import adopt_advice, read_index_or_none, splits_advice
from foundrymix.format.schema import format_row_error
from foundrymix.format.schema import MANIFEST_NAME, Manifest, mds_columns
from foundrymix.format.shards import (INDEX_NAME, is_not_found, IndexFileError, ShardProblem, shard_raw_bytes, iter_shard_rows,
                               hashes_dropped_problem, row_count_problem, shard_hash_checks, shard_header_problems, shard_name,
                               validate_index)
from foundrymix.s3.remote import download

#: row problems listed per shard (all are counted)
MAX_ROW_PROBLEMS = 20
DEFAULT_TIMEOUT = 60.0


@dataclass
class ShardReport:
    """What verify found for one shard."""

    file: str  #: the shard's raw basename (``shard.00003.mds``)
    rows_expected: int  #: rows ``index.json`` records
    bytes_expected: int  #: bytes of the stored file (compressed if compressed) per ``index.json``
    rows_ok: int = 0  #: rows that decoded and passed the row checks
    bad_rows: int = 0
    bytes_found: Optional[int] = None  #: ``None``: the file is missing
    hash_status: str = 'not checked'  #: ``ok (xxh3_64)``, ``MISMATCH (xxh3_64)``, ``no hashes recorded``
    hash_ok: Optional[bool] = None  #: ``None``: nothing to compare
    tokens: int = 0  #: real tokens (``sum(doc_lens)``) of the good rows
    loss_tokens: int = 0  #: loss-span tokens of the good rows
    problems: list[str] = field(default_factory=list)  #: one line each, naming shard (and row)

    @property
    def verdict(self) -> str:
        if self.bytes_found is None:
            return 'missing'
        return 'corrupt' if self.problems or self.hash_ok is False or self.bad_rows else 'ok'


@dataclass
class VerifyReport:
    """What verify found for a directory: per shard, and the directory's own problems."""

    location: str
    shards: list[ShardReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  #: manifest and index
    count_problems: list[str] = field(default_factory=list)  #: totals differing from the manifest
    expected: dict[str, int] = field(default_factory=dict)  #: manifest counts: rows, tokens, loss_tokens
    found: dict[str, int] = field(default_factory=dict)

    @property
    def bad_shards(self) -> list[ShardReport]:
        return [s for s in self.shards if s.verdict != 'ok']

    @property
    def intact(self) -> bool:
        return not self.problems and not self.count_problems and not self.bad_shards

    @property
    def hashes_recorded(self) -> bool:
        return any(s.hash_ok is not None for s in self.shards)

    def all_problems(self) -> list[str]:
        return (self.problems + [p for s in self.shards for p in s.problems]
                + self.count_problems)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for s, sd in zip(self.shards, d['shards']):
            sd['verdict'] = s.verdict
        d['intact'] = self.intact
        d['verdict'] = 'intact' if self.intact else 'corrupt'
        d['hashes_recorded'] = self.hashes_recorded
        return d


def is_remote(location: str) -> bool:
    return '://' in location and not location.startswith('file://')


class _Source:
    """Where shard files come from: a local directory, or a remote one fetched into a temp dir."""

    def __init__(self, location: str, timeout: float) -> None:
        self.location = location.rstrip('/') if is_remote(location) else location
        self.timeout = timeout
        self.remote = is_remote(location)
        self.dir = tempfile.mkdtemp(prefix='foundrymix-verify-') if self.remote else location

    def path(self, basename: str) -> str:
        return os.path.join(self.dir, basename)

    def name(self, basename: str) -> str:
        """How to name a file in messages: its remote URL or local path."""
        return f'{self.location}/{basename}' if self.remote else os.path.join(self.dir, basename)

    def fetch(self, basename: str) -> Optional[str]:
        """Local path of a file of the directory, ``None`` if it does not exist."""
        local = self.path(basename)
        if not self.remote:
            return local if os.path.isfile(local) else None
        try:
            download(f'{self.location}/{basename}', local, self.timeout)
        except ConnectionError as e:  # foundrymix.s3.remote.RemoteError: names URL, S3 code, what to check
            if is_not_found(e):
                return None
            raise
        return local

    def release(self, basename: str) -> None:
        if self.remote:
            try:
                os.remove(self.path(basename))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        if self.remote:
            shutil.rmtree(self.dir, ignore_errors=True)


def verify(location: str, timeout: float = DEFAULT_TIMEOUT,
           on_shard: Optional[Callable[[ShardReport], None]] = None) -> VerifyReport:
    """Verify a foundrymix directory (local path or remote URL): damage goes in the report;
    ``FileNotFoundError`` if it is not one, ``ConnectionError`` if a remote cannot be read."""
    if not is_remote(location) and not os.path.isdir(location):
        raise MissingError(f'{location}: no such directory')
    source = _Source(location, timeout)
    try:
        return _verify(source, on_shard)
    finally:
        source.close()


def _verify(source: _Source, on_shard: Optional[Callable[[ShardReport], None]]) -> VerifyReport:
    report = VerifyReport(location=source.location)
    manifest_path = source.fetch(MANIFEST_NAME)
    if manifest_path is None:
        index_path = source.fetch(INDEX_NAME)
        if index_path is not None:
            raise MissingError(f'{source.name(MANIFEST_NAME)}: no foundrymix manifest; '
                               f'{adopt_advice(source.location, read_index_or_none(index_path))}')
        splits = splits_advice(source.location) if '://' not in source.location else None
        raise MissingError(f'{source.name(MANIFEST_NAME)}: no foundrymix manifest; ' + (splits or (
            f'is {source.location!r} a directory made by `foundrymix convert`?')))
    try:
        manifest = Manifest.read(os.path.dirname(manifest_path))
    except ValueError as e:
        report.problems.append(str(e).replace(manifest_path, source.name(MANIFEST_NAME)))
        manifest = None
    index_path = source.fetch(INDEX_NAME)
    index = None
    if index_path is None:
        report.problems.append(f'{source.name(INDEX_NAME)}: missing (an incomplete conversion or copy?)')
    else:
        try:
            with open(index_path, encoding='utf-8') as f:
                index = validate_index(json.load(f), source.name(INDEX_NAME))
        except json.JSONDecodeError as e:
            report.problems.append(f'{source.name(INDEX_NAME)}: not valid JSON ({e}); the index is damaged')
        except (IndexFileError, UnicodeDecodeError) as e:
            report.problems.append(str(e))
    if index is None:
        return report

    vocab = manifest.tokenizer.vocab_size if manifest else None
    seq = manifest.max_seq_len if manifest else None
    columns = mds_columns(manifest.max_seq_len, manifest.token_dtype) if manifest else None
    first_row = 0
    for shard in index['shards']:
        shard_report = _verify_shard(source, shard, vocab, seq, columns, first_row)
        first_row += int(shard['samples'])
        report.shards.append(shard_report)
        if on_shard is not None:
            on_shard(shard_report)

    report.found = {'rows': sum(s.rows_ok for s in report.shards),
                    'tokens': sum(s.tokens for s in report.shards),
                    'loss_tokens': sum(s.loss_tokens for s in report.shards)}
    if manifest is not None:
        c = manifest.counts
        report.expected = {'rows': c.rows, 'tokens': c.tokens, 'loss_tokens': c.loss_tokens}
        indexed = sum(int(s['samples']) for s in index['shards'])
        problem = row_count_problem(source.name(INDEX_NAME), source.name(MANIFEST_NAME), indexed,
                                    c.rows, source.location)
        if problem:
            report.count_problems.append(problem)
        problem = hashes_dropped_problem(index, manifest.options.get('hashes') or (), source.name(INDEX_NAME),
                                         source.name(MANIFEST_NAME))
        if problem:
            report.problems.append(f'{problem}; re-run `foundrymix convert` into {source.location} with '
                                   f'--overwrite, or restore its {INDEX_NAME}')
        for key, what in (('rows', 'intact rows'), ('tokens', 'tokens in intact rows'),
                          ('loss_tokens', 'loss tokens in intact rows')):
            if report.found[key] != report.expected[key]:
                report.count_problems.append(
                    f'{report.found[key]:,} {what}, {MANIFEST_NAME} records {report.expected[key]:,}')
    return report


def _verify_shard(source: _Source, shard: dict[str, Any], vocab: Optional[int], seq: Optional[int],
                  columns: Optional[dict[str, str]], first_row: int) -> ShardReport:
    """Every check of one shard, in order, into one report line: fetch, size, hashes,
    decompression, header, rows. Kept as one sequence because each step reads
    what the previous produced and a failure ends the later ones with a named reason."""
    name = shard_name(shard)
    raw_info, zip_info = shard['raw_data'], shard.get('zip_data')
    stored = zip_info or raw_info  # what a conversion writes
    rep = ShardReport(file=name, rows_expected=int(shard['samples']), bytes_expected=int(stored['bytes']))
    if columns is not None:
        found_columns = dict(zip(shard['column_names'], shard['column_encodings']))
        if found_columns != columns:
            rep.problems.append(f'{source.name(name)}: columns {found_columns} are not the foundrymix '
                                f'schema of the manifest {columns}')

    # Files present: locally the raw and/or the compressed one; remotely the stored one.
    candidates = [stored] if source.remote else [i for i in (raw_info, zip_info) if i]
    files: dict[str, bytes] = {}
    for info in candidates:
        path = source.fetch(info['basename'])
        if path is None:
            continue
        try:
            with open(path, 'rb') as f:
                files[info['basename']] = f.read()
        finally:
            source.release(info['basename'])
    if not files:
        rep.problems.append(ShardProblem(name, source.name(stored['basename']), 'missing',
                                         int(stored['bytes']), None).describe())
        rep.bad_rows = rep.rows_expected
        return rep
    rep.bytes_found = len(files.get(stored['basename'], next(iter(files.values()))))

    checks = []
    for info in (raw_info, zip_info):
        if info and info['basename'] in files:
            data = files[info['basename']]
            if len(data) != int(info['bytes']):
                rep.problems.append(ShardProblem(name, source.name(info['basename']), 'size',
                                                 int(info['bytes']), len(data)).describe())
            checks += shard_hash_checks(info, data)

    raw = files.get(raw_info['basename'])
    if raw is None:  # only the compressed file
        try:
            raw = shard_raw_bytes(shard, files[zip_info['basename']])
        except Exception as e:  # codec errors vary
            rep.problems.append(f'{source.name(zip_info["basename"])}: cannot decompress '
                                f'({shard.get("compression")}): {type(e).__name__}: {e}')
            raw = None
        else:
            checks += shard_hash_checks(raw_info, raw)
            if len(raw) != int(raw_info['bytes']):
                rep.problems.append(f'{source.name(zip_info["basename"])}: decompresses to '
                                    f'{len(raw):,} bytes, index.json records {int(raw_info["bytes"]):,}')
    if checks:
        bad = [c for c in checks if not c.ok]
        algos = ', '.join(sorted({c.algorithm for c in (bad or checks)}))
        rep.hash_ok = not bad
        rep.hash_status = f'MISMATCH ({algos})' if bad else f'ok ({algos})'
        for c in bad:
            rep.problems.append(f'{source.name(c.file)}: {c.algorithm} hash {c.found} does not match '
                                f'the {c.expected} index.json records (the bytes changed)')
    else:
        rep.hash_status = 'no hashes recorded'
    if raw is None:
        rep.bad_rows = rep.rows_expected
        return rep

    rep.problems += [f'{source.name(name)}: {p}' for p in shard_header_problems(raw, shard)]
    listed = 0
    for result in iter_shard_rows(raw, shard, vocab, seq):
        if result.problem is None:
            rep.rows_ok += 1
            rep.tokens += int(result.value['doc_lens'].sum())
            spans = result.value['loss_spans'].reshape(-1, 2).astype('int64')
            rep.loss_tokens += int((spans[:, 1] - spans[:, 0]).sum())
            continue
        rep.bad_rows += 1
        if listed < MAX_ROW_PROBLEMS:
            listed += 1
            rep.problems.append(format_row_error(
                result.problem, shard=name, row=result.row, sample_id=first_row + result.row,
                directory=source.location))
    if rep.bad_rows > listed:
        rep.problems.append(f'{source.name(name)}: {rep.bad_rows - listed} more bad rows not listed')
    return rep


# ---------------------------------------------------------------- command line
def print_report(report: VerifyReport, file: Any = None) -> None:
    """The per-shard table, the problems and the verdict (rich)."""
    from rich.console import Console
    from rich.table import Table
    console = Console(file=file or sys.stdout, width=200)
    table = Table(title=f'foundrymix verify {report.location}', title_justify='left')
    for col, justify in (('shard', 'left'), ('rows', 'right'), ('bytes', 'right'),
                         ('hash', 'left'), ('bad rows', 'right'), ('verdict', 'left')):
        table.add_column(col, justify=justify)
    for s in report.shards:
        rows = f'{s.rows_ok:,}' if s.rows_ok == s.rows_expected else f'{s.rows_ok:,} / {s.rows_expected:,}'
        if s.bytes_found is None:
            size = f'- / {s.bytes_expected:,}'
        elif s.bytes_found == s.bytes_expected:
            size = f'{s.bytes_found:,}'
        else:
            size = f'{s.bytes_found:,} / {s.bytes_expected:,}'
        style = {'ok': 'green', 'missing': 'bold red', 'corrupt': 'bold red'}[s.verdict]
        table.add_row(s.file, rows, size, '-' if s.bytes_found is None else s.hash_status,
                      f'{s.bad_rows:,}', f'[{style}]{s.verdict}[/{style}]')
    console.print(table)
    problems = report.all_problems()
    if problems:
        console.print('problems:', highlight=False)
        for p in problems:
            console.print(f'  {p}', highlight=False, markup=False, soft_wrap=True)
    n = len(report.shards)
    if report.intact:
        e = report.expected
        line = (f'verdict: INTACT -- {n} shards, {e.get("rows", 0):,} rows, {e.get("tokens", 0):,} '
                f'tokens, {e.get("loss_tokens", 0):,} loss tokens, as the manifest records')
        if not report.hashes_recorded:
            line += ('; no hashes recorded, so bit flips that keep token ids below the vocabulary '
                     'size cannot be detected')
        console.print(f'[green]{line}[/green]', highlight=False)
    else:
        bad = report.bad_shards
        what = [f'{len(bad)} of {n} shards damaged' + (': ' + ', '.join(
            f'{s.file} ({s.verdict})' for s in bad[:10]) if bad else '')]
        if report.problems:
            what.append(f'{len(report.problems)} problem(s) with manifest or index')
        if report.count_problems:
            what.append('totals differ from the manifest')
        console.print(f'[bold red]verdict: CORRUPT -- {"; ".join(what)}[/bold red]', highlight=False)


def _run(args: argparse.Namespace) -> int:
    try:
        report = verify(args.location, timeout=args.timeout)
    except ConnectionError as e:
        print(f'foundrymix verify: error: {e}', file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report)
    return 0 if report.intact else 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        'verify', help='check every shard of a converted directory: sizes, hashes, rows, counts',
        description='Check every shard of a foundrymix directory (local or s3://...): manifest and '
                    'index parse, shard sizes and recorded hashes match, every row decodes and keeps '
                    'the schema, row/token totals equal the manifest. Exit 0 if intact, 1 if not.')
    p.add_argument('location', metavar='DIR', help='a foundrymix output directory, or a remote one '
                                                   '(s3://bucket/prefix)')
    p.add_argument('--json', action='store_true', help='print the report as JSON')
    p.add_argument('--timeout', type=float, default=DEFAULT_TIMEOUT,
                   help='seconds per remote file download (default %(default)s)')
    p.set_defaults(func=_run)
