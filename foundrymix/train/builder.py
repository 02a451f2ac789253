"""Turn a :class:`TrainConfig` into a Composer ``Trainer`` and run it; everything that can be
refused (streams, model fit, batch split, ``load_path``, a ``save_folder`` or stream directory
another run or conversion holds: :func:`claim_run`) is refused before the first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from composer import Trainer
from composer.core import Callback, Evaluator
from composer.utils import dist, format_name_with_dist, reproducibility

from foundrymix import claims
from foundrymix.config import ConfigError
from foundrymix.s3 import retries as s3_retries
from foundrymix.errors import ExistsError
from foundrymix.heap import collector_paused
from foundrymix.loader.mixer import StreamMixer
from foundrymix.loader.run_loader import StagedDataLoader, build_run_loader
from foundrymix.plan.data_config import check_eval_catalog
from foundrymix.plan.stages import RunPlan
from foundrymix.s3.retries import RetryCounts, S3RetryCounter
from foundrymix.format.schema import TokenizerInfo
from foundrymix.train.callbacks import CallbackContext, build_callbacks
from foundrymix.train.callbacks.accounting import StreamAccounting
from foundrymix.train.callbacks.run import ModelInfo, ResumeRng, S3Log
from foundrymix.train.config import TrainConfig, check_streams, split_batch
from foundrymix.train.data_adapter import ComposerLoader
from foundrymix.train.model_spec import mpt_attention_line
from foundrymix.train.console import console_kwargs, extension_line, finished_line, resume_line, wsd_resume_line
from foundrymix.train import interrupt
from foundrymix.train.gpu import convert_to_fp8, parallelism_config
from foundrymix.train.model import CausalLM, build_hf_model
from foundrymix.train.optim import build_optimizer
from foundrymix.train.preflight import check_start, local_device
from foundrymix.train.lr_schedule import WSDSchedule, build_scheduler, resolve_wsd
from foundrymix.train.remote_resume import is_remote, resume_kwargs, sharded
from foundrymix.train.save import LocalSave, RemoteSave, remote_save
from foundrymix.train.together import StopTogether

# Modules every trainer start uses, imported with the trainer rather than inside the start
# (a rank pays them once either way).
import omegaconf  # noqa: E402 (load_config's YAML reader)
from foundrymix import tokenizer as _tokenizer  # noqa: E402
from foundrymix.loader import cache as _cache, collate as _collate, storage as _storage  # noqa: E402
from foundrymix.s3 import remote as _remote  # noqa: E402
from foundrymix.plan.topology import Topology
from foundrymix.train.callbacks.adaptive import AdaptiveMixing
from foundrymix.train.picture import plot_run_plan

PRELOADED = (omegaconf, _tokenizer, _cache, _collate, _storage, _remote)

log = logging.getLogger(__name__)


@dataclass
class TrainRun:
    """What :func:`build_trainer` made, for callers that want more than ``fit()``."""

    config: TrainConfig
    trainer: Trainer
    run_plan: RunPlan             # the run's one plan (a single mixture: one stage)
    accounting: StreamAccounting
    plan: Any                     # a single mixture's Plan, or the RunPlan of a staged run
    #: the run's claims (save_folder, stream directories); :func:`train` releases them at the end
    claims: claims.ClaimSet = dataclasses.field(default_factory=claims.ClaimSet)
    #: ``already finished: ...`` when it resumed at or past max_duration (nothing was trained)
    finished: Optional[str] = None
    #: a remote save_folder's saver and uploader (:mod:`foundrymix.train.save`)
    remote_save: Optional[RemoteSave] = None


def _device(cfg: TrainConfig) -> str:
    if cfg.device == 'gpu' and local_device() != 'gpu':  # train only: plan a GPU run on any machine
        raise ConfigError('device: gpu, and this machine has no CUDA GPU that torch can use '
                          '(torch.cuda.is_available() is false): give device: cpu, or auto')
    return cfg.device if cfg.device != 'auto' else local_device()


def _precision(cfg: TrainConfig, device: str) -> str:
    if cfg.precision != 'auto':  # amp_fp8: float8 linears (gpu.convert_to_fp8) in amp_bf16
        return 'amp_bf16' if cfg.precision == 'amp_fp8' else cfg.precision
    return 'amp_bf16' if device == 'gpu' else 'fp32'


def _share_cpu_threads(device: str) -> None:
    """Split the CPU cores over this node's CPU ranks, as ``torchrun`` does (Composer's launcher
    does not: a thread per core per rank, and collectives wait); ``OMP_NUM_THREADS`` set wins."""
    local_ranks = dist.get_local_world_size()
    if device != 'cpu' or local_ranks <= 1 or os.environ.get('OMP_NUM_THREADS'):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // local_ranks))


def _print0(*lines: Optional[str]) -> None:
    """Each line given (None: none), on rank 0 only."""
    if dist.get_global_rank() == 0:
        for line in filter(None, lines):
            print(line, flush=True)


def _evaluator(cfg: TrainConfig, tokenizer: TokenizerInfo,
               device_batch: int) -> tuple[Optional[Evaluator], list[str]]:
    """The ``eval_loader`` as an evaluator (or None; rows like the train streams') and its stream names."""
    if cfg.eval_loader is None:
        return None, []
    eval_mixer = StreamMixer(cfg.eval_loader, 'eval_loader')
    check_eval_catalog(eval_mixer, cfg.max_seq_len, tokenizer)  # rows like the train streams'
    eval_batch = cfg.device_eval_batch_size or device_batch
    loader = eval_mixer.build_dataloader(batch_size=eval_batch, rewind=True)
    left = {n: k for n, k in loader.run.stages[0].plan.left_out_per_epoch.items() if k}
    if left:  # an evaluation is whole global batches: say which rows it leaves out
        log.warning('eval_loader: every evaluation reads whole global batches of %d rows, so %s '
                    'rows are not evaluated (%s); a global eval batch that divides the eval '
                    'rows evaluates every row', loader.run.stages[0].global_batch_size,
                    sum(left.values()), ', '.join(f'{n} {k}' for n, k in left.items()))
    # a damaged eval shard stops every rank too, at its batch
    return Evaluator(label='eval', dataloader=ComposerLoader(loader, together=StopTogether()),
                     metric_names=['LanguageCrossEntropy']), eval_mixer.stream_names


@dataclass
class TrainData:
    """The train loader (Composer gets it through :class:`ComposerLoader`) and what the run needs of it."""

    loader: StagedDataLoader
    run: RunPlan                  # the run's one plan: the loader is built from it
    tokenizer: TokenizerInfo
    max_duration: str             # what Composer is given
    t_warmup: str = '0ba'         # scheduler.t_warmup as Composer is given it (in max_duration's unit)

    @property
    def planned_share(self) -> list[float]:
        """Per run-wide stream: its share of the rows the whole run trains (a run may end mid-epoch);
        adaptive stages, whose rows are not known before: the first stage's per-epoch share."""
        total = sum(self.run.rows_per_stream.values())
        if not total:
            shares = {s.name: s.share for s in self.run.stages[0].plan.streams}
            return [shares.get(n, 0.0) for n in self.loader.stream_names]
        return [self.run.rows_per_stream.get(n, 0) / total for n in self.loader.stream_names]


@collector_paused()  # the plan record and loader objects: many, all kept (foundrymix/heap.py)
def _train_data(cfg: TrainConfig, device_batch: int) -> TrainData:
    """The run's plan (catalogs read once) and the one loader built from it, staged or not."""
    ranks_per_node = dist.get_local_world_size()
    topology = Topology(nodes=dist.get_world_size() // ranks_per_node, ranks_per_node=ranks_per_node)
    loader, catalogs = build_run_loader(cfg.train_loader, device_batch, cfg.max_duration, topology)
    max_duration, t_warmup = check_start(cfg, loader.run)
    for catalog in catalogs:
        check_streams(cfg, catalog.max_seq_len, catalog.tokenizer)
    return TrainData(loader=loader, run=loader.run, tokenizer=catalogs[0].tokenizer,
                     max_duration=max_duration, t_warmup=t_warmup)


def _callbacks(cfg: TrainConfig, data: TrainData, hf_model: Any, retry_counter: S3RetryCounter,
               since: RetryCounts, eval_streams: list[str]) -> tuple[list[Callback], StreamAccounting]:
    """``ModelInfo``, ``S3Log``, ``ResumeRng`` (and adaptive mixing), then the table's callbacks."""
    ctx = CallbackContext(config=cfg, stream_names=data.loader.stream_names, planned_share=data.planned_share,
                          stage_names=[s.name for s in data.run.stages] if data.run.explicit else None,
                          eval_stream_names=eval_streams)
    built = build_callbacks(cfg.callbacks, ctx)
    info = ModelInfo(hf_model.config, cfg.model.attention, data.tokenizer, cfg.model.pretrained, cfg.model.peft)
    accounting = built['stream_accounting']
    adaptive: list[Callback] = []
    if data.loader.position.adaptive:  # the per-stream loss -> the adaptive stages' weights
        adaptive.append(AdaptiveMixing(data.loader, accounting.out_dir, accounting))
    return [info, S3Log(retry_counter, since), ResumeRng(), *adaptive, *built.values()], accounting


def _trainer(cfg: TrainConfig, model: CausalLM, train_loader: Any, evaluator: Optional[Evaluator],
             micro: Union[int, str], callbacks: list[Callback], max_duration: str,
             scheduler: Any) -> tuple[Trainer, Optional[RemoteSave]]:
    """The Composer trainer, and for a remote ``save_folder`` (not sharded) the saver and
    uploader it is given in place of Composer's own; a local one (not sharded) gets
    :class:`~foundrymix.train.save.LocalSave` (:mod:`foundrymix.train.save`)."""
    device = _device(cfg)
    _share_cpu_threads(device)
    resume = {'save_overwrite': cfg.save_overwrite, **resume_kwargs(cfg, device)}
    loggers, saving = cfg.loggers.build(cfg.run_name), None
    local = cfg.save_folder and not is_remote(cfg.save_folder) and not sharded(cfg)
    if is_remote(cfg.save_folder) and not sharded(cfg):
        saving = remote_save(cfg, resume.pop('save_overwrite'))
        callbacks, loggers = [*callbacks, saving.saver], [*loggers, saving.uploader]
    elif local:  # write-then-rename
        callbacks = [*callbacks, LocalSave(cfg.save_folder, cfg.save_interval, resume.pop('save_overwrite'),
                                           cfg.save_num_checkpoints_to_keep)]
    if cfg.compile_config is not None:  # every recompilation is printed with its reason
        torch._logging.set_logs(recompiles=True)
    try:
        return Trainer(
            model=model, train_dataloader=train_loader, eval_dataloader=evaluator,
            eval_interval=cfg.eval_interval if evaluator is not None else 1,
            eval_subset_num_batches=cfg.eval_subset_num_batches, max_duration=max_duration,
            optimizers=build_optimizer(cfg, model, device), schedulers=scheduler, step_schedulers_every_batch=True,
            device=device, precision=_precision(cfg, device), device_train_microbatch_size=micro,
            parallelism_config=parallelism_config(cfg.fsdp),
            compile_config=cfg.compile_config.as_dict() if cfg.compile_config is not None else None,
            callbacks=callbacks, algorithms=cfg.algorithms.build(), loggers=loggers, run_name=cfg.run_name,
            **console_kwargs(cfg), save_folder=cfg.save_folder if saving is None and not local else None,
            save_interval=cfg.save_interval, save_num_checkpoints_to_keep=cfg.save_num_checkpoints_to_keep,
            **{'load_weights_only': cfg.load_weights_only, **resume}, seed=cfg.seed), saving
    except BaseException as e:
        if saving is not None:
            saving.close()
        if isinstance(e, RuntimeError) and 'size mismatch' in str(e) and resume.get('load_path'):
            # torch's load_state_dict, inside Composer's load: a checkpoint of another model
            first = next(line.strip() for line in str(e).splitlines() if 'size mismatch' in line)
            raise ConfigError(f"{resume['load_path']}: the checkpoint is of another model ({first}); "
                              f'give the model section it was trained with, or another checkpoint') from None
        raise


def build_trainer(cfg: TrainConfig) -> TrainRun:
    """Validate everything, then build model, data, callbacks and the Composer trainer. The run's
    claims are held from the start; :func:`train` releases them (a caller that only builds:
    ``run.claims.release()``)."""
    device_batch, micro = split_batch(cfg, dist.get_world_size())
    if dist.get_world_size() > 1:  # now, so that the start is agreed (StopTogether); Composer reuses it
        dist.initialize_dist(_device(cfg))
    held = claims.ClaimSet()
    made = _missing_dirs(cfg)
    try:
        return _build(cfg, device_batch, micro, held)
    except BaseException:
        held.release()
        for path in made:  # a refused start leaves no folder behind (Composer makes save_folder at init)
            with contextlib.suppress(OSError):
                os.rmdir(path)  # only if empty: nothing anyone wrote is removed
        raise


def _missing_dirs(cfg: TrainConfig) -> list[str]:
    """A local ``save_folder`` and its ancestors that do not exist yet, deepest first."""
    if not cfg.save_folder or is_remote(cfg.save_folder):
        return []
    path, missing = os.path.abspath(format_name_with_dist(cfg.save_folder, cfg.run_name)), []
    while not os.path.exists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def claim_run(cfg: TrainConfig, held: claims.ClaimSet) -> None:
    """Claim, into ``held`` (the caller releases it, also on a refusal), all at once or none, what this
    run must not share: ``save_folder`` exclusively (an ``s3://`` one by its URL, on this machine), every
    local stream directory of every stage and of ``eval_loader`` as a reader (a ``convert --overwrite``
    would mix old and new rows). Taken before anything is written: a refused start changes nothing.
    """
    wanted: dict[tuple[str, str], Any] = {}  # (path, mode) -> the refusal's message(holders)
    if cfg.save_folder:
        folder = format_name_with_dist(cfg.save_folder, cfg.run_name)  # as Composer names it
        wanted[(claims.normalize(folder), claims.EXCLUSIVE)] = lambda who: (
            f'save_folder: {folder} is in use by another live run, {who}. Two runs saving into '
            f"one folder overwrite each other's checkpoints: give this run its own save_folder, "
            f'or wait for that run to end')
    for where, loader in (('train_loader', cfg.train_loader), ('eval_loader', cfg.eval_loader)):
        for stage in loader.stage_configs(where) if loader is not None else []:
            for name, spec in stage.streams.items():
                if spec.remote:
                    continue
                for path in dict.fromkeys((stage.stream_local(name), stage.stream_dir(name))):
                    wanted.setdefault((claims.normalize(path), claims.SHARED), lambda who, where=where, name=name, path=path: (
                        f'{where}.streams.{name}: {path} is held by another live run, {who} (a '
                        f'conversion replacing it, or a run writing there); reading it now would '
                        f'mix old and new rows. Wait for that run to end'))
    try:
        held.held.extend(claims.claim_all(wanted))
    except claims.Busy as e:
        raise ConfigError(wanted[(e.path, e.mode)](claims.describe(e.holders))) from None


def _build(cfg: TrainConfig, device_batch: int, micro: Union[int, str], held: claims.ClaimSet) -> TrainRun:
    retry_counter = s3_retries.install()  # before the first metadata fetch
    retries_before = retry_counter.snapshot()
    with StopTogether('could not start'):  # nothing in it is collective: a failing rank stops them all
        claim_run(cfg, held)
        data = _train_data(cfg, device_batch)
        scheduler = build_scheduler(cfg, data.run, data.t_warmup)  # wsd spans refused before the model
        reproducibility.seed_all(cfg.seed)
        hf_model = build_hf_model(cfg.model, data.tokenizer, cfg.max_seq_len)
        _print0(getattr(hf_model, 'foundrymix_loading', None), getattr(hf_model, 'foundrymix_lora', None),
                mpt_attention_line(cfg.model.model_type, cfg.model.config_kwargs))
        if cfg.precision == 'amp_fp8':
            convert_to_fp8(hf_model)
        model = CausalLM(hf_model, attention=cfg.model.attention, fused_loss=cfg.model.fused_loss)
        evaluator, eval_streams = _evaluator(cfg, data.tokenizer, device_batch)
    callbacks, accounting = _callbacks(cfg, data, hf_model, retry_counter, retries_before, eval_streams)
    # one Composer epoch is one of the mixture; a damaged shard stops every rank, each saying why
    composer_loader = ComposerLoader(data.loader, epochs=True, together=StopTogether())
    trainer, saving = _trainer(cfg, model, composer_loader, evaluator, micro, callbacks, data.max_duration,
                               scheduler)
    if saving is not None:  # a failed checkpoint upload stops every rank at the next batch
        composer_loader.together.probes.append(saving.uploader.failed)
    finished = None if cfg.load_weights_only else finished_line(trainer.state)
    position = data.loader.position
    line = None if finished else resume_line(trainer.state, position, cfg.load_weights_only)
    if line and isinstance(scheduler, WSDSchedule):
        _print0(line, wsd_resume_line(trainer.state, position, scheduler))  # the checkpoint's LR, then ours
        scheduler.apply_resume_lr(trainer.state)
    elif line:
        _print0(line, extension_line(trainer.state, position, scheduler, cfg.optimizer.lr))
    return TrainRun(config=cfg, trainer=trainer, run_plan=data.run, accounting=accounting,
                    plan=data.run if data.run.explicit else data.run.stages[0].plan, claims=held,
                    finished=finished, remote_save=saving)


def train(cfg: TrainConfig) -> TrainRun:
    """Build and fit; returns the run (its accounting holds the per-stream summary)."""
    run = build_trainer(cfg)
    try:
        if run.finished:  # a relaunch of a finished run: done, nothing to fit
            _print0(run.finished)
            run.trainer.close()
            return run
        try:
            if cfg.eval_first and run.trainer.state.timestamp.batch.value == 0 and run.trainer.state.evaluators:
                run.trainer.eval()  # LLM-Foundry's eval_first: a baseline before the first step
            run.trainer.fit()
        except FileExistsError as e:
            # Composer 0.32 refuses an earlier run's checkpoints in save_folder at FIT_START and
            # says "set overwrite=True", a key this config does not have: name the ones it has.
            if 'may conflict with a future checkpoint' not in str(e):
                raise
            raise ExistsError(f'{e} ({cfg.save_folder} holds an earlier run\'s checkpoints: '
                                  f'save_overwrite=true replaces them, autoresume=true continues it if it '
                                  f'did not finish, or choose another save_folder)') from None
        run.trainer.close()
        adaptive = any(s.config is not None and s.config.adaptive for s in run.run_plan.stages)
        if dist.get_global_rank() == 0 and (run.run_plan.explicit or adaptive):
            _plot_staged(run)  # (adaptive: the configured start, the realized shares over it)
    except BaseException:
        if interrupt.received is None:
            raise
        raise interrupt.stopped(cfg, int(run.trainer.state.timestamp.batch), dist.get_global_rank()) from None
    finally:
        run.claims.release()
        if run.remote_save is not None:
            run.remote_save.close()
    return run


def _plot_staged(run: TrainRun) -> None:
    """The planned mixture with the realized one over it, the loss per stream and a ``wsd`` run's LR."""
    history = run.accounting.history
    if not history or not run.accounting.plot:
        return
    batches = [p['batch'] for p in history]
    realized = (batches, [p['samples'] for p in history])
    losses = (batches, [p['loss_sum'] for p in history], [p['loss_targets'] for p in history])
    cfg = run.config
    lr = (resolve_wsd(cfg, run.run_plan), cfg.optimizer.lr) if cfg.scheduler.name == 'wsd' else None
    plot_run_plan(run.run_plan, os.path.join(run.accounting.out_dir, 'mixture.png'), realized, losses, lr)
