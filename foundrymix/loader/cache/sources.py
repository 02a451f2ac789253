"""Where each stream's shard files are read, and fetched from if they may be missing there: a remote
stream's cache directory; the foundrymix cache for a compressed local stream (unpacked there, never
in the user's directory); an uncompressed local stream where it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from foundrymix.loader.cache.hashes import cache_file, hash_algorithm


@dataclass
class Source:
    """One stream's shard files: read in ``directory``, fetched from ``remote`` (a remote, or a
    compressed local stream's directory) if set."""

    name: str
    directory: str
    remote: Optional[str]
    shards: list[dict[str, Any]]
    algorithm: Optional[str]  #: hash checked on first open (None: no check)
    #: LLM-Foundry token rows read in place: (file dtype, document rule, separator id, row length,
    #: token dtype of the rows made of them)
    foundry: Optional[tuple[str, str, Optional[int], int, str]] = None
    #: ``remote`` is the user's own compressed local stream (damage there is fixed there, not uploaded)
    local: bool = False


def sources_of(infos: list[Any], config: Any) -> list[Source]:
    """The stores' sources for catalog infos (after the cache claimed their directories)."""
    out = []
    for info in infos:
        shards = info.index['shards']
        algo = hash_algorithm(config, info.index)
        if info.remote_dir:
            out.append(Source(info.name, info.directory, info.remote_dir, shards, algo))
        elif any(s.get('zip_data') for s in shards):
            unpacked = cache_file(config.cache_root, 'unpacked', info.directory)
            out.append(Source(info.name, unpacked, info.directory, shards, algo, local=True))
        else:
            out.append(Source(info.name, info.directory, None, shards, algo))
        m = info.manifest
        if m.options.get('format') == 'llm-foundry-tokens':
            out[-1].foundry = (m.options['file_dtype'], m.options['documents'], m.options['separator'],
                               m.max_seq_len, m.token_dtype)
    return out
