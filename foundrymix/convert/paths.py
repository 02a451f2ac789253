"""Checks that keep a conversion from reading its own output or harming its inputs.

Why: ``--overwrite`` deletes the output directory before publishing the new one. If
``--out`` is an input, holds an input, or lies inside an input directory, that deletes
(or, on the next run, re-reads) the user's corpus. Paths are compared after resolving
symbolic links (``os.path.realpath``), so a link cannot hide the overlap. The checks
run before any work and hold with or without ``--overwrite``.

Object-store URLs (``s3://...``) are not local paths: ``os.path`` would happily turn
``s3://bucket/x`` into a local folder ``s3:/bucket/x``. They are refused for ``--out``
(writing to object stores is not supported yet: convert locally, then upload) and for
inputs (download first).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Sequence

_URL = re.compile(r'^[A-Za-z][A-Za-z0-9+.-]*://')


class UnsafePathsError(ValueError):
    """``--out`` and the inputs overlap, or a path is a URL (nothing was read or written)."""


def is_url(path: str) -> bool:
    """Whether ``path`` looks like ``scheme://...`` rather than a local path."""
    return bool(_URL.match(path))


def check_out_url(out: str) -> None:
    """Refuse ``scheme://`` output paths before ``os.path`` turns them into local folders."""
    if is_url(out):
        raise UnsafePathsError(
            f'--out {out}: writing to object stores is not supported yet; convert to a local '
            f'directory, then upload it (e.g. `aws s3 sync DIR {out}`)')


def check_input_urls(specs: Sequence[str]) -> None:
    for spec in specs:
        if is_url(spec):
            raise UnsafePathsError(f'{spec}: reading inputs from object stores is not supported; '
                                   f'download them to a local directory first')


def _inside(path: str, directory: str) -> bool:
    """Whether real path ``path`` is ``directory`` or lies below it."""
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def check_overlap(specs: Sequence[str], resolved: Sequence[str], out: str) -> None:
    """Refuse inputs at or under ``out``, and ``out`` at or under an input directory.

    ``specs`` are the inputs as given (files, directories, globs: their matches count),
    ``resolved`` the files and datasets that would be read. Both are
    checked so that a symbolic link inside an input directory pointing into ``out`` is
    caught too. The message names both paths.
    """
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
