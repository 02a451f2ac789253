"""The run's loader for any training loop: :func:`build_loader`, the loader the trainer is given,
from the same plan (stages, mixtures, repetition and resume behave identically). Imports no
trainer: a YAML is read by the core's ``DataConfig``. How to use it: docs/any-trainer.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

from foundrymix.config import ConfigError
from foundrymix.heap import collector_paused
from foundrymix.plan.data_config import DataConfig, batch_per_rank, check_data_streams, read_yaml_config
from foundrymix.plan.topology import Topology

if TYPE_CHECKING:
    from foundrymix.loader.run_loader import StagedDataLoader

#: a YAML file, or the same keys as a mapping (``${variables.x}`` interpolations resolved)
ConfigSource = Union[str, 'os.PathLike[str]', Mapping[str, Any]]


def build_loader(config: ConfigSource, *, rank: Optional[int] = None,
                 world_size: Optional[int] = None, overrides: Sequence[str] = (),
                 max_duration: Optional[str] = None) -> 'StagedDataLoader':
    """The run's loader for global rank ``rank`` of ``world_size`` ranks (default: the
    launcher's ``RANK`` / ``WORLD_SIZE``, else 0 of 1).

    A plain stateful iterable (accelerate, Lightning Fabric and the HF Trainer take it unchanged)
    yielding this rank's ``global_train_batch_size / world_size`` rows of every global batch from
    its position (``state_dict()``) to the end of the run. Data keys are refused as the trainer and
    ``foundrymix plan`` refuse them, in one line (trainer keys are theirs to check).
    """
    from foundrymix.loader.run_loader import build_run_loader

    rank, world_size = _ranks(rank, world_size)
    cfg = _read(config, overrides, max_duration)
    device_batch = batch_per_rank(cfg, world_size)
    loader, catalogs = build_run_loader(cfg.train_loader, device_batch, cfg.max_duration,
                                        Topology(nodes=1, ranks_per_node=world_size), rank=rank)
    for catalog in catalogs:
        check_data_streams(cfg, catalog.max_seq_len, catalog.tokenizer)
    return loader


def _ranks(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    """(rank, world size), given or from the launcher's environment, checked."""
    def number(value: Any, env: str, default: int) -> int:
        if value is None:
            value = os.environ.get(env, default)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f'build_loader: {env.lower()} must be an integer, got {value!r}') from None

    r, w = number(rank, 'RANK', 0), number(world_size, 'WORLD_SIZE', 1)
    if w < 1 or not 0 <= r < w:
        raise ConfigError(f'build_loader: rank {r} of world_size {w}: world_size must be at least 1 '
                          f'and rank in 0..world_size-1')
    return r, w


@collector_paused()  # a large YAML allocates much and frees nothing (foundrymix/heap.py)
def _read(config: ConfigSource, overrides: Sequence[str], max_duration: Optional[str]) -> DataConfig:
    """The data part of the config (:meth:`~foundrymix.plan.data_config.DataConfig.from_run`:
    a YAML without ``model`` is data-only, every key checked)."""
    if isinstance(config, (str, os.PathLike)):
        return read_yaml_config(os.fspath(config), overrides, max_duration, DataConfig.from_run)
    if not isinstance(config, Mapping):
        raise ConfigError(f'build_loader: config must be a YAML path or a mapping, got '
                          f'{type(config).__name__}')
    if overrides:
        raise ConfigError('build_loader: overrides apply to a YAML file; set the keys in the '
                          'mapping instead')
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    try:  # a plain copy with ``${...}`` interpolations resolved, as a YAML's are
        data: Any = OmegaConf.to_container(OmegaConf.create(dict(config)), resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f'config: {type(e).__name__}: {e}') from None
    if max_duration is not None:
        data['max_duration'] = max_duration
    return DataConfig.from_run(data)
