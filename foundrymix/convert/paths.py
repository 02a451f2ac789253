"""Checks that keep a conversion from reading its own output or harming its inputs.

An ``--out`` that is, holds, or lies inside an input is refused before any work (symbolic links
resolved). ``--out`` is first split into an ``s3://`` remote and/or a local directory
(:func:`split_out`; ``os.path`` would make ``s3:/bucket``); input URLs are refused.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from foundrymix.errors import FoundrymixError

_URL = re.compile(r'^[A-Za-z][A-Za-z0-9+.-]*://')
#: a URL missing a slash: ``s3:/bucket`` (two letters or more: no drive letter), or a known
#: scheme glued to the bucket (``s3:bucket``; ``run:2024`` stays a local folder)
_MISTYPED_URL = re.compile(r'^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):(?:/(?!/)|$)(?P<rest>.*)$')
_KNOWN_SCHEMES = ('s3', 'gs', 'gcs', 'az', 'abfs', 'abfss', 'wasb', 'wasbs', 'oci', 'hf', 'http', 'https',
                  'file', 'ftp', 'sftp', 'dbfs', 'r2', 'hdfs')
_GLUED_URL = re.compile(rf"^(?P<scheme>{'|'.join(_KNOWN_SCHEMES)}):(?P<rest>[^/].*)$", re.IGNORECASE)


class UnsafePathsError(FoundrymixError, ValueError):
    """``--out`` and the inputs overlap, or a path is a URL (nothing was read or written)."""


def is_url(path: str) -> bool:
    """Whether ``path`` looks like ``scheme://...`` rather than a local path."""
    return bool(_URL.match(path))


def check_out_url(out: str, option: str = '--out') -> None:
    """Refuse a ``scheme://`` path as a *local* output directory (see :func:`split_out`),
    and a mistyped URL (``s3:/bucket``, ``s3:bucket``): as a local path it would quietly
    create a folder ``s3:`` in the current directory (exit 0, nothing uploaded)."""
    if is_url(out):
        raise UnsafePathsError(
            f'{out}: a URL cannot be the local output directory; give the remote as '
            f'--out s3://bucket/prefix and the local copy as --keep-local DIR')
    m = _MISTYPED_URL.match(out) or _GLUED_URL.match(out)
    if m:
        scheme, folder = m.group('scheme'), out.split('/')[0]
        what = f"{option} {out}: looks like a mistyped URL (as a local path it would create a folder '{folder}')"
        if scheme.lower() == 's3':
            raise UnsafePathsError(f"{what}; write s3://{m.group('rest') or 'bucket/prefix'}, or ./{out} "
                                   f"for a local folder of that name")
        raise UnsafePathsError(f'{what}; only s3://bucket/prefix is supported as a remote output: for '
                               f'another store convert to a local directory, then copy it (write ./{out} '
                               f'for a local folder of that name)')


#: what ``--out`` may be: a local directory, an ``s3://`` prefix, or a (local, remote) pair
OutSpec = Union[str, tuple[str, str]]


@dataclass(frozen=True)
class Output:
    """Where a conversion goes: a local directory, an S3 prefix, or both (a local copy)."""

    local: Optional[str]
    remote: Optional[str]

    def __str__(self) -> str:
        if self.remote and self.local:
            return f'{self.remote} (local copy: {self.local})'
        return self.remote or self.local or ''


def split_out(out: OutSpec) -> Output:
    """``--out`` as given (a string, or a ``(local, remote)`` pair) -> :class:`Output`;
    only ``s3://`` is a remote, a URL in the local slot is refused."""
    if isinstance(out, (tuple, list)):
        if len(out) != 2:
            raise UnsafePathsError(f'--out {out!r}: expected a local directory, an s3:// prefix '
                                   f'or a (local directory, s3:// prefix) pair')
        local, remote = out
        check_out_url(local, '--keep-local')
        if not is_url(remote):
            raise UnsafePathsError(f'{remote}: the remote of an output pair must be s3://bucket/prefix')
    elif is_url(out):
        local, remote = None, out
    else:
        check_out_url(out)
        local, remote = out, None
    if remote is not None and not remote.lower().startswith('s3://'):
        raise UnsafePathsError(f'--out {remote}: only s3://bucket/prefix is supported as a remote output; '
                               f'for another store convert to a local directory, then copy it')
    return Output(local=local, remote=remote)


def check_input_urls(specs: Sequence[str]) -> None:
    for spec in specs:
        if is_url(spec):
            raise UnsafePathsError(f'{spec}: reading inputs from object stores is not supported; '
                                   f'download them to a local directory first')


def _inside(path: str, directory: str) -> bool:
    """Whether real path ``path`` is ``directory`` or lies below it."""
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def check_overlap(specs: Sequence[str], resolved: Sequence[str], out: str) -> None:
    """Refuse inputs at or under ``out``, and ``out`` at or under an input directory; ``specs``
    (as given) and ``resolved`` (what is read) both, so a link into ``out`` is caught."""
    real_out = os.path.realpath(out)
    given = [m for s in specs for m in (sorted(glob.glob(s, recursive=True)) if glob.has_magic(s) else [s])]
    for path in [*given, *resolved]:
        if is_url(path) or not os.path.exists(path):
            continue
        real = os.path.realpath(path)
        if _inside(real, real_out):
            raise UnsafePathsError(
                f'input {path} is {"the" if real == real_out else "inside the"} output directory {out}'
                f'{f" (resolved: {real} in {real_out})" if real != os.path.abspath(path) else ""}; '
                f'writing there (--overwrite) would delete it. Choose another --out')
        if os.path.isdir(real) and _inside(real_out, real):
            raise UnsafePathsError(
                f'output directory {out} is inside the input directory {path}'
                f'{f" (resolved: {real_out} in {real})" if real_out != os.path.abspath(out) else ""}; '
                f'a later conversion of {path} would read it. Choose an --out outside the inputs')
