"""``StreamMixer``: a ``train_loader`` config -> validated streams -> a loader in the plan's order
(plain PyTorch: ``StreamMixer.from_dict(cfg).build_dataloader(batch_size=8)``). Validation is
its base :class:`~foundrymix.plan.catalog.Catalog`'s, the plan :mod:`foundrymix.plan`'s: it only builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from foundrymix.config import ConfigError
from foundrymix.plan.catalog import Catalog
from foundrymix.plan.config import LoaderConfig
from foundrymix.loader.storage import build_store
from foundrymix.plan.mixture import build_plan
from foundrymix.plan.stages import build_run_plan
from foundrymix.plan.topology import Topology, env_world_size

if TYPE_CHECKING:  # torch/streaming are imported lazily
    from foundrymix.loader.storage import RowStore
    from foundrymix.plan.mixture import Plan


class StreamMixer(Catalog):
    """A loader config's catalog (its streams' metadata, read once and validated) that builds
    the rows' store, a DataLoader and the plan from it."""

    stream_names = Catalog.names

    @classmethod
    def from_dict(cls, d: Any, where: str = 'train_loader') -> 'StreamMixer':
        return cls(LoaderConfig.from_dict(d, where), where)

    def build_store(self) -> 'RowStore':
        """The rows of every stream by sample id (streams in config order), cache directories
        claimed until ``release()``."""
        return build_store(self.config, self.infos(), self.where)

    def build_dataloader(self, batch_size: int, epochs: int = 1, world_size: Optional[int] = None,
                         rank: Optional[int] = None, rewind: bool = False) -> Any:
        """``epochs`` epochs in the plan's order: rank ``rank``'s ``batch_size`` rows of each
        global batch of ``world_size`` ranks (default: the launcher's), resumable at any batch.
        ``rewind``: every iteration starts at the first batch (an evaluation set)."""
        from foundrymix.loader.run_loader import build_run_loader
        if batch_size <= 0:
            raise ConfigError(f'batch_size must be positive, got {batch_size}')
        topology = Topology(1, world_size or env_world_size())
        own = [self] if self.config.stages is None else None  # its metadata is read once
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
        topology, infos = Topology(nodes=nodes, ranks_per_node=world_size // nodes), self.infos()
        if max_duration is not None and self.config.stages is None:
            return build_run_plan(self.config, [infos], batch_size, max_duration, topology).stages[0].plan
        return build_plan(self.config, infos, batch_size, max_duration, topology)[0]
