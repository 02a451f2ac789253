"""What a conversion may read and write: its input files, and checks that keep it from reading its
own output or harming its inputs.

Inputs are files, globs and directories, in a fixed order; directory walks skip outputs
(``foundrymix.json`` or MDS ``index.json``), hidden entries, the ``--out``, and ``.json`` files
(read only when named or globbed, then checked to be JSON Lines). An ``--out`` that is, holds, or
lies inside an input is refused before any work (symbolic links resolved). ``--out`` is first split
into an ``s3://`` remote and/or a local directory (:func:`split_out`; ``os.path`` would make
``s3:/bucket``); input URLs are refused.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from foundrymix.errors import FoundrymixError, UserError
from foundrymix.format.schema import MANIFEST_NAME

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


def sub_out(out: OutSpec, name: str) -> OutSpec:
    """``OUT/<name>`` for a local folder, an ``s3://`` prefix, or a (local, remote) pair."""
    if isinstance(out, (tuple, list)):
        return tuple(sub_out(o, name) for o in out)  # type: ignore[return-value]
    return f"{out.rstrip('/')}/{name.replace(os.sep, '/')}" if is_url(out) else os.path.join(out, name)


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


JSONL_SUFFIXES = ('.jsonl', '.json', '.ndjson')
#: input formats by the end of a file's name (``.jsonl.gz`` and ``.jsonl.zst``: jsonl_stream)
_FORMATS = {**dict.fromkeys(JSONL_SUFFIXES, 'jsonl'), '.txt': 'txt', '.parquet': 'parquet'}
#: a directory holding one of these is conversion output, never an input
OUTPUT_MARKERS = (MANIFEST_NAME, 'index.json')
#: what ``DatasetDict.save_to_disk`` writes beside its split directories
DATASET_DICT = 'dataset_dict.json'


class InputNotFoundError(FoundrymixError, FileNotFoundError):
    """An input path or glob matches nothing."""


def input_format(path: str) -> str:
    """Format of one resolved input: jsonl | jsonl_stream | txt | parquet | hf | mds (an MDS
    dataset directory: read only by ``foundrymix adopt``, never found by :func:`discover_inputs`)."""
    if os.path.isdir(path):
        if _is_hf_dataset(path):
            return 'hf'
        if os.path.isfile(os.path.join(path, 'index.json')):
            return 'mds'
        raise UserError(f'{path}: a directory is not a single input (expected a dataset saved '
                         f'with `datasets.save_to_disk`)')
    name = path.lower()
    if name.endswith(('.gz', '.zst')):
        if name.rsplit('.', 1)[0].endswith(JSONL_SUFFIXES):
            return 'jsonl_stream'
        raise UserError(f'{path}: only compressed jsonl is supported (.jsonl.gz, .jsonl.zst)')
    for suffix, fmt in _FORMATS.items():
        if name.endswith(suffix):
            return fmt
    raise UserError(f'{path}: unsupported input type (expected .jsonl[.gz|.zst], .txt, .parquet '
                     f'or a dataset saved to disk)')


def _is_hf_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, 'state.json')) or os.path.isfile(os.path.join(path, DATASET_DICT))


def _supported(path: str, expanding: bool = False) -> bool:
    """Whether ``path`` is an input we read; ``expanding``: found by walking a directory or a
    glob, where a ``.json`` file is not taken as JSON Lines (read only when named)."""
    try:
        input_format(path)
    except ValueError:
        return False
    return not (expanding and path.lower().endswith('.json'))


def output_marker(directory: str) -> Optional[str]:
    """The file that marks ``directory`` as conversion output (``foundrymix.json`` or an MDS
    ``index.json``), or ``None``: such directories are never inputs."""
    return next((name for name in OUTPUT_MARKERS if os.path.isfile(os.path.join(directory, name))), None)


def _expand_dir(directory: str, exclude: Optional[str] = None, split: Optional[str] = None) -> list[str]:
    """Inputs inside a directory: itself if it is a saved dataset (one split of a
    ``DatasetDict``), else supported files, sorted, skipping what the module docstring lists
    (``exclude``: the real path of ``--out``)."""
    if os.path.isfile(os.path.join(directory, DATASET_DICT)):
        return [_dict_split(directory, split)]
    if _is_hf_dataset(directory):
        return [directory]
    found: list[str] = []
    for root, dirs, files in os.walk(directory, onerror=_unlisted):
        dirs.sort()
        dirs[:] = [d for d in dirs
                   if not d.startswith('.') and not _skipped_dir(os.path.join(root, d), exclude)]
        hf = [d for d in dirs if _is_hf_dataset(os.path.join(root, d))]
        found.extend(p for d in hf for p in _expand_dir(os.path.join(root, d), split=split))
        dirs[:] = [d for d in dirs if d not in hf]
        found.extend(os.path.join(root, f) for f in sorted(files)
                     if not f.startswith('.') and _supported(os.path.join(root, f), expanding=True))
    return found


def _dict_split(directory: str, split: Optional[str]) -> str:
    """The split of the ``DatasetDict`` saved in ``directory`` that is converted: ``split``,
    or its only one. Several splits without ``split`` are refused: converted together, a
    test split would become training data."""
    with open(os.path.join(directory, DATASET_DICT), encoding='utf-8') as f:
        splits = list(json.load(f).get('splits', []))
    if split is None and len(splits) == 1:
        split = splits[0]
    if split is None:
        raise UserError(f'{directory}: a DatasetDict with splits {", ".join(splits)}; converting them into '
                         f'one dataset would mix them (a test split becomes training data): pass --split '
                         f'NAME to convert one (e.g. --split {splits[0]}), and each other split into an '
                         f'--out of its own')
    if split not in splits:
        raise UserError(f'--split {split}: {directory} has no such split (its splits: {", ".join(splits)})')
    return os.path.join(directory, split)


def _unlisted(e: OSError) -> None:
    """Refuse a directory ``os.walk`` cannot list (it would skip it silently, and the
    inputs in it would look absent)."""
    raise UserError(f'{e.filename}: cannot list this directory ({e.strerror.lower()})')


def _skipped_dir(path: str, exclude: Optional[str]) -> bool:
    return output_marker(path) is not None or (
        exclude is not None and os.path.realpath(path) == exclude)


def _refuse_output_dir(spec: str, directory: str) -> None:
    marker = output_marker(directory)
    if marker is not None:
        what = 'a foundrymix output directory' if marker == MANIFEST_NAME else 'an MDS output directory'
        where = spec if os.path.isdir(spec) else directory
        advice = 'give the raw corpus instead' if marker == MANIFEST_NAME else \
            f'give the raw corpus instead, or use these shards as they are: foundrymix adopt {where} --out DIR'
        raise UserError(f'{spec}: {"" if where == spec else f"in {where}, "}{what} (it holds {marker}), '
                         f'not an input; {advice}')


#: the first bytes of compressed data: (name, magic, suffix, command that decompresses in place)
_MAGIC = (('gzip', b'\x1f\x8b', '.gz', 'gunzip'), ('zstd', b'\x28\xb5\x2f\xfd', '.zst', 'unzstd --rm'))


def check_input_file(path: str) -> None:
    """Refuse, before any work and saying why, an input file this process cannot open; a plain-text
    input (``.jsonl``, ``.json``, ``.ndjson``, ``.txt``) holding gzip or zstd data, naming the rename
    that makes it readable; a ``.json`` file whose first non-blank line is not a whole JSON object
    (rather than one bad record per line)."""
    if os.path.isdir(path):  # a dataset saved to disk: datasets reads it
        return
    fmt = input_format(path)
    try:
        f = open(path, 'rb')
    except OSError as e:
        raise UserError(f'{path}: cannot read this input ({e.strerror.lower()})') from None
    with f:
        head = f.read(4) if fmt in ('jsonl', 'txt') else b''
        for name, magic, suffix, command in _MAGIC:
            if head.startswith(magic):
                if fmt == 'jsonl':
                    fix = f'rename it to {path}{suffix} (read as compressed JSON Lines)'
                else:
                    fix = f'rename it to {path}{suffix} and decompress it ({command} {path}{suffix})'
                raise UserError(f'{path}: holds {name}-compressed data, not text (its name ends in '
                                 f'{os.path.splitext(path)[1]}); {fix}')
        f.seek(0)
        for line in f if path.lower().endswith('.json') else ():
            if not line.strip():
                continue
            try:
                ok = isinstance(json.loads(line), dict)
            except ValueError:
                ok = False
            if not ok:
                raise UserError(f'{path}: not JSON Lines (its first line is not a whole JSON object; '
                                 f'a pretty-printed JSON document or an array?); write one object per '
                                 f'line (.jsonl)')
            return


def discover_inputs(specs: Sequence[str], exclude: Optional[str] = None,
                    split: Optional[str] = None) -> list[str]:
    """Resolve files, globs and directories to a duplicate-free list in ``specs`` order, matches
    sorted by path (never file-system order). Naming an output is an error; a saved
    ``DatasetDict`` gives one split: ``split``, or its only one."""
    if not specs:
        raise UserError('no inputs given')
    resolved: list[str] = []
    for spec in specs:
        if is_url(spec):
            raise UnsafePathsError(f'{spec}: reading inputs from object stores is not supported; '
                                   f'download them to a local directory first')
        if glob.has_magic(spec):
            paths = _glob_inputs(spec, exclude, split)
        elif os.path.isdir(spec):
            _refuse_output_dir(spec, spec)
            paths = _expand_dir(spec, exclude, split)
        elif os.path.exists(spec):
            _refuse_output_dir(spec, os.path.dirname(os.path.abspath(spec)))
            input_format(spec)  # raises for an unsupported file named explicitly
            paths = [spec]
        else:
            raise InputNotFoundError(f'{spec}: no such file or directory')
        if not paths and os.path.isdir(spec):
            _refuse_mds_root(spec)
        if not paths:
            raise UserError(f'{spec}: no supported input files found (.jsonl[.gz|.zst], .ndjson, .txt, '
                             f'.parquet, datasets saved to disk; .json only when named)')
        for p in paths:
            check_input_file(p)
        resolved.extend(os.path.abspath(p) for p in paths)
    if split is not None and not any(os.path.isfile(os.path.join(os.path.dirname(p), DATASET_DICT))
                                     for p in resolved):
        raise UserError(f'--split {split}: no input is a DatasetDict saved to disk ({DATASET_DICT}); '
                         f'leave --split out')
    return list(dict.fromkeys(resolved))


def _refuse_mds_root(spec: str) -> None:
    """A folder whose only inputs are MDS datasets (an LLM-Foundry root: ``train/index.json``...):
    say so and how to use them, instead of "no supported input files found"."""
    found = []
    for root, dirs, files in os.walk(spec):
        dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
        if 'index.json' in files and MANIFEST_NAME not in files:
            found.append(os.path.relpath(os.path.join(root, 'index.json'), spec))
            dirs[:] = []
    if found:
        more = f' and {len(found) - 3} more' if len(found) > 3 else ''
        raise UserError(f'{spec}: holds MDS shards ({", ".join(found[:3])}{more}), not raw input files; '
                         f'use them as they are with: foundrymix adopt {spec} --out DIR')


def _glob_inputs(spec: str, exclude: Optional[str], split: Optional[str] = None) -> list[str]:
    matches = sorted(glob.glob(spec, recursive=True))
    if not matches:
        raise InputNotFoundError(f'{spec}: no file matches this pattern')
    asked_json = spec.lower().endswith('.json')
    paths = []
    for m in matches:
        if os.path.isdir(m):
            if not _skipped_dir(m, exclude):
                paths.extend(_expand_dir(m, exclude, split))
        elif output_marker(os.path.dirname(os.path.abspath(m))) is None and (
                _supported(m, expanding=True) or (asked_json and _supported(m))):
            paths.append(m)
    return paths
