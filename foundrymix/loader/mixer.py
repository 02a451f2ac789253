"""``StreamMixer``: a ``train_loader`` config -> validated streams -> a loader in the plan's order
(plain PyTorch: ``StreamMixer.from_dict(cfg).build_dataloader(batch_size=8)``). Validation is
the :class:`~foundrymix.plan.catalog.Catalog`'s, the plan :mod:`foundrymix.plan`'s: it only builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from foundrymix.config import ConfigError
from foundrymix.plan.catalog import Catalog
from foundrymix.plan.config import LoaderConfig
from foundrymix.format.schema import Manifest, TokenizerInfo
from foundrymix.loader.storage import build_store
from foundrymix.plan.mixture import build_plan
from foundrymix.plan.stages import build_run_plan
from foundrymix.plan.topology import Topology, env_world_size

if TYPE_CHECKING:  # torch/streaming are imported lazily
    from foundrymix.loader.storage import RowStore
    from foundrymix.plan.mixture import Plan


class StreamMixer:
    """Builds the rows' store and a DataLoader from a loader config and its catalog."""

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

    def build_store(self) -> 'RowStore':
        """The rows of every stream by sample id (streams in config order), cache directories
        claimed until ``release()``."""
        self.catalog.validate()
        return build_store(self.config, self.catalog.infos(), self.where)

    def build_dataloader(self, batch_size: int, epochs: int = 1, world_size: Optional[int] = None,
                         rank: Optional[int] = None, rewind: bool = False) -> Any:
        """``epochs`` epochs in the plan's order: rank ``rank``'s ``batch_size`` rows of each
        global batch of ``world_size`` ranks (default: the launcher's), resumable at any batch.
        ``rewind``: every iteration starts at the first batch (an evaluation set)."""
        from foundrymix.loader.run_loader import build_run_loader
        if batch_size <= 0:
            raise ConfigError(f'batch_size must be positive, got {batch_size}')
        topology = Topology(1, world_size or env_world_size())
        own = [self.catalog] if self.config.stages is None else None  # its metadata is read once
        loader, _ = build_run_loader(self.config, batch_size, f'{epochs}ep', topology, where=self.where,
                                     rank=rank, rewind=rewind, catalogs=own)
        loader.prepare()
        return loader

    def plan(self, batch_size: int, max_duration: Optional[Any] = None, world_size: int = 1,
             nodes: int = 1) -> 'Plan':
        """The exact per-epoch mixture and where ``max_duration`` ends (reads no shards), for
        ``world_size`` ranks over ``nodes`` nodes; with ``max_duration``, the run's (an adaptive
        stage's segments stated), without it the configured mixture's epochs."""
        if world_size <= 0 or world_size % nodes:
            raise ConfigError(f'world_size ({world_size}) must be a positive multiple of the '
                              f'number of nodes ({nodes})')
        topology, infos = Topology(nodes=nodes, ranks_per_node=world_size // nodes), self.catalog.infos()
        if max_duration is not None and self.config.stages is None:
            return build_run_plan(self.config, [infos], batch_size, max_duration, topology).stages[0].plan
        return build_plan(self.config, infos, batch_size, max_duration, topology)[0]
