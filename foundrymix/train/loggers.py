"""The ``loggers`` section of a training YAML: one table, YAML name -> typed options and factory
(Composer's logger is imported when the trainer is built); a logger whose optional package is
missing is refused when the YAML is read.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from foundrymix.config import ConfigError, TableEntry, read_table
from foundrymix.train.callbacks import part


@dataclass
class ConsoleLoggerConfig:
    """Composer's ``ConsoleLogger``: the metric dump every ``log_interval`` (the top-level key)."""

    stream: Literal['stdout', 'stderr'] = 'stdout'


@dataclass
class FileLoggerConfig:
    """Composer's ``FileLogger``: the console dump (and captured output) in a text file."""

    filename: str = '{run_name}/logs-rank{rank}.txt'
    capture_stdout: bool = True
    capture_stderr: bool = True
    buffer_size: int = 1
    flush_interval: int = 100
    overwrite: bool = False


@dataclass
class TensorboardLoggerConfig:
    """Composer's ``TensorboardLogger``: event files under ``log_dir`` (default ``runs/<run_name>/tensorboard``)."""

    log_dir: Optional[str] = None
    flush_interval: int = 100
    rank_zero_only: bool = True


@dataclass
class MLFlowLoggerConfig:
    """Composer's ``MLFlowLogger``; ``tracking_uri`` defaults to a local file store,
    ``file:runs/<run_name>/mlruns`` (nothing is sent anywhere unless the YAML says so)."""

    tracking_uri: Optional[str] = None
    experiment_name: Optional[str] = None  # default: the run name
    run_name: Optional[str] = None
    tags: dict[str, str] = field(default_factory=dict)
    synchronous: bool = True
    log_system_metrics: bool = False
    rank_zero_only: bool = True
    #: Composer skips a value equal to the last one for this many steps; 1 logs every point
    log_duplicated_metric_every_n_steps: int = 1


@dataclass
class WandbLoggerConfig:
    """Composer's ``WandBLogger``. ``mode: offline`` (or ``WANDB_MODE=offline``) writes the
    run under ``dir`` only; ``sync`` it later with ``wandb sync``."""

    project: Optional[str] = None
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None  # default: the run name
    tags: list[str] = field(default_factory=list)
    mode: Optional[Literal['online', 'offline', 'disabled']] = None
    dir: Optional[str] = None
    rank_zero_only: bool = True


def _tensorboard(o: TensorboardLoggerConfig, run_name: str) -> Any:
    from composer.loggers import TensorboardLogger
    return TensorboardLogger(log_dir=o.log_dir or os.path.join('runs', run_name, 'tensorboard'),
                             flush_interval=o.flush_interval, rank_zero_only=o.rank_zero_only)


def _mlflow(o: MLFlowLoggerConfig, run_name: str) -> Any:
    from composer.loggers import MLFlowLogger
    uri = o.tracking_uri or 'file:' + os.path.abspath(os.path.join('runs', run_name, 'mlruns'))
    if uri.startswith('file:'):  # mlflow >= 3.7 refuses its file store unless asked for it explicitly
        os.environ.setdefault('MLFLOW_ALLOW_FILE_STORE', 'true')
    return MLFlowLogger(experiment_name=o.experiment_name or run_name, run_name=o.run_name or run_name,
                        tags=dict(o.tags) or None, tracking_uri=uri, synchronous=o.synchronous,
                        log_system_metrics=o.log_system_metrics, rank_zero_only=o.rank_zero_only,
                        log_duplicated_metric_every_n_steps=o.log_duplicated_metric_every_n_steps)


def _wandb(o: WandbLoggerConfig, run_name: str) -> Any:
    from composer.loggers import WandBLogger
    from wandb.sdk.wandb_run import Run
    if not hasattr(Run, 'get_url'):  # Composer's WandBLogger.init calls it; wandb 0.19+ renamed it url
        Run.get_url = lambda self: self.url
    init_kwargs = {k: v for k, v in (('mode', o.mode), ('dir', o.dir)) if v is not None}
    if o.dir:
        os.makedirs(o.dir, exist_ok=True)
    return WandBLogger(project=o.project, entity=o.entity, group=o.group, name=o.name or run_name,
                       tags=list(o.tags) or None, rank_zero_only=o.rank_zero_only, init_kwargs=init_kwargs)


#: YAML name -> (options, factory; ``console`` has none, Composer builds it, the package it needs, its extra)
LOGGERS: dict[str, TableEntry] = {
    'console': TableEntry(ConsoleLoggerConfig),
    'file': TableEntry(FileLoggerConfig, part('composer.loggers', 'FileLogger')),
    'tensorboard': TableEntry(TensorboardLoggerConfig, _tensorboard, 'tensorboard', 'tensorboard'),
    'mlflow': TableEntry(MLFlowLoggerConfig, _mlflow, 'mlflow', 'mlflow'),
    'wandb': TableEntry(WandbLoggerConfig, _wandb, 'wandb', 'wandb'),
}


def check_installed(name: str, where: str) -> None:
    """Refuse a logger whose optional package is missing, naming the extra that installs it."""
    entry = LOGGERS[name]
    if entry.module and importlib.util.find_spec(entry.module) is None:
        raise ConfigError(f"{where}: the {name} logger needs the {entry.module!r} package: "
                          f"pip install 'foundrymix[{entry.extra}]'")


class Loggers(dict):
    """``loggers``: YAML name -> that logger's options (a dataclass of :data:`LOGGERS`)."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'Loggers':
        return read_table(cls, LOGGERS, value, where, check_installed)

    @classmethod
    def default(cls) -> 'Loggers':
        return cls({'console': ConsoleLoggerConfig()})

    def build(self, run_name: str) -> list[Any]:
        """Composer logger destinations for every logger but ``console``, in YAML order."""
        return [LOGGERS[n].factory(o, run_name) for n, o in self.items() if LOGGERS[n].factory is not None]
