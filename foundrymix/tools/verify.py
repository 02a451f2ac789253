"""``foundrymix verify DIR|REMOTE``: check every shard of a converted directory, local or remote,
byte for byte, with :mod:`foundrymix.format.shards`' checks; exit 0 iff intact, 1 if damaged."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from foundrymix.errors import MissingError, UserError
from foundrymix.format.schema import MANIFEST_NAME, Manifest, format_row_error, mds_columns
from foundrymix.format.shards import (INDEX_NAME, IndexFileError, ShardProblem, hashes_dropped_problem,
                                      iter_shard_rows, read_index, row_count_problem, shard_hash_checks,
                                      shard_header_problems, shard_name, shard_raw_bytes)
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


class Source(contextlib.AbstractContextManager):
    """A directory's files by basename: a local directory's own, or a remote one's fetched into a
    temporary directory, removed on exit."""

    def __init__(self, location: str, timeout: float) -> None:
        self.remote = is_remote(location)
        self.location = location.rstrip('/') if self.remote else location
        self.timeout = timeout
        self.dir = tempfile.mkdtemp(prefix='foundrymix-remote-') if self.remote else location

    def __exit__(self, *exc: Any) -> None:
        if self.remote:
            shutil.rmtree(self.dir, ignore_errors=True)

    def name(self, basename: str) -> str:
        """How to name a file in messages: its remote URL or local path."""
        return f'{self.location}/{basename}' if self.remote else os.path.join(self.dir, basename)

    def fetch(self, basename: str) -> Optional[str]:
        """Local path of a file of the directory, ``None`` if it does not exist."""
        local = os.path.join(self.dir, basename)
        if not self.remote:
            return local if os.path.isfile(local) else None
        try:
            download(f'{self.location}/{basename}', local, self.timeout)
        except ConnectionError as e:  # foundrymix.s3.remote.RemoteError: names URL, S3 code, what to check
            if getattr(e, 'kind', None) == 'not_found':
                return None
            raise
        return local

    def release(self, basename: str) -> None:
        if self.remote:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.dir, basename))

    def manifest(self) -> Manifest:
        """The directory's manifest, refused as :meth:`Manifest.read` refuses it (a missing one
        with what the directory holds instead), naming the remote location, not the download."""
        if self.fetch(MANIFEST_NAME) is None and self.remote:
            self.fetch(INDEX_NAME)  # MDS written by another tool: the refusal says to adopt it
        try:
            return Manifest.read(self.dir)
        except (MissingError, ValueError) as e:
            if not self.remote:
                raise
            error = MissingError if isinstance(e, MissingError) else UserError
            raise error(str(e).replace(self.dir, self.location)) from None


def verify(location: str, timeout: float = DEFAULT_TIMEOUT) -> VerifyReport:
    """Verify a foundrymix directory (local path or remote URL): damage goes in the report;
    ``FileNotFoundError`` if it is not one, ``ConnectionError`` if a remote cannot be read."""
    if not is_remote(location) and not os.path.isdir(location):
        raise MissingError(f'{location}: no such directory')
    with Source(location, timeout) as source:
        return _verify(source)


def _verify(source: Source) -> VerifyReport:
    report = VerifyReport(location=source.location)
    try:
        manifest: Optional[Manifest] = source.manifest()
    except ValueError as e:  # a damaged manifest (a missing one raises)
        report.problems.append(str(e))
        manifest = None
    if source.fetch(INDEX_NAME) is None:
        report.problems.append(f'{source.name(INDEX_NAME)}: missing (an incomplete conversion or copy?)')
        return report
    try:
        index = read_index(source.dir)
    except IndexFileError as e:
        report.problems.append(str(e).replace(source.dir, source.location))
        return report

    first_row = 0
    for shard in index['shards']:
        report.shards.append(_verify_shard(source, shard, manifest, first_row))
        first_row += int(shard['samples'])

    report.found = {key: sum(getattr(s, attr) for s in report.shards)
                    for key, attr in (('rows', 'rows_ok'), ('tokens', 'tokens'), ('loss_tokens', 'loss_tokens'))}
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


def _verify_shard(source: Source, shard: dict[str, Any], manifest: Optional[Manifest], first_row: int) -> ShardReport:
    """Every check of one shard, in order (fetch, size, hashes, decompression, header, rows), into
    its report: each step reads what the previous produced, and a failure ends the later ones."""
    name = shard_name(shard)
    raw_info, zip_info = shard['raw_data'], shard.get('zip_data')
    stored = zip_info or raw_info  # what a conversion writes
    rep = ShardReport(file=name, rows_expected=int(shard['samples']), bytes_expected=int(stored['bytes']))
    if manifest is not None:
        columns = mds_columns(manifest.max_seq_len, manifest.token_dtype)
        found_columns = dict(zip(shard['column_names'], shard['column_encodings']))
        if found_columns != columns:
            rep.problems.append(f'{source.name(name)}: columns {found_columns} are not the foundrymix '
                                f'schema of the manifest {columns}')

    # Files present: locally the raw and/or the compressed one; remotely the stored one.
    files: dict[str, bytes] = {}
    checks = []
    for info in [stored] if source.remote else [i for i in (raw_info, zip_info) if i]:
        path = source.fetch(info['basename'])
        if path is None:
            continue
        with open(path, 'rb') as f:
            data = files[info['basename']] = f.read()
        source.release(info['basename'])
        if len(data) != int(info['bytes']):
            rep.problems.append(ShardProblem(name, source.name(info['basename']), 'size',
                                             int(info['bytes']), len(data)).describe())
        checks += shard_hash_checks(info, data)
    if not files:
        rep.problems.append(ShardProblem(name, source.name(stored['basename']), 'missing',
                                         int(stored['bytes']), None).describe())
        rep.bad_rows = rep.rows_expected
        return rep
    rep.bytes_found = len(files.get(stored['basename'], next(iter(files.values()))))

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
    for result in iter_shard_rows(raw, shard, manifest and manifest.tokenizer.vocab_size,
                                  manifest and manifest.max_seq_len):
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
    report = verify(args.location, timeout=args.timeout)  # a RemoteError: one line, exit 2
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
