"""Where each stream's shard files are read, and fetched from if they may be missing there.

Part of :mod:`foundrymix.loader.cache`: a remote stream is read from its cache directory; a
compressed local stream is unpacked into the foundrymix cache (never into the user's
directory); an uncompressed local stream is read where it is.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Optional

from foundrymix.loader.cache.hashes import hash_algorithm


@dataclass
class Source:
    """Where one stream's shard files are read (``directory``) and, if they may be missing
    there, fetched from (``remote``: a remote directory, or the user's directory of a
    compressed local stream, whose shards are unpacked into the cache)."""

    name: str
    directory: str
    remote: Optional[str]
    shards: list[dict[str, Any]]
    algorithm: Optional[str]  #: hash checked on first open (None: no check)
    #: LLM-Foundry token rows read in place: (file dtype, document rule, separator id, row length,
    #: token dtype of the rows made of them)
    foundry: Optional[tuple[str, str, Optional[int], int, str]] = None


def unpack_directory(cache_root: Optional[str], directory: str) -> str:
    """Where a compressed local stream's shards are unpacked: the foundrymix cache."""
    from foundrymix.plan.config import cache_base
    key = hashlib.blake2s(os.path.realpath(directory).encode('utf-8'), digest_size=10).hexdigest()
    return os.path.join(cache_base(cache_root), 'unpacked', key)


def sources_of(infos: list[Any], config: Any) -> list[Source]:
    """The stores' sources for catalog infos (after the cache claimed their directories)."""
    out = []
    for info in infos:
        shards = info.index['shards']
        algo = hash_algorithm(config, info.index)
        if info.remote_dir:
            out.append(Source(info.name, info.directory, info.remote_dir, shards, algo))
        elif any(s.get('zip_data') for s in shards):
            out.append(Source(info.name, unpack_directory(config.cache_root, info.directory),
                              info.directory, shards, algo))
        else:
            out.append(Source(info.name, info.directory, None, shards, algo))
        m = info.manifest
        if m.options.get('format') == 'llm-foundry-tokens':
            out[-1].foundry = (m.options['file_dtype'], m.options['documents'], m.options['separator'],
                               m.max_seq_len, m.token_dtype)
    return out
