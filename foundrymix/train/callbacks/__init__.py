"""The ``callbacks`` section of a training YAML: one table, :data:`CALLBACKS`, YAML name -> (config,
factory); each factory imports its callback (beside this file, or Composer's) when the trainer is
built, so reading a config imports neither torch nor composer.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence

from foundrymix.config import Interval, TableEntry


@dataclass
class CallbackContext:
    """What a factory may need besides its own options: the run and the planned mixture."""

    config: Any  # the TrainConfig
    stream_names: Sequence[str]
    planned_share: Sequence[float]
    stage_names: Optional[Sequence[str]] = None  # a staged run's stages, in order
    eval_stream_names: Sequence[str] = ()  # the eval_loader's streams (none: no eval_loader)


@dataclass
class StreamAccountingConfig:
    """Per-stream token accounting (always on; these are its settings)."""

    log_interval: Interval = Interval('10ba')
    out_dir: Optional[str] = None  # default: <save_folder>/../report (a local save_folder) or ./runs/<run_name>/report
    plot: bool = True

    def report_dir(self, save_folder: Optional[str], run_name: str) -> str:
        """Where ``stream_accounting.{json,png}`` go."""
        if self.out_dir:
            return self.out_dir
        if save_folder and '://' not in save_folder:  # a remote save_folder has no local parent
            return os.path.join(os.path.dirname(os.path.abspath(save_folder)) or '.', 'report')
        return os.path.join('runs', run_name, 'report')


@dataclass
class SampleLogConfig:
    """Write every batch's global sample ids (and streams) to a JSONL file."""

    path: str = 'sample_log.jsonl'
    interval: str = '10ba'  # how often rank 0 gathers the ranks' ids and writes (also at the end and each checkpoint)


@dataclass
class StopAtConfig:
    """Stop (not shorten) the run at ``time``, e.g. to fit a cluster time limit."""

    time: Interval


@dataclass
class SpeedMonitorConfig:
    """Composer's ``SpeedMonitor``: throughput over the last ``window_size`` batches."""

    window_size: int = 100
    gpu_flops_available: Optional[float] = None
    time_unit: str = 'hours'


@dataclass
class NoOptions:
    """A Composer callback without options: ``lr_monitor`` (``LRMonitor``: the learning rate of every
    parameter group), ``memory_monitor`` (``MemoryMonitor``: GPU memory statistics every batch)."""


@dataclass
class RuntimeEstimatorConfig:
    """Composer's ``RuntimeEstimator``: the estimated time left, after ``skip_batches``."""

    skip_batches: int = 1
    time_unit: Literal['seconds', 'minutes', 'hours', 'days'] = 'hours'


def _stream_accounting(opts: StreamAccountingConfig, ctx: CallbackContext) -> Any:
    from foundrymix.train.callbacks.accounting import StreamAccounting
    return StreamAccounting(stream_names=ctx.stream_names, planned_share=ctx.planned_share,
                            stage_names=ctx.stage_names, eval_stream_names=ctx.eval_stream_names,
                            out_dir=opts.report_dir(ctx.config.save_folder, ctx.config.run_name),
                            log_interval=opts.log_interval, plot=opts.plot)


def part(module: str, name: str) -> Callable[..., Any]:
    """A factory of ``module.name`` (imported when the trainer is built) whose keyword arguments are
    the options' fields: the options' dataclass names them as the class does."""
    def build(opts: Any, *_: Any) -> Any:
        return getattr(importlib.import_module(module), name)(**dataclasses.asdict(opts))
    return build


#: YAML name -> (config dataclass, factory). ``stream_accounting`` is always built (with
#: default options when the YAML leaves it out); the others only when named.
CALLBACKS: dict[str, TableEntry] = {
    'stream_accounting': TableEntry(StreamAccountingConfig, _stream_accounting),
    'sample_log': TableEntry(SampleLogConfig, part('foundrymix.train.callbacks.sample_log', 'SampleLog')),
    'stop_at': TableEntry(StopAtConfig, part('foundrymix.train.callbacks.run', 'StopAt')),
    'speed_monitor': TableEntry(SpeedMonitorConfig, part('composer.callbacks', 'SpeedMonitor')),
    'lr_monitor': TableEntry(NoOptions, part('composer.callbacks', 'LRMonitor')),
    'memory_monitor': TableEntry(NoOptions, part('composer.callbacks', 'MemoryMonitor')),
    'runtime_estimator': TableEntry(RuntimeEstimatorConfig, part('composer.callbacks', 'RuntimeEstimator')),
}
ALWAYS_ON = ('stream_accounting',)


def build_callbacks(options: dict[str, Any], ctx: CallbackContext) -> dict[str, Any]:
    """YAML name -> Composer callback for every callback ``options`` names plus the always-on
    ones, always-on first."""
    names = [*ALWAYS_ON, *(n for n in options if n not in ALWAYS_ON)]
    return {name: CALLBACKS[name].factory(options.get(name) or CALLBACKS[name].config(), ctx) for name in names}
