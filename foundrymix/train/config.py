"""The training YAML as typed objects: the data part's :class:`~foundrymix.plan.data_config.DataConfig`
extended with the trainer's keys, each checked (LLM-Foundry silently drops typos). No torch, no composer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, Union

from foundrymix.config import ConfigError, Gather, Interval, read_table
from foundrymix.heap import collector_paused
from foundrymix.plan.data_config import (DataConfig, batch_per_rank, check_data_streams, read_yaml_config,
                                         run_batches)
from foundrymix.train.lr_schedule import Decay, Span, check_stage_names
from foundrymix.train.algorithms import Algorithms
from foundrymix.train.callbacks import CALLBACKS
from foundrymix.train.gpu import CompileSettings, FSDPSettings
from foundrymix.train.loggers import Loggers
from foundrymix.train.model_spec import ModelSpec
from foundrymix.train.weights import check_has_weights, check_pretrained_tokenizer, check_spec_targets


@dataclass
class OptimizerConfig:
    """Composer's ``DecoupledAdamW`` (``decoupled_adamw``), torch's ``AdamW`` (``adamw``) or
    LLM-Foundry's Lion (``decoupled_lionw``, :mod:`foundrymix.train.optim`)."""

    name: Literal['decoupled_adamw', 'adamw', 'decoupled_lionw'] = 'decoupled_adamw'
    lr: float = 1.0e-3
    betas: Optional[tuple[float, float]] = None  # default: (0.9, 0.95); decoupled_lionw: Foundry's (0.9, 0.99)
    eps: float = 1.0e-8  # not used by decoupled_lionw
    weight_decay: float = 0.0
    #: the AdamW kinds on torch's fused kernel (no host sync per tensor); default: on a GPU
    fused: Optional[bool] = None


@dataclass
class SchedulerConfig:
    """LR schedule: Composer's ``cosine_with_warmup``, ``linear_decay_with_warmup`` or
    ``constant_with_warmup`` (``t_warmup``, ``alpha_f``), or ``wsd``: warmup-stable-decay over
    the run's batches (``warmup``, ``decay``; :mod:`foundrymix.train.lr_schedule`)."""

    name: Literal['cosine_with_warmup', 'linear_decay_with_warmup',
                  'constant_with_warmup', 'wsd'] = 'cosine_with_warmup'
    t_warmup: Interval = Interval('0ba')
    alpha_f: float = 0.1
    #: wsd: a duration (``20ba``, ``5%``, ``0.05dur``) or ``{stage: NAME}`` (to that stage's end)
    warmup: Optional[Span] = None
    #: wsd: ``{stage: NAME | duration: ..., to: 0.0, shape: linear|cosine|sqrt}``
    decay: Optional[Decay] = None

    def check(self, where: str) -> None:
        gather = Gather()
        if self.name == 'wsd':
            if self.decay is None:
                gather.add(ConfigError(f'{where}.decay: wsd needs decay: {{stage: NAME}} or '
                                       f'{{duration: 20ba}} (with to: and shape:)'))
            if self.t_warmup != '0ba':
                gather.add(ConfigError(f'{where}.t_warmup: is for the Composer schedulers; wsd takes '
                                       f'warmup: {self.t_warmup}'))
            if self.alpha_f != 0.1:
                gather.add(ConfigError(f'{where}.alpha_f: is for the Composer schedulers; wsd takes '
                                       f'decay.to: {self.alpha_f}'))
        else:
            for key in ('warmup', 'decay'):
                if getattr(self, key) is not None:
                    gather.add(ConfigError(f'{where}.{key}: only name: wsd takes {key} '
                                           f'({self.name} takes t_warmup and alpha_f)'))
        gather.raise_any()


class Callbacks(dict):
    """``callbacks``: YAML name -> that callback's config (the table in :mod:`foundrymix.train.callbacks`)."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'Callbacks':
        return read_table(cls, CALLBACKS, value, where)


@dataclass(kw_only=True)
class TrainConfig(DataConfig):
    """A whole training YAML: the data keys and the trainer's (``variables`` is resolved and dropped)."""

    max_seq_len: int = field()  # required here (field(): the data part's default is None)
    model: ModelSpec
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_train_microbatch_size: Optional[Union[int, Literal['auto']]] = None  # default: the device batch
    device_eval_batch_size: Optional[int] = None
    eval_interval: Interval = Interval('1ep')
    #: evaluate once before the first batch (not when resuming mid-run), as LLM-Foundry's eval_first
    eval_first: bool = False
    eval_subset_num_batches: int = -1
    run_name: str = 'foundrymix'
    #: a local directory or ``s3://bucket/prefix``; ``{run_name}`` in it is replaced when the
    #: YAML is read, so the report beside it and every printed path name the real directory
    save_folder: Optional[str] = None
    save_interval: Interval = Interval('1ep')
    #: local checkpoints kept (-1: all); Composer never deletes checkpoints in a bucket
    save_num_checkpoints_to_keep: int = -1
    save_overwrite: bool = False
    #: resume from the newest complete checkpoint in ``save_folder`` (:mod:`foundrymix.train.remote_resume`)
    autoresume: bool = False
    #: a checkpoint to start from (local path or ``s3://...``); ignored when autoresume finds one
    load_path: Optional[str] = None
    #: take only the model weights from ``load_path`` (Composer's ``load_weights_only``)
    load_weights_only: bool = False
    precision: str = 'auto'
    device: str = 'auto'
    #: Composer FSDP settings (``parallelism_config={'fsdp': ...}``); GPU runs only
    fsdp: Optional[FSDPSettings] = None
    #: ``torch.compile`` of the model (Composer's ``compile_config``); null: not compiled
    compile_config: Optional[CompileSettings] = None
    #: ``None``: on when stdout is a terminal (Composer's bar; the console dump stays at ``log_interval``)
    progress_bar: Optional[bool] = None
    log_interval: Interval = Interval('10ba')
    loggers: Loggers = field(default_factory=Loggers.default)
    callbacks: Callbacks = field(default_factory=Callbacks)
    #: Composer algorithms (``gradient_clipping``; the table in :mod:`foundrymix.train.algorithms`)
    algorithms: Algorithms = field(default_factory=Algorithms)

    def check(self, where: str) -> None:
        if self.save_folder and '{run_name}' in self.save_folder:
            self.save_folder = self.save_folder.replace('{run_name}', self.run_name)
        super().check(where)
        if self.load_weights_only and not self.load_path:
            raise ConfigError('load_weights_only: needs load_path (the checkpoint whose weights to load)')
        if self.load_weights_only and self.model is not None and self.model.peft is not None:
            # a full run's weights (no peft names) stop Composer's strict load with a traceback of missing keys
            raise ConfigError('load_weights_only: a LoRA run (model.peft_config) takes its base from '
                              'model.pretrained: export the checkpoint (foundrymix export CHECKPOINT --to-hf DIR) '
                              'and set model.pretrained: DIR; to go on with a LoRA run, resume it (load_path '
                              'without load_weights_only)')
        if self.scheduler.name == 'wsd':
            stages = self.train_loader.stages
            names = [s.name for s in stages] if stages is not None else ['main']
            check_stage_names([('scheduler.warmup', self.scheduler.warmup),
                               ('scheduler.decay', self.scheduler.decay)],
                              names, stages is not None)


@dataclass(kw_only=True)
class PlanConfig(TrainConfig):
    """A YAML with trainer keys but no ``model`` as ``foundrymix plan`` reads it: ``max_seq_len``
    optional (the streams' rows say it); every other key read and refused as in a training YAML."""

    model: Optional[ModelSpec] = None
    max_seq_len: Optional[int] = None


def split_batch(cfg: TrainConfig, world_size: int) -> tuple[int, Union[int, str]]:
    """(per-rank batch, microbatch) of ``cfg`` on ``world_size`` ranks; refuses a batch the ranks or the
    microbatches cannot split. Pure: ``plan --world-size N`` refuses what ``composer -n N`` would. The
    microbatch must divide every stage's per-rank batch; unset it is the largest of them."""
    rows, used = batch_per_rank(cfg, world_size), run_batches(cfg)
    micro = cfg.device_train_microbatch_size
    if micro is None:  # every batch in one microbatch (a smaller stage's: one shorter one)
        return rows, max(g for _, g in used) // world_size
    for key, g in used:
        if isinstance(micro, int) and (micro <= 0 or (g // world_size) % micro):
            raise ConfigError(f'device_train_microbatch_size={micro} does not divide the per-rank '
                              f'batch ({g // world_size} = {key}{g} / {world_size} ranks)')
    return rows, micro


@collector_paused()  # a large YAML allocates much and frees nothing (foundrymix/heap.py)
def load_config(path: str, overrides: Sequence[str] = ()) -> TrainConfig:
    """A training YAML with ``key=value`` overrides, typed (``train`` and ``plan`` both read a run with
    a model this way, so they refuse alike)."""
    return read_yaml_config(path, overrides, None, TrainConfig.from_dict)


def check_streams(cfg: TrainConfig, max_seq_len: int, tokenizer: Any) -> None:
    """The train streams' rows must be ``max_seq_len`` long, from ``cfg.tokenizer`` (``tokenizer``: theirs)
    and the pretrained model's, and LoRA ``target_modules`` must name layers of the model."""
    check_data_streams(cfg, max_seq_len, tokenizer)
    if cfg.model is not None and cfg.model.pretrained is not None:
        check_has_weights(cfg.model)
        check_pretrained_tokenizer(cfg.model, tokenizer)
    if cfg.model is not None and cfg.model.peft is not None:
        check_spec_targets(cfg.model, tokenizer)
