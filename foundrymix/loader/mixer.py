"""``StreamMixer``: a ``train_loader`` config -> validated streams -> one ``MixedDataset``.

The mixer only builds: what the streams are and whether they can be mixed is the
:class:`~foundrymix.plan.catalog.Catalog`'s job (manifests and ``index.json``, validated
before a single shard is touched); what an epoch and a run will train is the pure
:func:`~foundrymix.plan.mixture.build_plan`'s. Pretrain and finetune streams share one
schema, so they mix freely.

Usable from plain PyTorch::

    mixer = StreamMixer.from_dict(yaml_cfg['train_loader'])
    loader = mixer.build_dataloader(batch_size=8)   # one epoch of int64 batches, in plan order
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from foundrymix.config import ConfigError
from foundrymix.heap import collector_paused
from foundrymix.plan.catalog import Catalog, make_streams
from foundrymix.plan.config import LoaderConfig
from foundrymix.format.schema import Manifest, TokenizerInfo

if TYPE_CHECKING:  # torch/streaming are imported lazily
    from foundrymix.plan.catalog import StreamInfo
    from foundrymix.loader.dataset import MixedDataset
    from foundrymix.plan.exact import EpochWeights
    from foundrymix.plan.mixture import Plan


class StreamMixer:
    """Builds a :class:`MixedDataset` and a DataLoader from a loader config and its catalog."""

    def __init__(self, config: LoaderConfig, where: str = 'train_loader') -> None:
        self.config = config
        self.where = where
        self.catalog = Catalog(config, where)

    @classmethod
    def from_dict(cls, d: Any, where: str = 'train_loader') -> 'StreamMixer':
        return cls(LoaderConfig.from_dict(d, where), where)

    @property
    def stream_names(self) -> list[str]:
        return self.catalog.names

    @property
    def manifests(self) -> dict[str, Manifest]:
        """Every stream's manifest, read once (downloaded first for remote-only streams)."""
        return self.catalog.manifests

    def validate(self) -> None:
        """Refuse streams that cannot share a batch, before any row is read."""
        self.catalog.validate()

    @property
    def max_seq_len(self) -> int:
        return self.catalog.max_seq_len

    @property
    def tokenizer(self) -> TokenizerInfo:
        return self.catalog.tokenizer

    # ------------------------------------------------------------ building
    def streams(self) -> list[Any]:
        """Fresh ``streaming.Stream`` objects, one per configured stream, in config order."""
        return make_streams(self.catalog.infos(), weights_in=self.config.weights_in)

    def dataset_kwargs(self, batch_size: int, epoch_size: Optional[int] = None) -> dict[str, Any]:
        """Keyword arguments of ``StreamingDataset`` (without streams) for this config;
        ``epoch_size`` is the exact epoch's (see :func:`~foundrymix.plan.exact.epoch_weights`)."""
        return dataset_kwargs(self.config, batch_size, epoch_size)

    def build_dataset(self, batch_size: int, world_size: Optional[int] = None) -> 'MixedDataset':
        """One ``MixedDataset`` over all streams; ``batch_size`` is the per-rank batch size.

        ``world_size`` (default: the ranks of this job, from the launcher's environment)
        fixes the global batch, which an exact epoch is made of: the plan for the same
        global batch gives the same streams and epoch size. (The trainer builds its
        datasets from the run's plan instead: :func:`build_dataset`.)
        """
        from foundrymix.loader.streaming_compat import world_size as get_world_size
        from foundrymix.plan.exact import epoch_weights
        if batch_size <= 0:
            raise ConfigError(f'batch_size must be positive, got {batch_size}')
        G = batch_size * (world_size or get_world_size())
        infos = self.catalog.infos()
        weights = epoch_weights(self.config, infos, G, self.where)
        return build_dataset(self.config, infos, weights, batch_size, G, self.where)

    def build_dataloader(self, batch_size: int, epochs: int = 1, world_size: Optional[int] = None,
                         rank: Optional[int] = None, rewind: bool = False) -> Any:
        """A loader of ``epochs`` epochs of the mixture in the plan's order: rank ``rank``'s
        ``batch_size`` rows of each global batch of ``world_size`` ranks (default: the
        launcher's), collated (int64 tensors); iterating it trains the epochs once, and
        ``state_dict()`` / ``load_state_dict()`` resume it at any batch. ``rewind``: every
        iteration starts again at the first batch (an evaluation set, read whole each time)."""
        from foundrymix.loader.run_loader import build_run_loader
        from foundrymix.loader.streaming_compat import world_size as get_world_size
        from foundrymix.plan.stages import build_run_plan, plan_run
        from foundrymix.plan.topology import Topology
        if batch_size <= 0:
            raise ConfigError(f'batch_size must be positive, got {batch_size}')
        topology = Topology(1, world_size or get_world_size())
        if self.config.stages is None:  # this mixer's catalog: its metadata is read once
            self.catalog.validate()
            run = build_run_plan(self.config, [self.catalog.infos()], batch_size, f'{epochs}ep',
                                 topology, self.where)
        else:
            run, _ = plan_run(self.config, batch_size, f'{epochs}ep', topology, self.where)
        loader = build_run_loader(run, batch_size, rank=rank)
        loader.rewind = rewind
        loader.prepare()
        return loader

    def plan(self, batch_size: int, max_duration: Optional[Any] = None, world_size: int = 1,
             nodes: int = 1) -> 'Plan':
        """The exact per-epoch mixture and where ``max_duration`` ends (reads no shards), for
        ``world_size`` ranks over ``nodes`` nodes."""
        from foundrymix.plan.mixture import build_plan
        from foundrymix.plan.topology import Topology
        if world_size <= 0 or world_size % nodes:
            raise ConfigError(f'world_size ({world_size}) must be a positive multiple of the '
                              f'number of nodes ({nodes})')
        return build_plan(self.config, self.catalog.infos(), batch_size, max_duration,
                          Topology(nodes=nodes, ranks_per_node=world_size // nodes))


def dataset_kwargs(c: LoaderConfig, batch_size: int, epoch_size: Optional[int] = None) -> dict[str, Any]:
    """Keyword arguments of ``StreamingDataset`` (without streams) for loader config ``c``."""
    return dict(
        download_retry=c.download_retry, download_timeout=c.download_timeout,
        validate_hash=c.validate_hash, keep_zip=c.keep_zip, epoch_size=epoch_size,
        predownload=c.predownload, cache_limit=c.cache_limit,
        sampling_method=c.sampling_method, sampling_granularity=c.sampling_granularity,
        partition_algo=c.partition_algo, num_canonical_nodes=c.num_canonical_nodes,
        batch_size=batch_size, shuffle=c.shuffle, shuffle_algo=c.shuffle_algo,
        shuffle_seed=c.shuffle_seed, shuffle_block_size=c.shuffle_block_size,
        batching_method=c.batching_method)


@collector_paused()  # at each start and stage switch: streaming's per-stream objects (heap.py)
def build_dataset(config: LoaderConfig, infos: list['StreamInfo'], weights: 'EpochWeights',
                  batch_size: int, global_batch: int, where: str = 'train_loader') -> 'MixedDataset':
    """The ``MixedDataset`` of one mixture, from what its plan holds: the streams' metadata
    (read once by the catalog) and the epoch weights (computed once by the plan).

    Claims the cache directories (another live run's are not shared), cleans what killed
    runs left there, and refuses a cache too small -- all before streaming starts.
    """
    from foundrymix.loader import cache
    from foundrymix.loader.dataset import MixedDataset
    if batch_size <= 0:
        raise ConfigError(f'batch_size must be positive, got {batch_size}')
    infos, claims = cache.prepare(config, infos, where)
    manifest = infos[0].manifest
    try:
        dataset = MixedDataset(stream_names=[i.name for i in infos], global_batch_size=global_batch,
                               streams=make_streams(infos, weights.chooses, config.weights_in),
                               vocab_size=manifest.tokenizer.vocab_size,
                               max_seq_len=manifest.max_seq_len,
                               **dataset_kwargs(config, batch_size, weights.epoch_size))
    except ValueError as e:
        claims.release()
        if 'Reused local directory' in str(e):
            raise ConfigError(
                f'{where}.streams: a cache directory of this run is registered by another '
                f'live streaming dataset on this machine (not a foundrymix run, or one in this '
                f'process): {e}. Give the stream its own local: directory') from e
        raise
    except BaseException:
        claims.release()
        raise
    dataset.cache_claims = claims
    return dataset
