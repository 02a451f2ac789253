"""Which cache directory a run uses: claims (``flock`` s, released when a process dies) of the
default cache and of a named ``local:``, so that two live runs never evict each other's shards.
"""

from __future__ import annotations

import logging

from foundrymix import claims
from foundrymix.claims import Claim
from foundrymix.config import ConfigError

log = logging.getLogger(__name__)

#: candidate directories tried for one default-cache directory before giving up
MAX_CANDIDATES = 64


def claim(home: str, shared_default: bool, where: str) -> Claim:
    """Claim ``home`` or, for the default cache (``shared_default``), its first sibling no other
    live run holds (ranks of one job share it); a named ``local:`` another run holds is refused.
    The claim is ``fresh`` when no live run held it before (what dead runs left may be cleaned)."""
    configured, home = home, claims.normalize(home)
    paths = [home] + [f'{home}-run{k + 1}' for k in range(1, MAX_CANDIDATES if shared_default else 1)]
    me = claims.run_id()
    busy: list[claims.Busy] = []
    with claims.guard(home, '.group'):  # two runs starting at once never pick the same directory
        # First a directory this run already holds (another rank of the same job), then a free one.
        for path in paths:
            owner = claims.exclusive_owner(path)
            if owner is not None and owner.run == me:
                return claims.try_claim(path, claims.EXCLUSIVE)
        for path in paths:
            try:
                got = claims.try_claim(path, claims.EXCLUSIVE)
            except claims.Busy as e:
                busy.append(e)
                continue
            if path != home:
                log.warning('%s: cache directory %s is in use by another live run (%s); this run '
                            'uses %s (its shards are downloaded again)', where, configured,
                            busy[0].holders[0].run if busy and busy[0].holders else 'unknown', path)
            return got
    holders = busy[0].holders if busy else []
    who = holders[0].who() if holders else 'a run'
    if not shared_default:
        raise ConfigError(
            f'{where}.local: {configured} is in use by another live run, {who}. Two runs do not '
            f'share one cache directory at once (each may evict the other\'s shards under its '
            f'cache_limit, and each cleans what dead runs left there). Give this run its own '
            f'local: directory, or leave local: out to use the default cache, which gives '
            f'runs that overlap in time a directory each')
    raise ConfigError(f'{where}: all {MAX_CANDIDATES} cache directories for {configured} are in use '
                      f'by live runs (e.g. {who}); set cache_root to another directory')
