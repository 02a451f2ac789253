"""Turn a :class:`TrainConfig` into a Composer ``Trainer`` and run it.

Everything that can be refused is refused here, before the first step: a stream the
mixer rejects, a model that does not fit ``max_seq_len``, a batch size the ranks
cannot split, a ``load_path`` that does not exist.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from composer import Trainer
from composer.core import Callback, Evaluator
from composer.optim import (ConstantWithWarmupScheduler, CosineAnnealingWithWarmupScheduler, DecoupledAdamW,
                            LinearWithWarmupScheduler)
from composer.utils import dist, reproducibility

from foundrymix import s3_retries
from foundrymix.config import ConfigError
from foundrymix.mix.mixer import StreamMixer
from foundrymix.s3_retries import RetryCounts, S3RetryCounter
from foundrymix.train.callbacks import CallbackContext, build_callbacks
from foundrymix.train.callbacks.accounting import StreamAccounting
from foundrymix.train.callbacks.epoch_boundary import EpochBoundary
from foundrymix.train.callbacks.model_info import ModelInfo
from foundrymix.train.callbacks.s3_log import S3Log
from foundrymix.train.config import TrainConfig, split_batch
from foundrymix.train.console import console_kwargs, resume_line
from foundrymix.train.gpu import parallelism_config
from foundrymix.train.model import CausalLM, build_hf_model, check_pretrained_tokenizer
from foundrymix.train.remote_resume import is_remote, latest_checkpoint, poll_uploads_sooner

log = logging.getLogger(__name__)


@dataclass
class TrainRun:
    """What :func:`build_trainer` made, for callers that want more than ``fit()``."""

    config: TrainConfig
    trainer: Trainer
    mixer: StreamMixer
    accounting: StreamAccounting
    plan: Any


def _device(cfg: TrainConfig) -> str:
    if cfg.device != 'auto':
        return cfg.device
    return 'gpu' if torch.cuda.is_available() else 'cpu'


def _precision(cfg: TrainConfig, device: str) -> str:
    if cfg.precision != 'auto':
        return cfg.precision
    return 'amp_bf16' if device == 'gpu' else 'fp32'


def _optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == 'adamw':
        return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return DecoupledAdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def _scheduler(cfg: TrainConfig) -> Any:
    s = cfg.scheduler
    if s.name == 'cosine_with_warmup':
        return CosineAnnealingWithWarmupScheduler(t_warmup=s.t_warmup, alpha_f=s.alpha_f)
    if s.name == 'linear_decay_with_warmup':
        return LinearWithWarmupScheduler(t_warmup=s.t_warmup, alpha_f=s.alpha_f)
    return ConstantWithWarmupScheduler(t_warmup=s.t_warmup)


def _share_cpu_threads(device: str) -> None:
    """Split the CPU cores over the ranks of this node, as ``torchrun`` does.

    Why: Composer's launcher leaves ``OMP_NUM_THREADS`` unset, so every CPU rank starts
    one intra-op thread per core; with ``composer -n 2`` on 2 cores the ranks' threads
    oversubscribe the cores and each collective waits on descheduled threads (a 2-rank
    CPU run took ~1.7x as long). An explicit ``OMP_NUM_THREADS`` is respected.
    """
    local_ranks = dist.get_local_world_size()
    if device != 'cpu' or local_ranks <= 1 or os.environ.get('OMP_NUM_THREADS'):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // local_ranks))


def _check_load_path(cfg: TrainConfig) -> None:
    path = cfg.load_path
    if path and '://' not in path and not os.path.exists(path):
        raise FileNotFoundError(f'load_path: {path}: no such checkpoint')


def _resume_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """Composer's ``autoresume``/``load_path``; for a remote ``save_folder`` we find the latest
    checkpoint in the bucket ourselves (see :mod:`foundrymix.train.remote_resume`)."""
    if cfg.autoresume and is_remote(cfg.save_folder):
        latest = latest_checkpoint(cfg.save_folder)
        return {'autoresume': False, 'load_path': latest or cfg.load_path}
    return {'autoresume': cfg.autoresume,
            'load_path': None if cfg.autoresume and not cfg.load_path else cfg.load_path}


def _batch_sizes(cfg: TrainConfig) -> tuple[int, Union[int, str]]:
    """(per-rank batch, microbatch) on this run's ranks (:func:`split_batch`)."""
    return split_batch(cfg, dist.get_world_size())


def _train_mixer(cfg: TrainConfig, mixer: StreamMixer) -> StreamMixer:
    """The validated train mixer; its rows must be ``max_seq_len`` long, from ``cfg.tokenizer``."""
    mixer.validate()
    if mixer.max_seq_len != cfg.max_seq_len:
        raise ConfigError(f'max_seq_len={cfg.max_seq_len}, but the train streams hold rows of '
                          f'{mixer.max_seq_len} tokens')
    if cfg.tokenizer is not None:
        from foundrymix.tokenizer import load_tokenizer, tokenizer_info
        expected = tokenizer_info(load_tokenizer(cfg.tokenizer)).fingerprint
        if expected != mixer.tokenizer.fingerprint:
            raise ConfigError(f'tokenizer {cfg.tokenizer!r} differs from the one the streams were '
                              f'converted with ({mixer.tokenizer.name})')
    check_pretrained_tokenizer(cfg.model, mixer.tokenizer)
    return mixer


def _evaluator(cfg: TrainConfig, mixer: StreamMixer, device_batch: int) -> Optional[Evaluator]:
    """The ``eval_loader`` as an evaluator, or None; its streams must match the train streams."""
    if cfg.eval_loader is None:
        return None
    eval_mixer = StreamMixer(cfg.eval_loader)
    eval_mixer.validate()
    if eval_mixer.max_seq_len != cfg.max_seq_len or eval_mixer.tokenizer.fingerprint != mixer.tokenizer.fingerprint:
        raise ConfigError('eval_loader streams differ from train_loader streams in max_seq_len or tokenizer')
    eval_batch = cfg.device_eval_batch_size or device_batch
    return Evaluator(label='eval', dataloader=eval_mixer.build_dataloader(batch_size=eval_batch),
                     metric_names=['LanguageCrossEntropy'])


@dataclass
class TrainData:
    """The train loader and what the rest of the run needs to know about it."""

    loader: Any
    mixer: StreamMixer            # the (first stage's) mixer: tokenizer, max_seq_len
    plan: Any                     # Plan, or RunPlan for a staged run
    stream_names: list[str]       # run-wide stream index -> name (the batches' stream_id)
    planned_share: list[float]    # of the rows trained over the run
    max_duration: str
    stage_names: Optional[list[str]] = None


def _train_data(cfg: TrainConfig, device_batch: int) -> TrainData:
    """The train loader: one mixture (a ``StreamingDataLoader``), or every stage in turn."""
    if cfg.train_loader.stages is None:
        mixer = _train_mixer(cfg, StreamMixer(cfg.train_loader))
        plan = mixer.plan(batch_size=device_batch, max_duration=cfg.max_duration,
                          world_size=dist.get_world_size(),
                          nodes=dist.get_world_size() // dist.get_local_world_size())
        return TrainData(loader=mixer.build_dataloader(batch_size=device_batch), mixer=mixer,
                         plan=plan, stream_names=mixer.stream_names,
                         planned_share=[s.share for s in plan.streams],
                         max_duration=str(cfg.max_duration))
    from foundrymix.mix.plan import Topology
    from foundrymix.mix.staged_loader import build_staged_loader
    ranks_per_node = dist.get_local_world_size()
    topology = Topology(nodes=dist.get_world_size() // ranks_per_node, ranks_per_node=ranks_per_node)
    loader = build_staged_loader(cfg.train_loader, device_batch, cfg.max_duration, topology)
    for mixer in loader.mixers:
        _train_mixer(cfg, mixer)
    run = loader.run
    total = sum(run.rows_per_stream.values()) or 1
    return TrainData(loader=loader, mixer=loader.mixers[0], plan=run,
                     stream_names=loader.stream_names,
                     planned_share=[run.rows_per_stream.get(n, 0) / total for n in loader.stream_names],
                     max_duration=f'{run.total_batches}ba',
                     stage_names=[s.name for s in run.stages])


def _callbacks(cfg: TrainConfig, data: TrainData, hf_model: Any,
               retry_counter: S3RetryCounter, since: RetryCounts) -> tuple[list[Callback], StreamAccounting]:
    """``EpochBoundary``, ``ModelInfo`` and ``S3Log`` first, then every callback of the table the run uses
    (accounting always)."""
    ctx = CallbackContext(config=cfg, stream_names=data.stream_names,
                          planned_share=data.planned_share, stage_names=data.stage_names)
    built = build_callbacks(cfg.callbacks, ctx)
    info = ModelInfo(hf_model.config, cfg.model.attention, data.mixer.tokenizer, cfg.model.pretrained)
    return [EpochBoundary(), info, S3Log(retry_counter, since), *built.values()], built['stream_accounting']


def _trainer(cfg: TrainConfig, model: CausalLM, train_loader: Any, evaluator: Optional[Evaluator],
             micro: Union[int, str], callbacks: list[Callback], max_duration: str) -> Trainer:
    device = _device(cfg)
    _share_cpu_threads(device)
    return Trainer(
        model=model,
        train_dataloader=train_loader,
        eval_dataloader=evaluator,
        eval_interval=cfg.eval_interval if evaluator is not None else 1,
        eval_subset_num_batches=cfg.eval_subset_num_batches,
        max_duration=max_duration,
        optimizers=_optimizer(cfg, model),
        schedulers=_scheduler(cfg),
        step_schedulers_every_batch=True,
        device=device,
        precision=_precision(cfg, device),
        device_train_microbatch_size=micro,
        parallelism_config=parallelism_config(cfg.fsdp, device),
        callbacks=callbacks,
        loggers=cfg.loggers.build(cfg.run_name),
        run_name=cfg.run_name,
        **console_kwargs(cfg),
        save_folder=cfg.save_folder,
        save_interval=cfg.save_interval,
        save_num_checkpoints_to_keep=cfg.save_num_checkpoints_to_keep,
        save_overwrite=cfg.save_overwrite,
        **_resume_kwargs(cfg),
        seed=cfg.seed,
    )


def build_trainer(cfg: TrainConfig) -> TrainRun:
    """Validate everything, then build model, data, callbacks and the Composer trainer."""
    device_batch, micro = _batch_sizes(cfg)
    _check_load_path(cfg)
    retry_counter = s3_retries.install()  # before the first metadata fetch
    retries_before = retry_counter.snapshot()
    data = _train_data(cfg, device_batch)

    reproducibility.seed_all(cfg.seed)
    hf_model = build_hf_model(cfg.model, data.mixer.tokenizer, cfg.max_seq_len)
    model = CausalLM(hf_model, attention=cfg.model.attention)
    evaluator = _evaluator(cfg, data.mixer, device_batch)
    callbacks, accounting = _callbacks(cfg, data, hf_model, retry_counter, retries_before)
    trainer = _trainer(cfg, model, data.loader, evaluator, micro, callbacks, data.max_duration)
    poll_uploads_sooner(trainer)
    line = resume_line(trainer.state)
    if line and dist.get_global_rank() == 0:
        print(line, flush=True)
    return TrainRun(config=cfg, trainer=trainer, mixer=data.mixer, accounting=accounting,
                    plan=data.plan)


def train(cfg: TrainConfig) -> TrainRun:
    """Build and fit; returns the run (its accounting holds the per-stream summary)."""
    run = build_trainer(cfg)
    run.trainer.fit()
    run.trainer.close()
    if dist.get_global_rank() == 0 and cfg.train_loader.stages is not None:
        _plot_staged(run)
    return run


def _plot_staged(run: TrainRun) -> None:
    """The planned mixture over the run's batches with the realized one drawn over it."""
    from foundrymix.mix.report import plot_run_plan
    history = run.accounting.history
    if not history or not run.accounting.plot:
        return
    realized = ([p['batch'] for p in history], [p['samples'] for p in history])
    plot_run_plan(run.plan, os.path.join(run.accounting.out_dir, 'mixture.png'), realized)
