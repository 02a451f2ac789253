"""A corrupt row, named in one line -- stream, directory, shard, row, sample and problem --
that survives a DataLoader worker's traceback and is parsed back from it."""

from __future__ import annotations

import re
from typing import Optional

from foundrymix.errors import FoundrymixError


class CorruptRowError(FoundrymixError, ValueError):
    """A stored row that cannot be read or breaks the schema, named by stream, shard and row,
    so a damaged shard stops the run there rather than in the model's embedding.

    Constructible from its message alone (torch's DataLoader re-raises a worker's error as
    ``type(e)(text)``): the fields are parsed back from the worker's text."""

    def __init__(self, text: str = '', *, stream: Optional[str] = None, shard: Optional[str] = None,
                 row: Optional[int] = None, sample_id: Optional[int] = None,
                 problem: Optional[str] = None, directory: Optional[str] = None) -> None:
        if problem is None and text:
            parsed = _parse_row_error(text)
            if parsed is not None:
                text, stream, shard, row, sample_id, problem, directory = parsed
        elif problem is not None and not text:
            text = format_row_error(problem, shard=shard, row=row, stream=stream,
                                    sample_id=sample_id, directory=directory)
        super().__init__(text)
        self.stream, self.shard, self.row = stream, shard, row
        self.sample_id, self.problem, self.directory = sample_id, problem, directory


def format_row_error(problem: str, *, shard: Optional[str], row: Optional[int],
                     stream: Optional[str] = None, sample_id: Optional[int] = None,
                     directory: Optional[str] = None) -> str:
    """One line: ``corrupt row: stream 'S' (DIR), shard F, row R (sample N): PROBLEM``."""
    where = []
    if stream is not None:
        where.append(f"stream '{stream}'" + (f' ({directory})' if directory else ''))
    elif directory:
        where.append(directory)
    where.append(f'shard {shard}, row {row}' + (f' (sample {sample_id})' if sample_id is not None else ''))
    problem = ' '.join(str(problem).split())  # one line, so it survives a worker's traceback
    return f"corrupt row: {', '.join(where)}: {problem}"


_ROW_ERROR_RE = re.compile(
    r"corrupt row: (?:stream '(?P<stream>[^']*)'(?: \((?P<sdir>[^)]*)\))?, |(?P<dir>[^,\n]*), )?"
    r"shard (?P<shard>[^,\n]*), row (?P<row>\d+)(?: \(sample (?P<sample>\d+)\))?: "
    r"(?P<problem>[^\n]*)")


def _parse_row_error(text: str) -> Optional[tuple]:
    """Fields of the last :func:`format_row_error` line in ``text`` (e.g. a worker's traceback)."""
    matches = list(_ROW_ERROR_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    sample = m.group('sample')
    return (m.group(0), m.group('stream'), m.group('shard'), int(m.group('row')),
            int(sample) if sample is not None else None, m.group('problem'),
            m.group('sdir') or m.group('dir'))
