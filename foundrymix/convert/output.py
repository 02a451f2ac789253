"""The output directory of a conversion: what is ours in it, what a dead run left, and
the refusals that keep a user's files safe (nothing foreign is ever replaced or removed)."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil


from foundrymix.claims import pid_alive
from foundrymix.convert.upload import SHARD_NAME
from foundrymix.errors import FoundrymixError, UserError
from foundrymix.format.schema import MANIFEST_NAME
from foundrymix.format.shards import INDEX_NAME, index_files

logger = logging.getLogger(__name__)


class OutputExistsError(FoundrymixError, FileExistsError):
    """The output directory exists and is not empty, and ``overwrite`` was not given; or it
    holds files foundrymix did not write, which ``overwrite`` never replaces."""


#: foreign entries named in a refusal (the rest are counted)
NAMED_ENTRIES = 3


def owned_files(out: str) -> set[str]:
    """Files in ``out`` a conversion wrote: both metadata files and the shards the index lists
    (names must match :data:`SHARD_NAME`, so an edited index claims nothing else)."""
    meta = [os.path.join(out, n) for n in (MANIFEST_NAME, INDEX_NAME)]
    if not all(os.path.isfile(p) and not os.path.islink(p) for p in meta):
        return set()
    try:
        with open(meta[1], encoding='utf-8') as f:
            listed = index_files(json.load(f))
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        listed = set()  # unreadable index: its shards cannot be told from the user's files
    return {MANIFEST_NAME, INDEX_NAME} | {n for n in listed if SHARD_NAME.match(n)}


def foreign_entries(out: str) -> list[str]:
    """Entries of directory ``out`` that foundrymix did not write (folders with a trailing
    ``/``; inside a ``task-NNNNN/`` folder of shards, its foreign files), sorted."""
    owned = owned_files(out)
    folders = {n.split('/', 1)[0] for n in owned if '/' in n}
    foreign = []
    for entry in sorted(os.listdir(out)):
        path = os.path.join(out, entry)
        is_dir = os.path.isdir(path) and not os.path.islink(path)
        if is_dir and entry in folders:
            for sub in sorted(os.listdir(path)):
                rel = f'{entry}/{sub}'
                if rel not in owned or os.path.isdir(os.path.join(path, sub)):
                    foreign.append(rel)
        elif is_dir or entry not in owned:
            foreign.append(f'{entry}/' if is_dir else entry)
    return foreign


def check_output_dir(out: str, overwrite: bool, late: bool = False) -> None:
    """Refuse a non-empty output directory unless ``overwrite``, and even with it one holding
    anything foundrymix did not write: a typo in ``--out`` must not delete a project. ``late``: again
    at publishing, against an ``out`` that appeared while converting (left alone, this output discarded)."""
    if not late:
        check_can_create(out)
    if not (os.path.lexists if late else os.path.exists)(out):
        return
    if not os.path.isdir(out) or (late and os.path.islink(out)):
        raise OutputExistsError(f'{out}: output path {"appeared while converting" if late else "exists"} and is '
                                f'not a directory{"; left it alone" if late else ""}')
    foreign = foreign_entries(out)
    if foreign:  # with or without overwrite: advice to pass it would not work
        named = ', '.join(foreign[:NAMED_ENTRIES])
        more = f' and {len(foreign) - NAMED_ENTRIES:,} more' if len(foreign) > NAMED_ENTRIES else ''
        no_manifest = f'; it has no {MANIFEST_NAME}' if not os.path.isfile(os.path.join(out, MANIFEST_NAME)) \
            and MANIFEST_NAME not in foreign and any(e == INDEX_NAME for e in foreign) else ''
        raise OutputExistsError(
            f'{out} holds files foundrymix did not write ({named}{more}{no_manifest}); --overwrite replaces '
            f'only a foundrymix dataset ({MANIFEST_NAME}, {INDEX_NAME} and the shards {INDEX_NAME} lists). '
            f'Choose another --out, or remove them yourself{"; discarded this output" if late else ""}')
    if os.listdir(out) and not overwrite:
        raise OutputExistsError(
            f'{out}: output directory appeared while converting (another conversion into the same --out?); '
            f'left it alone and discarded this output. Pass --overwrite to replace it, or choose another --out'
            if late else f'{out}: output directory is not empty; pass --overwrite to replace it')


def check_can_create(out: str, flag: str = '--out') -> None:
    """Refuse an ``out`` whose nearest existing ancestor is a file or not writable, before any
    work (later, the error would name the hidden work directory made beside ``out``)."""
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f'{out}: cannot be created, {parent} is a file, not a directory')
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f'{out}: cannot be created, no permission to write in {parent}; choose '
                         f'another {flag}, or make {parent} writable')


def remove_output(out: str) -> list[str]:
    """Delete the files foundrymix wrote in ``out`` (:func:`owned_files`), then its emptied
    ``task-NNNNN/`` folders and ``out`` itself if nothing is left; what is not foundrymix's
    stays. Returns the entries left (:func:`foreign_entries`)."""
    owned = owned_files(out)
    # the index last: a removal cut short can be finished by the next call
    for name in sorted(owned, key=lambda n: (n == INDEX_NAME, n == MANIFEST_NAME, n)):
        try:
            os.remove(os.path.join(out, name))
        except FileNotFoundError:
            pass
    for folder in {n.split('/', 1)[0] for n in owned if '/' in n}:
        try:
            os.rmdir(os.path.join(out, folder))
        except OSError:  # not empty (or gone): left alone
            pass
    try:
        os.rmdir(out)
        return []
    except OSError:
        return sorted(os.listdir(out)) if os.path.isdir(out) else []


def remove_stale_partials(parent: str, name: str) -> None:
    """Remove ``.<name>.partial-<pid>[-<tag>]`` directories whose process is dead (a live one
    may be converting into the same ``--out``)."""
    pattern = re.compile(rf'^\.{re.escape(name)}\.partial-(\d+)(?:-[0-9a-f]+)?(?:\.old)?$')
    for stale in glob.glob(os.path.join(glob.escape(parent), f'.{glob.escape(name)}.partial-*')):
        match = pattern.match(os.path.basename(stale))
        if match is None or pid_alive(int(match.group(1))):
            continue
        if stale.endswith('.old'):  # a replaced output (see ShardWriter._publish): its files only
            left = remove_output(stale)
            if left:
                logger.warning('%s: kept (a replaced output holding files foundrymix did not write: %s)',
                               stale, ', '.join(left[:NAMED_ENTRIES]))
        else:
            shutil.rmtree(stale, ignore_errors=True)
