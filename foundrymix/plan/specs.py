"""The stream and adaptive sections of a ``train_loader``, checked when read, and the knobs no
section may give (:mod:`foundrymix.plan.config` holds the loader config that contains them)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from foundrymix.config import ConfigError, FROM_KEY, Gather, parse_time, read_dataclass, to_plain

_SCHEME = re.compile(r'^[A-Za-z][A-Za-z0-9+.-]*://')
_GLOB = re.compile(r'[*?\[]')


def is_pattern(name: str) -> bool:
    """A ``streams`` key with ``*``, ``?`` or ``[`` is a group: weights for every stream it
    matches (``fnmatch``), no stream of its own."""
    return bool(_GLOB.search(name))


@dataclass
class StreamSpec:
    """One entry of ``train_loader.streams``: where a stream lives and how much of it to use
    (one of ``repeat``, ``proportion``, ``choose``, or ``proportion`` and ``repeat``: the share,
    and the passes that size the epoch). A glob name is a group: one weight, no location."""

    name: str = field(default='', metadata=FROM_KEY)
    local: Optional[str] = None
    remote: Optional[str] = None
    split: Optional[str] = None
    repeat: Optional[float] = None
    proportion: Optional[float] = None
    choose: Optional[int] = None
    #: the tokenizer LLM-Foundry token shards (a ``tokens`` column, no foundrymix.json) were
    #: made with, to use them in place (:mod:`foundrymix.format.foundry_tokens`)
    tokenizer: Optional[str] = None

    @property
    def weight_kind(self) -> Optional[str]:
        for key in ('proportion', 'repeat', 'choose'):
            if getattr(self, key) is not None:
                return key
        return None

    def check(self, where: str) -> None:
        if is_pattern(self.name):
            self._check_group(where)
        elif not self.local and not self.remote:
            raise ConfigError(f'{where}: needs local and/or remote')
        if self.remote and _SCHEME.match(self.remote) and not self.remote.startswith('s3://'):
            raise ConfigError(f'{where}.remote: {self.remote!r}: foundrymix reads remotes from S3 '
                              f'(s3://bucket/path; S3_ENDPOINT_URL for another S3-compatible '
                              f'store) or a mounted path; copy the data to one of those')
        if self.local and _SCHEME.match(self.local):
            raise ConfigError(f'{where}.local: {self.local!r} is a URL, not a local directory; put '
                              f'it in remote: (and local: where to cache it, or leave local out)')
        given = [k for k in ('repeat', 'proportion', 'choose') if getattr(self, k) is not None]
        if len(given) > 1 and (given != ['repeat', 'proportion'] or is_pattern(self.name)):
            raise ConfigError(f'{where}: give at most one of repeat, proportion, choose '
                              f'(got {", ".join(given)}; a stream, not a group, may give proportion '
                              f'and repeat: its share, and whole passes of it that size the epoch)')
        for key in given:
            if getattr(self, key) < 0:
                raise ConfigError(f'{where}.{key}: must be >= 0, got {getattr(self, key)}')

    def _check_group(self, where: str) -> None:
        placed = [k for k in ('local', 'remote', 'split') if getattr(self, k) is not None]
        if placed:
            raise ConfigError(
                f'{where}: {self.name!r} is a pattern (a group of the streams it matches), so it '
                f'carries only a weight (repeat, proportion or choose), not {", ".join(placed)}; '
                f'give each stream its location under its own name (without * ? [)')
        if self.weight_kind is None:
            raise ConfigError(f'{where}: the pattern {self.name!r} gives no weight; give it one of '
                              f'repeat, proportion, choose (or delete it)')


AdaptiveMethod = Literal['odm', 'ado', 'fixed', 'replay']


@dataclass
class AdaptiveConfig:
    """``train_loader.adaptive`` (or a stage's): every ``every`` batches from ``warmup`` on,
    the policy sets the next segment's weights from the per-stream loss summed over all
    ranks, each stream keeping at least ``min_share`` (docs/adaptive.md)."""

    #: ado by default: in docs/adaptive.md's proof run ODM chased a stream of random tokens
    method: AdaptiveMethod = 'ado'
    every: str = '50ba'
    warmup: str = '0ba'
    min_share: float = 0.02
    seed: Optional[int] = None       # default: the loader's shuffle_seed
    alpha: float = 0.9               # ODM: reward moving average; ADO: loss EMA
    beta: float = 0.5                # ADO: how much of the previous weights a decision keeps
    lr: float = 1.0                  # ODM: reward scale in the softmax
    replay_from: Optional[str] = None

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'AdaptiveConfig':
        d = dict(to_plain(value, where) or {})
        if 'replay_from' in d:
            raise ConfigError(f'{where}.replay_from: the key is from: (from: report/mixture.json)')
        if 'from' in d:
            d['replay_from'] = d.pop('from')
        return read_dataclass(cls, d, where)

    def batches(self, key: str, where: str) -> int:
        """``every`` or ``warmup`` in global batches: a segment is whole global batches."""
        return int(parse_time(getattr(self, key), f'{where}.{key}', ('ba',)).value)

    def check(self, where: str) -> None:
        gather = Gather()
        for key in ('every', 'warmup'):
            with gather:
                parse_time(getattr(self, key), f'{where}.{key}', ('ba',), positive=key == 'every')
        for key in ('min_share', 'alpha', 'beta'):
            with gather:
                if not 0 <= getattr(self, key) < 1:
                    raise ConfigError(f'{where}.{key}: must be in [0, 1), got {getattr(self, key)}')
        with gather:
            if (self.method == 'replay') != (self.replay_from is not None):
                raise ConfigError(f'{where}: method: replay goes with from: <a report/mixture.json> '
                                  f'(and from: only with method: replay); got method '
                                  f'{self.method}, from {self.replay_from!r}')
        gather.raise_any()

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed run must keep: everything but ``from`` (replayed decisions are
        checked against the checkpoint's own)."""
        return {k: getattr(self, k) for k in ('method', 'every', 'warmup', 'min_share', 'seed',
                                              'alpha', 'beta', 'lr')}


#: streaming's knobs that foundrymix's own order replaced, and what replaced them
REPLACED_KNOBS = {
    'shuffle_algo': 'each stream is shuffled a window of shards at a time (shuffle_block_size rows)',
    'num_canonical_nodes': 'ranks slice one global order, the same on any topology',
    'partition_algo': 'ranks slice one global order, the same on any topology',
    'sampling_method': 'each pass over a stream is a fresh permutation, complete before the next',
    'sampling_granularity': 'each pass over a stream is a fresh permutation, complete before the next',
    'predownload': 'the order is known: each reader fetches the shards of its next batches '
                   'ahead, in a thread',
}


def replaced_knob(key: str) -> str:
    """What a key of :data:`REPLACED_KNOBS` was: a knob of streaming's sampler or downloader."""
    return f"streaming's {'download' if key == 'predownload' else 'sampler'} knob"


def refuse_replaced_knobs(data: dict[str, Any], where: str) -> None:
    """Refuse streaming's sampler and download knobs (the order is foundrymix's own),
    ``persistent_workers: true`` (workers live one span) and, for training, ``drop_last:
    false``: every epoch is whole global batches, so every batch is full."""
    for key, why in REPLACED_KNOBS.items():
        if key in data:
            raise ConfigError(f'{where}.{key}: {replaced_knob(key)}, which foundrymix\'s own '
                              f'sample order replaced ({why}; docs/mixing-and-plan.md); remove it')
    if data.get('persistent_workers') is True:
        raise ConfigError(f'{where}.persistent_workers: true cannot be kept: each span of batches (an '
                          f'epoch, a stage, an adaptive segment, an evaluation) is read by DataLoader '
                          f'workers of its own, forked when it starts; remove it')
    if data.get('drop_last') is False and not where.startswith('eval_loader'):
        raise ConfigError(f'{where}.drop_last: false is gone: every epoch is whole global batches, '
                          f'so every batch is full (the rows an epoch leaves out go to the next '
                          f'epoch and are listed by foundrymix plan); remove it')
