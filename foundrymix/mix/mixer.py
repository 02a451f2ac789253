"""``StreamMixer``: a ``train_loader`` config -> validated streams -> one ``MixedDataset``.

Why validate before building: streaming only notices that two streams cannot be mixed
when it reads a row (or never, if the columns happen to decode). Every stream's manifest
(``foundrymix.json``, tiny) is read first, and streams that disagree on ``max_seq_len``,
tokenizer or schema version are refused, naming the streams and values, before a single
shard is touched. Pretrain and finetune streams share one schema, so they mix freely.

Usable from plain PyTorch::

    mixer = StreamMixer.from_dict(yaml_cfg['train_loader'])
    loader = mixer.build_dataloader(batch_size=8)   # a DataLoader of int64 tensors
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Optional

from foundrymix.mix.config import ConfigError, LoaderConfig
from foundrymix.schema import MANIFEST_NAME, SCHEMA_VERSION, Manifest, TokenizerInfo

INDEX_NAME = 'index.json'


def _is_not_found(error: BaseException) -> bool:
    """True if a streaming downloader error means "no such object" (or no access to it).

    Backends differ: S3 raises botocore's ``ClientError`` with code 403/404/NoSuchKey
    (also for a missing bucket), GCS/OCI/Azure and local copies raise ``FileNotFoundError``.
    """
    if isinstance(error, FileNotFoundError):
        return True
    response = getattr(error, 'response', None)
    if isinstance(response, dict):
        code = str(response.get('Error', {}).get('Code', ''))
        return code in ('403', '404', 'NoSuchKey', 'NoSuchBucket', 'AccessDenied')
    return False


if TYPE_CHECKING:  # torch/streaming are imported lazily
    from foundrymix.mix.dataset import MixedDataset
    from foundrymix.mix.plan import Plan


class StreamMixer:
    """Builds streaming ``Stream``s, a :class:`MixedDataset` and a DataLoader from a config."""

    def __init__(self, config: LoaderConfig, where: str = 'train_loader') -> None:
        self.config = config
        self.where = where
        self._manifests: Optional[dict[str, Manifest]] = None
        self._validated = False

    @classmethod
    def from_dict(cls, d: Any, where: str = 'train_loader') -> 'StreamMixer':
        return cls(LoaderConfig.from_dict(d, where), where)

    @property
    def stream_names(self) -> list[str]:
        return list(self.config.streams)

    # ------------------------------------------------------------ manifests
    def _fetch(self, name: str, basename: str) -> str:
        """Local path of a stream's small metadata file, downloading it if remote-only.

        Uses streaming's own downloader, so every remote streaming supports works and the
        file lands where ``Stream`` expects its index (``local/split``).
        """
        local_path = os.path.join(self.config.stream_dir(name), basename)
        if os.path.isfile(local_path):
            return local_path
        remote_dir = self.config.stream_remote_dir(name)
        if remote_dir is None:
            return local_path  # the caller reports it missing
        from streaming.base.storage import CloudDownloader
        remote_path = os.path.join(remote_dir, basename)
        try:
            CloudDownloader.direct_download(remote_path, local_path, self.config.download_timeout)
        except Exception as e:  # downloader errors vary by backend
            where = f'{self.where}.streams.{name}'
            if _is_not_found(e):
                what = 'foundrymix manifest' if basename == MANIFEST_NAME else basename
                raise ConfigError(
                    f'{where}: no {what} at {remote_path} (not found or access denied). Check '
                    f'that remote {remote_dir!r} (bucket and path) is right and holds a whole '
                    f'directory made by `foundrymix convert` ({MANIFEST_NAME}, {INDEX_NAME} '
                    f'and shards)') from e
            raise ConfigError(f'{where}: cannot download {remote_path}: '
                              f'{type(e).__name__}: {e}') from e
        return local_path

    @property
    def manifests(self) -> dict[str, Manifest]:
        """Every stream's manifest, read once (downloaded first for remote-only streams)."""
        if self._manifests is None:
            manifests = {}
            for name in self.stream_names:
                path = self._fetch(name, MANIFEST_NAME)
                where = f'{self.where}.streams.{name}'
                if not os.path.isfile(path):
                    raise ConfigError(
                        f'{where}: no foundrymix manifest {path} (is '
                        f'{self.config.stream_dir(name)!r} a directory made by `foundrymix '
                        f'convert`?)')
                try:
                    manifests[name] = Manifest.read(os.path.dirname(path))
                except (ValueError, FileNotFoundError) as e:
                    raise ConfigError(f'{where}: {e}') from e
                index = self._fetch(name, INDEX_NAME)
                if not os.path.isfile(index):
                    raise ConfigError(f'{where}: manifest but no {INDEX_NAME} in '
                                      f'{os.path.dirname(index)} (an incomplete conversion?)')
            self._manifests = manifests
        return self._manifests

    def shard_rows(self, name: str) -> list[int]:
        """Rows per shard of a stream, from its ``index.json`` (no shard is read)."""
        path = self._fetch(name, INDEX_NAME)
        if not os.path.isfile(path):
            raise ConfigError(f'{self.where}.streams.{name}: no {INDEX_NAME} at {path}')
        with open(path, encoding='utf-8') as f:
            try:
                index = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f'{path}: not valid JSON: {e}') from e
        return [int(shard['samples']) for shard in index['shards']]

    # ------------------------------------------------------------ validation
    def validate(self) -> None:
        """Refuse streams that cannot share a batch, before any row is read."""
        if self._validated:
            return
        seen_dirs: dict[str, str] = {}
        for name in self.stream_names:
            d = os.path.normpath(self.config.stream_dir(name))
            if d in seen_dirs:
                raise ConfigError(
                    f'{self.where}.streams: {seen_dirs[d]} and {name} use the same directory {d}; '
                    f'streaming needs a distinct local directory per stream (to use one dataset '
                    f'twice, give one stream a single repeat/proportion, or copy/symlink the dir)')
            seen_dirs[d] = name
        manifests = self.manifests
        for name, m in manifests.items():
            if m.schema_version != SCHEMA_VERSION:
                raise ConfigError(
                    f'{self.where}.streams.{name}: manifest schema version {m.schema_version}, '
                    f'this foundrymix reads version {SCHEMA_VERSION}; re-run `foundrymix convert`')
            if m.kind not in ('pretrain', 'finetune'):
                raise ConfigError(f'{self.where}.streams.{name}: unknown manifest kind {m.kind!r}')
            if m.counts.rows <= 0:
                raise ConfigError(f'{self.where}.streams.{name}: stream has no rows')
        checks = (
            ('max_seq_len', lambda m: m.max_seq_len),
            ('tokenizer', lambda m: f'{m.tokenizer.name} (fingerprint '
                                    f'{m.tokenizer.fingerprint[:12]}, vocab {m.tokenizer.vocab_size})'),
            ('pad id', lambda m: m.tokenizer.pad_id),
        )
        for what, get in checks:
            values = {name: get(m) for name, m in manifests.items()}
            if len(set(values.values())) > 1:
                listing = ', '.join(f'{n}: {v}' for n, v in values.items())
                raise ConfigError(
                    f'{self.where}.streams: streams disagree on {what} ({listing}); every '
                    f'stream of one loader must be converted with the same {what}')
        # The short tokenizer description above could collide; the fingerprint decides.
        prints = {name: m.tokenizer.fingerprint for name, m in manifests.items()}
        if len(set(prints.values())) > 1:
            listing = ', '.join(f'{n}: {v}' for n, v in prints.items())
            raise ConfigError(f'{self.where}.streams: streams disagree on tokenizer fingerprint '
                              f'({listing})')
        self._validated = True

    @property
    def max_seq_len(self) -> int:
        self.validate()
        return next(iter(self.manifests.values())).max_seq_len

    @property
    def tokenizer(self) -> TokenizerInfo:
        self.validate()
        return next(iter(self.manifests.values())).tokenizer

    # ------------------------------------------------------------ building
    def streams(self) -> list[Any]:
        """Fresh ``streaming.Stream`` objects, one per configured stream, in config order."""
        from streaming import Stream
        self.validate()
        out = []
        for name, spec in self.config.streams.items():
            out.append(Stream(remote=spec.remote, local=self.config.stream_local(name),
                              split=spec.split, repeat=spec.repeat, proportion=spec.proportion,
                              choose=spec.choose))
        return out

    def dataset_kwargs(self, batch_size: int) -> dict[str, Any]:
        """Keyword arguments of ``StreamingDataset`` (without streams) for this config."""
        c = self.config
        return dict(
            download_retry=c.download_retry, download_timeout=c.download_timeout,
            validate_hash=c.validate_hash, keep_zip=c.keep_zip, epoch_size=c.epoch_size,
            predownload=c.predownload, cache_limit=c.cache_limit,
            sampling_method=c.sampling_method, sampling_granularity=c.sampling_granularity,
            partition_algo=c.partition_algo, num_canonical_nodes=c.num_canonical_nodes,
            batch_size=batch_size, shuffle=c.shuffle, shuffle_algo=c.shuffle_algo,
            shuffle_seed=c.shuffle_seed, shuffle_block_size=c.shuffle_block_size,
            batching_method=c.batching_method)

    def build_dataset(self, batch_size: int) -> 'MixedDataset':
        """One ``MixedDataset`` over all streams; ``batch_size`` is the per-rank batch size."""
        from foundrymix.mix.dataset import MixedDataset
        if batch_size <= 0:
            raise ConfigError(f'batch_size must be positive, got {batch_size}')
        return MixedDataset(stream_names=self.stream_names, streams=self.streams(),
                            vocab_size=self.tokenizer.vocab_size, max_seq_len=self.max_seq_len,
                            **self.dataset_kwargs(batch_size))

    def build_dataloader(self, batch_size: int, dataset: Optional['MixedDataset'] = None) -> Any:
        """A ``StreamingDataLoader`` (a torch ``DataLoader``) of collated int64 batches.

        ``StreamingDataLoader`` counts samples it yielded, so plain-PyTorch users get
        ``loader.state_dict()``/``load_state_dict()`` for resumption; Composer uses the
        dataset's ``state_dict`` directly.

        Sets ``dataset.yield_rows``: iterating the dataset yields stored rows, which
        ``collate`` decodes a batch at a time (indexing the dataset still decodes).
        """
        from streaming import StreamingDataLoader

        from foundrymix.mix.collate import collate
        c = self.config
        dataset = dataset if dataset is not None else self.build_dataset(batch_size)
        dataset.yield_rows = True
        extra: dict[str, Any] = {}
        if c.num_workers > 0:
            extra['persistent_workers'] = c.persistent_workers
            if c.prefetch_factor is not None:
                extra['prefetch_factor'] = c.prefetch_factor
        return StreamingDataLoader(dataset, batch_size=batch_size, collate_fn=collate,
                                   num_workers=c.num_workers, pin_memory=c.pin_memory,
                                   drop_last=c.drop_last, timeout=c.timeout, **extra)

    def plan(self, batch_size: int, max_duration: Optional[str] = None,
             world_size: int = 1) -> 'Plan':
        """The exact per-epoch mixture and where ``max_duration`` ends (reads no shards)."""
        from foundrymix.mix.plan import build_plan
        return build_plan(self, batch_size=batch_size, max_duration=max_duration,
                          world_size=world_size)
