"""What a killed run left in a cache directory: ``<file>.part-<pid>[-<hex>]`` of a dead process
(older ``<file>.tmp`` and boto3's ``<file>.<8 hex>`` too) whose file the index names, removed.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from foundrymix.claims import pid_alive
from foundrymix.loader.cache.space import remove_plain_file

log = logging.getLogger(__name__)

_PART_PID = re.compile(r'^(?P<base>.+)\.part-(?P<pid>\d+)(?:-[0-9a-f]+)?$')
_PARTIAL = re.compile(r'^(?P<base>.+)\.(?:[0-9A-Fa-f]{8}|tmp)$')


def clean_stale(directory: str, stream_dirs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Remove dead runs' partial files from each (stream directory, index) of ``directory``
    (call only on a directory no live run holds); returns what was removed."""
    removed: list[str] = []
    for stream_dir, index in stream_dirs:
        names = {'index.json', 'foundrymix.json'} | {
            shard[key]['basename'] for shard in index.get('shards', []) for key in ('raw_data', 'zip_data')
            if shard.get(key)}
        try:
            listing = os.listdir(stream_dir)
        except FileNotFoundError:
            continue
        for entry in listing:
            part, partial = _PART_PID.match(entry), _PARTIAL.match(entry)
            if part:
                stale = part.group('base') in names and not pid_alive(int(part.group('pid')))
            else:
                stale = bool(partial) and partial.group('base') in names
            if stale:
                remove_plain_file(os.path.join(stream_dir, entry), removed)
    if removed:
        log.warning('cache %s: removed what dead runs left: %s', directory, ', '.join(removed))
    return removed
