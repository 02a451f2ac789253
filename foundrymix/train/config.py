"""The training YAML as typed objects: omegaconf for loading, dataclasses for meaning.

Why not hand the raw ``DictConfig`` around: an unknown or misspelt key must be an error
that names it (LLM-Foundry filters keys by ``inspect.signature`` and silently drops
typos). omegaconf does what it is good at -- YAML, ``${variables.x}`` interpolation and
``key=value`` command-line overrides -- and :meth:`TrainConfig.from_dict` turns the
resolved mapping into dataclasses, refusing anything it does not know.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence

from foundrymix.mix.config import ConfigError, LoaderConfig
from foundrymix.train.callbacks import CALLBACKS, StreamAccountingConfig
from foundrymix.train.model import ModelSpec


def _check_keys(d: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    for key in d:
        if key not in allowed:
            raise ConfigError(f'{where}: unknown key {key!r}; allowed: {", ".join(allowed)}')


def _from_mapping(cls: type, d: Optional[Mapping[str, Any]], where: str) -> Any:
    """Build a flat dataclass from a mapping, refusing unknown keys."""
    d = dict(d or {})
    names = [f.name for f in fields(cls)]
    _check_keys(d, names, where)
    return cls(**d)


@dataclass
class OptimizerConfig:
    """Composer's ``DecoupledAdamW`` (``decoupled_adamw``) or torch's ``AdamW`` (``adamw``)."""

    name: str = 'decoupled_adamw'
    lr: float = 1.0e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1.0e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ('decoupled_adamw', 'adamw'):
            raise ConfigError(f'optimizer.name: {self.name!r}; allowed: decoupled_adamw, adamw')
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]


@dataclass
class SchedulerConfig:
    """LR schedule: ``cosine_with_warmup``, ``linear_decay_with_warmup`` or ``constant_with_warmup``."""

    name: str = 'cosine_with_warmup'
    t_warmup: str = '0ba'
    alpha_f: float = 0.1

    def __post_init__(self) -> None:
        allowed = ('cosine_with_warmup', 'linear_decay_with_warmup', 'constant_with_warmup')
        if self.name not in allowed:
            raise ConfigError(f'scheduler.name: {self.name!r}; allowed: {", ".join(allowed)}')


LOGGERS = ('console', 'file')


@dataclass
class TrainConfig:
    """A whole training YAML (``variables`` is resolved and dropped)."""

    max_seq_len: int
    model: ModelSpec
    train_loader: LoaderConfig
    global_train_batch_size: int
    max_duration: str
    tokenizer: Optional[str] = None
    eval_loader: Optional[LoaderConfig] = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_train_microbatch_size: Any = None  # int or 'auto'; default: the device batch
    device_eval_batch_size: Optional[int] = None
    eval_interval: str = '1ep'
    eval_subset_num_batches: int = -1
    run_name: str = 'foundrymix'
    save_folder: Optional[str] = None
    save_interval: str = '1ep'
    save_num_checkpoints_to_keep: int = -1
    save_overwrite: bool = False
    autoresume: bool = False
    load_path: Optional[str] = None
    seed: int = 17
    precision: str = 'auto'
    device: str = 'auto'
    progress_bar: bool = False
    log_interval: str = '10ba'
    loggers: dict[str, dict[str, Any]] = field(default_factory=lambda: {'console': {}})
    callbacks: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> 'TrainConfig':
        d = dict(d)
        d.pop('variables', None)
        names = [f.name for f in fields(cls)] + ['variables']
        _check_keys(d, names, 'config')
        for required in ('max_seq_len', 'model', 'train_loader', 'global_train_batch_size', 'max_duration'):
            if d.get(required) is None:
                raise ConfigError(f'config: missing required key {required!r}')
        d['model'] = ModelSpec.from_dict(d['model'])
        d['train_loader'] = LoaderConfig.from_dict(d['train_loader'], where='train_loader')
        if d.get('eval_loader') is not None:
            d['eval_loader'] = LoaderConfig.from_dict(d['eval_loader'], where='eval_loader')
        d['optimizer'] = _from_mapping(OptimizerConfig, d.get('optimizer'), 'optimizer')
        d['scheduler'] = _from_mapping(SchedulerConfig, d.get('scheduler'), 'scheduler')
        loggers = dict(d.get('loggers') or {})
        _check_keys(loggers, LOGGERS, 'loggers')
        d['loggers'] = {k: dict(v or {}) for k, v in loggers.items()}
        callbacks = dict(d.get('callbacks') or {})
        _check_keys(callbacks, list(CALLBACKS), 'callbacks')
        d['callbacks'] = {name: _from_mapping(CALLBACKS[name].config, v, f'callbacks.{name}')
                          for name, v in callbacks.items()}
        for key in ('max_duration', 'eval_interval', 'save_interval', 'log_interval'):
            if key in d and d[key] is not None:
                d[key] = str(d[key])
        cfg = cls(**d)
        if cfg.global_train_batch_size <= 0:
            raise ConfigError('global_train_batch_size must be positive')
        return cfg

    @property
    def stream_accounting(self) -> StreamAccountingConfig:
        return self.callbacks.get('stream_accounting') or StreamAccountingConfig()


def load_config(path: str, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a YAML, apply ``key=value`` overrides, resolve interpolations, type it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not os.path.isfile(path):
        raise FileNotFoundError(f'{path}: no such config file')
    try:
        cfg = OmegaConf.load(path)
        for item in overrides:
            if '=' not in item:
                raise ConfigError(f'override {item!r}: expected key=value')
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f'{path}: {e}') from None
    if not isinstance(data, dict):
        raise ConfigError(f'{path}: expected a mapping at the top level')
    try:
        return TrainConfig.from_dict(data)
    except ConfigError as e:
        raise ConfigError(f'{path}: {e}') from None
