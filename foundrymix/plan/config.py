"""The typed ``train_loader`` config: what a YAML data section may say, checked up front.
Strict, because a misspelt key silently dropped means days of training on the wrong mixture."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import tempfile
import typing
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional, Union

from foundrymix.config import ConfigError, DERIVED, Duration, check_keys, read_dataclass, read_value, to_plain
from foundrymix.plan.specs import AdaptiveConfig, StreamSpec, is_pattern, refuse_replaced_knobs

BatchingMethod = Literal['random', 'stratified']
WeightsIn = Literal['rows', 'tokens', 'loss_tokens']
HashAlgo = Literal['sha1', 'sha224', 'sha256', 'sha384', 'sha512', 'sha3_224', 'sha3_256',
                   'sha3_384', 'sha3_512', 'md5', 'xxh32', 'xxh64', 'xxh128', 'xxh3_64',
                   'xxh3_128']

#: environment variable naming where remote-only streams are cached (default: a tempdir)
CACHE_ROOT_ENV = 'FOUNDRYMIX_CACHE'


def cache_base(cache_root: Optional[str] = None) -> str:
    """The directory foundrymix caches under: ``cache_root``, else ``$FOUNDRYMIX_CACHE``,
    else ``<tmp>/foundrymix-cache`` (absolute)."""
    root = cache_root or os.environ.get(CACHE_ROOT_ENV) or os.path.join(
        tempfile.gettempdir(), 'foundrymix-cache')
    return os.path.abspath(os.path.expanduser(root))


#: keys of a stage besides the loader knobs it may override
STAGE_KEYS = ('name', 'duration', 'streams', 'global_train_batch_size')
#: a later stage's default shuffle seed is ``shuffle_seed + index * STAGE_SEED_STEP``
STAGE_SEED_STEP = 1_000_003


@dataclass
class StageSpec:
    """One entry of ``train_loader.stages``: a name, a duration, its own mixture (streams
    inherit their location from ``train_loader.streams``) and the loader knobs it overrides."""

    name: str
    duration: str
    streams: dict[str, Any]
    overrides: dict[str, Any]
    where: str
    global_train_batch_size: Optional[int] = None

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'StageSpec':
        d = to_plain(value, where)
        refuse_replaced_knobs(d, where)
        knobs = [k for k in LoaderConfig.__dataclass_fields__ if k not in ('streams', 'stages', 'groups')]
        check_keys(d, list(STAGE_KEYS) + knobs, where)
        for key in STAGE_KEYS[:3]:  # required
            if d.get(key) is None:
                raise ConfigError(f'{where}: missing required key {key!r}')
        name = read_value(d.pop('name'), str, f'{where}.name')
        duration = str(Duration.from_config(d.pop('duration'), f'{where}.duration'))
        streams = to_plain(d.pop('streams'), f'{where}.streams')
        if not streams:
            raise ConfigError(f'{where}.streams: a stage needs at least one stream')
        batch = d.pop('global_train_batch_size', None)
        if batch is not None:
            batch = read_value(batch, int, f'{where}.global_train_batch_size')
            if batch <= 0:
                raise ConfigError(f'{where}.global_train_batch_size: must be positive, got {batch}')
        hints = typing.get_type_hints(LoaderConfig)
        overrides = {k: read_value(v, hints[k], f'{where}.{k}') for k, v in d.items()}
        return cls(name=name, duration=duration, streams=streams, overrides=overrides, where=where,
                   global_train_batch_size=batch)


def _few(names: list[str], n: int = 5) -> str:
    """The first ``n`` names and how many more: a message about 1,000 streams stays one line."""
    return ', '.join(names[:n]) + (f', ... ({len(names):,} in all)' if len(names) > n else '')


@dataclass
class LoaderConfig:
    """``train_loader``: the streams, the order's knobs and the ``DataLoader``'s. Names and
    defaults follow LLM-Foundry's, except ``shuffle`` and ``drop_last`` (True: every batch full)."""

    streams: dict[str, StreamSpec] = field(default_factory=dict)
    shuffle: bool = True
    shuffle_seed: int = 9176
    shuffle_block_size: Optional[int] = None
    batching_method: BatchingMethod = 'random'
    epoch_size: Optional[int] = None
    num_workers: int = 0
    #: epochs of whole global batches, stratified shares exact (False: the rounded shares)
    exact: bool = True
    cache_limit: Optional[Union[int, str]] = None
    #: seconds a remote file download may wait on the store, as a whole (foundrymix.s3.remote)
    download_timeout: float = 60
    prefetch_factor: Optional[int] = None
    persistent_workers: bool = False
    #: batches in page-locked memory, copied to the GPU asynchronously (None: where CUDA is available)
    pin_memory: Optional[bool] = None
    drop_last: bool = True
    download_retry: int = 2
    #: the tokenizer of LLM-Foundry token-shard streams that name none (the YAML's top-level one)
    tokenizer: Optional[str] = None
    #: the algorithm shard files are hashed with at first open (default: the fastest recorded)
    validate_hash: Optional[HashAlgo] = None
    #: hash every shard file (local, or a cached remote's) once per file version when first
    #: opened, against index.json; false: only with validate_hash set
    hash_local_shards: bool = True
    keep_zip: bool = False
    timeout: float = 0
    #: where remote-only streams are cached (default ``$FOUNDRYMIX_CACHE`` or a tempdir)
    cache_root: Optional[str] = None
    #: curricula: ordered stages, each with its own mixture and duration (see StageSpec)
    stages: Optional[list[StageSpec]] = None
    #: what ``proportion`` is a share of: rows (streaming's meaning), real tokens or loss tokens
    weights_in: WeightsIn = 'rows'
    #: adaptive mixing: the weights set during the run from the per-stream loss (AdaptiveConfig)
    adaptive: Optional[AdaptiveConfig] = None
    #: the pattern entries of ``streams``, split from them on construction (exact.resolve_groups)
    groups: dict[str, StreamSpec] = field(default_factory=dict, metadata=DERIVED)

    def __post_init__(self) -> None:
        if any(is_pattern(n) for n in self.streams):
            self.groups = {**self.groups, **{n: s for n, s in self.streams.items() if is_pattern(n)}}
            self.streams = {n: s for n, s in self.streams.items() if not is_pattern(n)}

    # ------------------------------------------------------------------ parsing
    #: keys refused as given, whatever their value (read_dataclass's hook)
    refuse_given = staticmethod(refuse_replaced_knobs)

    @classmethod
    def from_dict(cls, d: Any, where: str = 'train_loader') -> 'LoaderConfig':
        """Build and check a config from a mapping or an omegaconf ``DictConfig``."""
        data = to_plain(d, where)
        refuse_replaced_knobs(data, where)  # before the required-key check below
        if data.get('streams') is None and data.get('stages') is None:
            raise ConfigError(f'{where}: missing required key \'streams\' (a mapping of stream '
                              f'name to {{local, remote, split, repeat | proportion | choose}})')
        return read_dataclass(cls, data, where)

    def check(self, where: str = 'train_loader') -> None:
        """Checks that need the whole config: ranges, one kind of weight, a cache of its own."""
        self._check_cache_root(where)
        if self.stages is not None:
            self._check_stages(where)
            return
        if not self.streams:
            raise ConfigError(f'{where}.streams: must be a non-empty mapping of stream name to '
                              f'stream settings, got {{}}')
        for key in ('shuffle_seed', 'num_workers', 'download_retry'):
            if getattr(self, key) < 0:
                raise ConfigError(f'{where}.{key}: must be >= 0, got {getattr(self, key)}')
        if self.epoch_size is not None and self.epoch_size <= 0:
            raise ConfigError(f'{where}.epoch_size: must be positive, got {self.epoch_size}')
        if self.adaptive is not None and self.batching_method != 'random':
            raise ConfigError(f'{where}.batching_method: {self.batching_method} with adaptive: an '
                              f'adaptive segment draws its own rows per stream (batching_method: '
                              f'random, the default)')
        of = {n: g for g, members in self.group_members(where).items() for n in members}
        kinds = {name: s.weight_kind or (self.groups[of[name]].weight_kind if name in of else None)
                 for name, s in self.streams.items()}
        # a group is named once (its pattern), not by its 1,000 members
        kinds = {of.get(n, n): k for n, k in kinds.items()}
        relative = sorted(n for n, k in kinds.items() if k == 'proportion')
        absolute = sorted(n for n, k in kinds.items() if k != 'proportion')
        if relative and absolute:
            absolute_desc = ', '.join(f'{n} ({kinds[n] or "no weight"})' for n in absolute)
            raise ConfigError(
                f'{where}.streams: cannot mix relative and absolute weights: proportion is set '
                f'on {", ".join(relative)} but not on {absolute_desc}. Give every stream a '
                f'proportion (the epoch is then epoch_size rows split by proportion), or give '
                f'none a proportion and use repeat/choose (the epoch is their sum).')
        if self.weights_in != 'rows' and absolute:
            raise ConfigError(
                f'{where}.weights_in: {self.weights_in} applies to proportion weights only; '
                f'give every stream a proportion (not set on {", ".join(absolute)}) or use '
                f'weights_in: rows')
        anchors = [n for n, s in self.streams.items() if s.proportion is not None and s.repeat is not None]
        if len(anchors) > 1 or (anchors and self.epoch_size is not None):
            raise ConfigError(
                f'{where}.streams: proportion with repeat on {", ".join(anchors)}: the passes of one '
                f'stream size the epoch; give repeat beside proportion on one stream only, and no '
                f'epoch_size')
        weighted_absolute = sorted(n for n, k in kinds.items() if k in ('repeat', 'choose'))
        if self.epoch_size is not None and weighted_absolute:
            raise ConfigError(
                f'{where}.epoch_size: cannot be combined with repeat/choose (set on '
                f'{", ".join(weighted_absolute)}): with absolute weights the epoch size is their '
                f'sum. Use proportion on every stream to fix the epoch size.')

    def _check_cache_root(self, where: str) -> None:
        """Refuse a ``cache_root`` inside a local stream's directory or holding a dataset: the
        records foundrymix writes there must never land among a dataset's files."""
        if not self.cache_root:
            return
        root = os.path.realpath(cache_base(self.cache_root))
        for name, spec in self.streams.items():
            local = os.path.realpath(self.stream_local(name)) if spec.local else None
            if local is not None and (root == local or root.startswith(local + os.sep)):
                raise ConfigError(
                    f"{where}.cache_root: {self.cache_root} is {'' if root == local else 'inside '}"
                    f"stream {name}'s directory {spec.local}; foundrymix writes its records there "
                    f'(plans/, shuffles/, shard-hashes/, ...). Give cache_root a directory of its own, '
                    f'or leave it out (${CACHE_ROOT_ENV}, else <tmp>/foundrymix-cache)')
        held = [f for f in ('foundrymix.json', 'index.json') if os.path.isfile(os.path.join(root, f))]
        if held:
            raise ConfigError(
                f'{where}.cache_root: {self.cache_root} holds a dataset ({", ".join(held)}); foundrymix '
                f'writes its records there. Give cache_root a directory of its own, or leave it out '
                f'(${CACHE_ROOT_ENV}, else <tmp>/foundrymix-cache)')

    def group_members(self, where: str = 'train_loader') -> dict[str, list[str]]:
        """Pattern -> the streams it matches (``fnmatchcase``, in ``streams`` order). Refused: a
        pattern matching nothing, a stream matched twice, a member with a weight of its own."""
        out: dict[str, list[str]] = {}
        owner: dict[str, str] = {}
        for pattern, group in self.groups.items():
            members = [n for n in self.streams if fnmatch.fnmatchcase(n, pattern)]
            if not members:
                raise ConfigError(
                    f'{where}.streams.{pattern}: the pattern matches no stream (streams: '
                    f'{_few(list(self.streams))}); fix the pattern or delete it')
            for n in members:
                if n in owner:
                    raise ConfigError(
                        f'{where}.streams.{pattern}: stream {n} is also matched by pattern '
                        f'{owner[n]!r}; a stream takes its weight from one pattern: narrow one')
                owner[n] = pattern
                if self.streams[n].weight_kind:
                    raise ConfigError(
                        f'{where}.streams.{n}: sets {self.streams[n].weight_kind} but is a member '
                        f'of pattern {pattern!r}, which weights it; drop the weight here, or narrow '
                        f'the pattern so that it does not match {n}')
            out[pattern] = members
        return out

    def _check_stages(self, where: str) -> None:
        if not self.stages:
            raise ConfigError(f'{where}.stages: must list at least one stage')
        weighted = sorted(n for n, s in self.streams.items() if s.weight_kind) + list(self.groups)
        if weighted:
            raise ConfigError(
                f'{where}.streams: with stages, train_loader.streams only says where streams are; '
                f'set weights in each stage (weighted here: {", ".join(weighted)})')
        names = [s.name for s in self.stages]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f'{where}.stages: stage names must be unique ({", ".join(dupes)})')
        self.stage_configs(where)  # each stage's own config is checked as it is built

    def stage_configs(self, where: str = 'train_loader') -> list['LoaderConfig']:
        """The loader config of every stage (without ``stages``: this one): ``train_loader``'s
        knobs, the stage's overrides and streams, and a shuffle seed of its own unless given."""
        if self.stages is None:
            return [self]
        out = []
        for i, stage in enumerate(self.stages):
            streams = {}
            for name, raw in stage.streams.items():
                base = self.streams.get(str(name))
                merged = {k: getattr(base, k) for k in ('local', 'remote', 'split')
                          if base is not None and getattr(base, k) is not None}
                merged.update(to_plain(raw, f'{stage.where}.streams.{name}'))
                streams[str(name)] = read_dataclass(StreamSpec, merged,
                                                    f'{stage.where}.streams.{name}', key=str(name))
            # a stage's pattern also takes in train_loader's streams it matches (after its own)
            patterns = [n for n in streams if is_pattern(n)]
            for name, base in self.streams.items():
                if name not in streams and any(fnmatch.fnmatchcase(name, p) for p in patterns):
                    streams[name] = replace(base, repeat=None, proportion=None, choose=None)
            knobs = dict(stage.overrides)
            knobs.setdefault('shuffle_seed', self.shuffle_seed + i * STAGE_SEED_STEP)
            config = replace(self, streams=streams, groups={}, stages=None, **knobs)
            config.check(stage.where)
            out.append(config)
        return out

    # ------------------------------------------------------------------ paths
    def stream_local(self, name: str) -> str:
        """The configured local directory of stream ``name`` (without split). A remote-only
        stream's is under ``cache_root``, keyed by a hash of its remote, so two remotes never
        collide and runs one after another reuse its shards (:mod:`foundrymix.loader.cache`)."""
        spec = self.streams[name]
        if spec.local:
            return os.path.abspath(os.path.expanduser(spec.local))
        assert spec.remote, 'checked in StreamSpec.check'
        root = cache_base(self.cache_root)
        key = hashlib.blake2s(spec.remote.encode('utf-8'), digest_size=8).hexdigest()
        return os.path.join(root, f'{name}-{key}')

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
