"""The typed ``train_loader`` config: what a YAML data section may say, checked up front.

Why strict: a misspelt key (``repaet: 2``) silently dropped means a run trains on the
wrong mixture for days. Every unknown key is an error naming the key and the allowed
ones; weights are checked the way streaming will check them (one kind for all streams),
but with the stream names in the message instead of stream indices.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

ALLOWED_BATCHING = ('random', 'stratified', 'per_stream', 'device_per_stream')
ALLOWED_SAMPLING = ('balanced', 'fixed')
ALLOWED_SHUFFLE_ALGOS = ('py1e', 'py1br', 'py1b', 'py1s', 'py2s', 'naive')
ALLOWED_PARTITION_ALGOS = ('orig', 'relaxed')

#: environment variable naming where remote-only streams are cached (default: a tempdir)
CACHE_ROOT_ENV = 'FOUNDRYMIX_CACHE'


class ConfigError(ValueError):
    """The loader config cannot run; the message names the offending key and stream."""


@dataclass
class StreamSpec:
    """One entry of ``train_loader.streams``: where a stream lives and how much of it to use.

    At most one of ``repeat`` (multiplier on the stream's rows), ``proportion`` (relative
    share of the epoch) and ``choose`` (exact rows per epoch) may be given.
    """

    name: str
    local: Optional[str] = None
    remote: Optional[str] = None
    split: Optional[str] = None
    repeat: Optional[float] = None
    proportion: Optional[float] = None
    choose: Optional[int] = None

    @property
    def weight_kind(self) -> Optional[str]:
        for key in ('proportion', 'repeat', 'choose'):
            if getattr(self, key) is not None:
                return key
        return None


@dataclass
class LoaderConfig:
    """``train_loader``: the streams plus the knobs of ``StreamingDataset`` and ``DataLoader``.

    Names and defaults follow ``streaming.StreamingDataset`` / LLM-Foundry, except that
    ``shuffle`` defaults to True (training data) and ``drop_last`` to True (every batch
    full, so per-stream token counts stay exact arithmetic).
    """

    streams: dict[str, StreamSpec]
    shuffle: bool = True
    shuffle_seed: int = 9176
    shuffle_algo: str = 'py1e'
    shuffle_block_size: Optional[int] = None
    batching_method: str = 'random'
    epoch_size: Optional[int] = None
    num_workers: int = 0
    num_canonical_nodes: Optional[int] = None
    predownload: Optional[int] = None
    cache_limit: Optional[Union[int, str]] = None
    download_timeout: float = 60
    sampling_method: str = 'balanced'
    prefetch_factor: Optional[int] = None
    persistent_workers: bool = False
    pin_memory: bool = False
    drop_last: bool = True
    download_retry: int = 2
    sampling_granularity: int = 1
    partition_algo: str = 'relaxed'
    validate_hash: Optional[str] = None
    keep_zip: bool = False
    timeout: float = 0
    #: where remote-only streams are cached (default ``$FOUNDRYMIX_CACHE`` or a tempdir)
    cache_root: Optional[str] = None

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: Any, where: str = 'train_loader') -> 'LoaderConfig':
        """Build and check a config from a mapping or an omegaconf ``DictConfig``.

        Raises :class:`ConfigError` naming ``where.key`` for unknown keys, bad types and
        impossible weightings.
        """
        d = _to_plain(d, where)
        allowed = [f.name for f in fields(cls)]
        _check_keys(d, allowed, where)
        if 'streams' not in d:
            raise ConfigError(f'{where}: missing required key \'streams\' (a mapping of stream '
                              f'name to {{local, remote, split, repeat | proportion | choose}})')
        raw_streams = d['streams']
        if not isinstance(raw_streams, Mapping) or not raw_streams:
            raise ConfigError(f'{where}.streams: must be a non-empty mapping of stream name to '
                              f'stream settings, got {raw_streams!r}')
        streams = {}
        for name, spec in raw_streams.items():
            streams[str(name)] = _parse_stream(str(name), spec, f'{where}.streams.{name}')
        kwargs: dict[str, Any] = {'streams': streams}
        types = {f.name: f.type for f in fields(cls)}
        for key, value in d.items():
            if key == 'streams':
                continue
            kwargs[key] = _coerce(value, types[key], f'{where}.{key}')
        config = cls(**kwargs)
        config.check(where)
        return config

    def check(self, where: str = 'train_loader') -> None:
        """Checks that need the whole config: enums, ranges, one kind of weight."""
        for key, allowed in (('batching_method', ALLOWED_BATCHING),
                             ('sampling_method', ALLOWED_SAMPLING),
                             ('shuffle_algo', ALLOWED_SHUFFLE_ALGOS),
                             ('partition_algo', ALLOWED_PARTITION_ALGOS)):
            value = getattr(self, key)
            if value not in allowed:
                raise ConfigError(f'{where}.{key}: {value!r} is not one of {", ".join(allowed)}')
        for key in ('shuffle_seed', 'num_workers', 'download_retry'):
            if getattr(self, key) < 0:
                raise ConfigError(f'{where}.{key}: must be >= 0, got {getattr(self, key)}')
        if self.sampling_granularity <= 0:
            raise ConfigError(f'{where}.sampling_granularity: must be positive')
        if self.epoch_size is not None and self.epoch_size <= 0:
            raise ConfigError(f'{where}.epoch_size: must be positive, got {self.epoch_size}')
        kinds = {name: s.weight_kind for name, s in self.streams.items()}
        relative = sorted(n for n, k in kinds.items() if k == 'proportion')
        absolute = sorted(n for n, k in kinds.items() if k != 'proportion')
        if relative and absolute:
            absolute_desc = ', '.join(f'{n} ({kinds[n] or "no weight"})' for n in absolute)
            raise ConfigError(
                f'{where}.streams: cannot mix relative and absolute weights: proportion is set '
                f'on {", ".join(relative)} but not on {absolute_desc}. Give every stream a '
                f'proportion (the epoch is then epoch_size rows split by proportion), or give '
                f'none a proportion and use repeat/choose (the epoch is their sum).')
        weighted_absolute = sorted(n for n, k in kinds.items() if k in ('repeat', 'choose'))
        if self.epoch_size is not None and weighted_absolute:
            raise ConfigError(
                f'{where}.epoch_size: cannot be combined with repeat/choose (set on '
                f'{", ".join(weighted_absolute)}): with absolute weights the epoch size is their '
                f'sum. Use proportion on every stream to fix the epoch size.')

    # ------------------------------------------------------------------ paths
    def stream_local(self, name: str) -> str:
        """The local directory of stream ``name`` (without split), caching remote-only ones.

        A remote-only stream is cached under ``cache_root`` in a directory keyed by a hash
        of the remote URL, so two runs over the same remote share the cache and two
        different remotes never collide.
        """
        spec = self.streams[name]
        if spec.local:
            return os.path.abspath(os.path.expanduser(spec.local))
        assert spec.remote, 'checked in _parse_stream'
        root = self.cache_root or os.environ.get(CACHE_ROOT_ENV) or os.path.join(
            tempfile.gettempdir(), 'foundrymix-cache')
        key = hashlib.blake2s(spec.remote.encode('utf-8'), digest_size=8).hexdigest()
        return os.path.join(os.path.abspath(os.path.expanduser(root)), f'{name}-{key}')

    def stream_dir(self, name: str) -> str:
        """The local directory holding stream ``name``'s index.json and manifest."""
        spec = self.streams[name]
        local = self.stream_local(name)
        return os.path.join(local, spec.split) if spec.split else local

    def stream_remote_dir(self, name: str) -> Optional[str]:
        spec = self.streams[name]
        if not spec.remote:
            return None
        return os.path.join(spec.remote, spec.split) if spec.split else spec.remote


STREAM_KEYS = [f.name for f in fields(StreamSpec) if f.name != 'name']


def _to_plain(d: Any, where: str) -> dict[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        DictConfig = ()  # type: ignore
    if DictConfig and isinstance(d, DictConfig):
        d = OmegaConf.to_container(d, resolve=True)
    if not isinstance(d, Mapping):
        raise ConfigError(f'{where}: must be a mapping, got {type(d).__name__}')
    return dict(d)


def _check_keys(d: Mapping[str, Any], allowed: list[str], where: str) -> None:
    for key in d:
        if key not in allowed:
            raise ConfigError(f'{where}: unknown key {key!r}; allowed: {", ".join(allowed)}')


def _parse_stream(name: str, spec: Any, where: str) -> StreamSpec:
    if spec is None:
        spec = {}
    if not isinstance(spec, Mapping):
        raise ConfigError(f'{where}: must be a mapping with keys {", ".join(STREAM_KEYS)}, '
                          f'got {spec!r}')
    _check_keys(spec, STREAM_KEYS, where)
    types = {f.name: f.type for f in fields(StreamSpec)}
    kwargs = {k: _coerce(v, types[k], f'{where}.{k}') for k, v in spec.items()}
    out = StreamSpec(name=name, **kwargs)
    if not out.local and not out.remote:
        raise ConfigError(f'{where}: needs local and/or remote')
    given = [k for k in ('repeat', 'proportion', 'choose') if getattr(out, k) is not None]
    if len(given) > 1:
        raise ConfigError(f'{where}: give at most one of repeat, proportion, choose '
                          f'(got {", ".join(given)}); the others are derived')
    for key in given:
        if getattr(out, key) < 0:
            raise ConfigError(f'{where}.{key}: must be >= 0, got {getattr(out, key)}')
    return out


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert a YAML scalar to the field's type; a clear error when it cannot be."""
    ann = str(annotation)
    if value is None:
        if 'Optional' in ann or 'None' in ann:
            return None
        raise ConfigError(f'{where}: must not be null')
    try:
        if ann.startswith('bool'):
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ('true', 'false'):
                return value.lower() == 'true'
            raise TypeError
        if 'Union[int, str]' in ann:  # cache_limit: '10gb' or bytes
            return value if isinstance(value, str) else int(value)
        if ann in ('int', 'Optional[int]'):
            if isinstance(value, bool):
                raise TypeError
            if isinstance(value, str):
                from streaming.base.util import number_abbrev_to_int
                return int(number_abbrev_to_int(value))
            if isinstance(value, float) and not value.is_integer():
                raise TypeError
            return int(value)
        if ann in ('float', 'Optional[float]'):
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if ann in ('str', 'Optional[str]'):
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise TypeError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f'{where}: expected {ann.replace("Optional[", "").rstrip("]")}, '
                          f'got {value!r}') from None
    return value
