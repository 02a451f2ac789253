"""The training YAML as typed objects, read by the one config layer (:mod:`foundrymix.config`).

Why not hand the raw ``DictConfig`` around: an unknown or misspelt key must be an error
that names it (LLM-Foundry filters keys by ``inspect.signature`` and silently drops
typos). omegaconf loads the YAML, resolves ``${variables.x}`` and applies ``key=value``
overrides; :func:`foundrymix.config.read_dataclass` turns the result into these
dataclasses, refusing anything it does not know. Imports neither torch nor composer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from foundrymix.config import (ConfigError, check_duration, check_keys, load_yaml, read_dataclass,
                               to_plain)
from foundrymix.mix.config import LoaderConfig
from foundrymix.train.callbacks import CALLBACKS, StreamAccountingConfig
from foundrymix.train.gpu import FSDPSettings
from foundrymix.train.loggers import Loggers
from foundrymix.train.model_spec import ModelSpec

@dataclass
class OptimizerConfig:
    """Composer's ``DecoupledAdamW`` (``decoupled_adamw``) or torch's ``AdamW`` (``adamw``)."""

    name: Literal['decoupled_adamw', 'adamw'] = 'decoupled_adamw'
    lr: float = 1.0e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1.0e-8
    weight_decay: float = 0.0


@dataclass
class SchedulerConfig:
    """LR schedule: ``cosine_with_warmup``, ``linear_decay_with_warmup`` or ``constant_with_warmup``."""

    name: Literal['cosine_with_warmup', 'linear_decay_with_warmup',
                  'constant_with_warmup'] = 'cosine_with_warmup'
    t_warmup: str = '0ba'
    alpha_f: float = 0.1


def _read_callbacks(value: Any, where: str) -> dict[str, Any]:
    callbacks = to_plain(value, where)
    check_keys(callbacks, list(CALLBACKS), where)
    return {name: read_dataclass(CALLBACKS[name].config, v, f'{where}.{name}')
            for name, v in callbacks.items()}


class Callbacks(dict):
    """``callbacks``: YAML name -> that callback's config (the table in
    :mod:`foundrymix.train.callbacks`)."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'Callbacks':
        return cls(_read_callbacks(value, where))


@dataclass
class TrainConfig:
    """A whole training YAML (``variables`` is resolved and dropped)."""

    max_seq_len: int
    model: ModelSpec
    train_loader: LoaderConfig
    global_train_batch_size: int
    #: may be left out with ``train_loader.stages`` (the run is then the sum of the stages)
    max_duration: Optional[str] = None
    tokenizer: Optional[str] = None
    eval_loader: Optional[LoaderConfig] = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_train_microbatch_size: Optional[Union[int, Literal['auto']]] = None  # default: the device batch
    device_eval_batch_size: Optional[int] = None
    eval_interval: str = '1ep'
    eval_subset_num_batches: int = -1
    run_name: str = 'foundrymix'
    #: a local directory or ``s3://bucket/prefix`` (Composer uploads each checkpoint, then
    #: ``latest-rank0.pt.symlink`` naming it; endpoint and credentials from the environment)
    save_folder: Optional[str] = None
    save_interval: str = '1ep'
    #: local checkpoints kept (-1: all); Composer never deletes checkpoints in a bucket
    save_num_checkpoints_to_keep: int = -1
    save_overwrite: bool = False
    #: resume from the latest checkpoint in ``save_folder`` (for ``s3://``: the one the
    #: bucket's ``latest-rank0.pt.symlink`` names, see :mod:`foundrymix.train.remote_resume`)
    autoresume: bool = False
    #: a checkpoint to start from (local path or ``s3://...``); ignored when autoresume finds one
    load_path: Optional[str] = None
    seed: int = 17
    precision: str = 'auto'
    device: str = 'auto'
    #: Composer FSDP settings (``parallelism_config={'fsdp': ...}``); GPU runs only
    fsdp: Optional[FSDPSettings] = None
    #: ``None``: on when stdout is a terminal (Composer's bar; the console dump stays at ``log_interval``)
    progress_bar: Optional[bool] = None
    log_interval: str = '10ba'
    loggers: Loggers = field(default_factory=Loggers.default)
    callbacks: Callbacks = field(default_factory=Callbacks)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> 'TrainConfig':
        d = dict(d)
        d.pop('variables', None)
        return read_dataclass(cls, d)

    def check(self, where: str) -> None:
        if self.global_train_batch_size <= 0:
            raise ConfigError('global_train_batch_size must be positive')
        check_duration(self.max_duration, 'max_duration')
        if self.max_duration is None and self.train_loader.stages is None:
            raise ConfigError("config: missing required key 'max_duration' (it may be left out "
                              "only with train_loader.stages: the run is then the sum of the stages)")

    @property
    def stream_accounting(self) -> StreamAccountingConfig:
        return self.callbacks.get('stream_accounting') or StreamAccountingConfig()


@dataclass
class PlanConfig:
    """What ``foundrymix plan`` reads of a training YAML; every other training key is allowed
    (and ignored), any key a training run would refuse is refused here too."""

    train_loader: LoaderConfig
    global_train_batch_size: int
    max_duration: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> 'PlanConfig':
        d = dict(d)
        d.pop('variables', None)
        others = [name for name in TrainConfig.__dataclass_fields__ if name not in cls.__dataclass_fields__]
        picked = {k: v for k, v in d.items() if k not in others}
        check_keys(d, list(TrainConfig.__dataclass_fields__), '')
        return read_dataclass(cls, picked)

    def check(self, where: str) -> None:
        if self.global_train_batch_size <= 0:
            raise ConfigError(f'global_train_batch_size must be a positive integer, got '
                              f'{self.global_train_batch_size}')
        check_duration(self.max_duration, 'max_duration')


def load_config(path: str, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a YAML, apply ``key=value`` overrides, resolve interpolations, type it."""
    data = load_yaml(path, overrides)
    try:
        return TrainConfig.from_dict(data)
    except ConfigError as e:
        raise ConfigError(f'{path}: {e}') from None
