"""The training YAML as typed objects, read by the one config layer (:mod:`foundrymix.config`).

Why not the raw ``DictConfig``: an unknown or misspelt key must be an error that names it
(LLM-Foundry silently drops typos). Imports neither torch nor composer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from foundrymix.config import (ConfigError, Duration, Gather, Interval, blame, check_keys,
                               load_yaml_overrides, read_dataclass, to_plain)
from foundrymix.heap import collector_paused
from foundrymix.plan.config import LoaderConfig, cache_base
from foundrymix.train.lr_schedule import Decay, Span, check_stage_names
from foundrymix.train.algorithms import Algorithms
from foundrymix.train.callbacks import CALLBACKS, StreamAccountingConfig
from foundrymix.train.gpu import CompileSettings, FSDPSettings
from foundrymix.train.loggers import Loggers
from foundrymix.train.model_spec import ModelSpec

@dataclass
class OptimizerConfig:
    """Composer's ``DecoupledAdamW`` (``decoupled_adamw``), torch's ``AdamW`` (``adamw``) or
    LLM-Foundry's Lion (``decoupled_lionw``, :mod:`foundrymix.train.optim`)."""

    name: Literal['decoupled_adamw', 'adamw', 'decoupled_lionw'] = 'decoupled_adamw'
    lr: float = 1.0e-3
    betas: Optional[tuple[float, float]] = None  # default: (0.9, 0.95); decoupled_lionw: Foundry's (0.9, 0.99)
    eps: float = 1.0e-8  # not used by decoupled_lionw
    weight_decay: float = 0.0


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


def _read_callbacks(value: Any, where: str) -> dict[str, Any]:
    callbacks = to_plain(value, where)
    gather, out = Gather(), {}
    with gather:
        check_keys(callbacks, list(CALLBACKS), where)
    for name, v in callbacks.items():
        if name in CALLBACKS:
            with gather:
                out[name] = read_dataclass(CALLBACKS[name].config, v, f'{where}.{name}')
    gather.raise_any()
    return out


class TokenizerName(str):
    """``tokenizer``: the name the streams were converted with (checked against their
    fingerprint before training)."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'TokenizerName':
        if isinstance(value, Mapping):  # LLM-Foundry: {name: ..., kwargs: {...}}
            name = value.get('name')
            raise ConfigError(f"{where}: LLM-Foundry's {{name: ..., kwargs: ...}} is {where}: "
                              f"{name or 'NAME'} here (kwargs such as model_max_length have no "
                              f"equivalent: max_seq_len and the streams decide)")
        from foundrymix.config import read_value
        return cls(read_value(value, str, where))


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
    max_duration: Optional[Duration] = None
    tokenizer: Optional[TokenizerName] = None
    eval_loader: Optional[LoaderConfig] = None
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
    seed: int = 17
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> 'TrainConfig':
        d = dict(d)
        d.pop('variables', None)
        cfg = read_dataclass(cls, d)
        for loader in (cfg.train_loader, cfg.eval_loader):  # LLM-Foundry token shards read in place
            if cfg.tokenizer and loader is not None and loader.tokenizer is None:
                loader.tokenizer = str(cfg.tokenizer)
        return cfg

    def check(self, where: str) -> None:
        if self.save_folder and '{run_name}' in self.save_folder:
            self.save_folder = self.save_folder.replace('{run_name}', self.run_name)
        if self.global_train_batch_size <= 0:
            raise ConfigError('global_train_batch_size must be positive')
        if self.load_weights_only and not self.load_path:
            raise ConfigError('load_weights_only: needs load_path (the checkpoint whose weights to load)')
        if self.load_weights_only and self.model is not None and self.model.peft is not None:
            # a full run's weights (no peft names) stop Composer's strict load with a traceback of missing keys
            raise ConfigError('load_weights_only: a LoRA run (model.peft_config) takes its base from '
                              'model.pretrained: export the checkpoint (foundrymix export CHECKPOINT --to-hf DIR) '
                              'and set model.pretrained: DIR; to go on with a LoRA run, resume it (load_path '
                              'without load_weights_only)')
        if self.max_duration is None and self.train_loader.stages is None:
            raise ConfigError("config: missing required key 'max_duration' (it may be left out "
                              "only with train_loader.stages: the run is then the sum of the stages)")
        if self.scheduler.name == 'wsd':
            stages = self.train_loader.stages
            names = [s.name for s in stages] if stages is not None else ['main']
            check_stage_names([('scheduler.warmup', self.scheduler.warmup),
                               ('scheduler.decay', self.scheduler.decay and self.scheduler.decay.span)],
                              names, stages is not None)

    @property
    def stream_accounting(self) -> StreamAccountingConfig:
        return self.callbacks.get('stream_accounting') or StreamAccountingConfig()


@dataclass(kw_only=True)
class DataConfig(TrainConfig):
    """A data-only YAML as ``foundrymix plan`` reads it: no ``model``, ``max_seq_len`` optional
    (the streams' rows say it); every other key is read and refused as in a training YAML."""

    model: Optional[ModelSpec] = None
    max_seq_len: Optional[int] = None


def split_batch(cfg: TrainConfig, world_size: int) -> tuple[int, Union[int, str]]:
    """(per-rank batch, microbatch) of ``cfg`` on ``world_size`` ranks; refuses a batch the ranks
    or the microbatches cannot split.

    Pure, so ``foundrymix plan --world-size N`` refuses what ``composer -n N`` would, before
    any rank is launched. The microbatch is one for the whole run: it must divide every
    stage's per-rank batch, and unset it is the largest of them (Composer scales the loss by
    the rows of each batch, so a smaller stage batch is simply one shorter microbatch).
    """
    gbs = cfg.global_train_batch_size
    stages = cfg.train_loader.stages or []
    # every global batch the run trains: the run's (unless every stage sets its own), the stages'
    used = [('', gbs)] if not stages or any(s.global_train_batch_size is None for s in stages) else []
    used += [(f'{s.where}.global_train_batch_size ', s.global_train_batch_size) for s in stages
             if s.global_train_batch_size is not None]
    for key, g in [('', gbs)] + used:
        if g % world_size:
            raise ConfigError(f'{key.strip() or "global_train_batch_size"}={g} is not divisible by '
                              f'the {world_size} ranks')
    device_batch = gbs // world_size
    largest = max(g for _, g in used) // world_size
    micro = cfg.device_train_microbatch_size
    if micro is None:  # every batch in one microbatch (a smaller stage's: one shorter one)
        return device_batch, largest
    for key, g in used:
        if isinstance(micro, int) and (micro <= 0 or (g // world_size) % micro):
            raise ConfigError(f'device_train_microbatch_size={micro} does not divide the per-rank '
                              f'batch ({g // world_size} = {key}{g} / {world_size} ranks)')
    return device_batch, micro


@collector_paused()  # a large YAML allocates much and frees nothing (foundrymix/heap.py)
def load_config(path: str, overrides: Sequence[str] = (), max_duration: Optional[str] = None,
                data_only: bool = False) -> TrainConfig:
    """Load a YAML, apply ``key=value`` overrides, resolve interpolations, type it.

    ``train`` and ``plan`` both read a run this way, so they refuse alike. ``max_duration``
    replaces the YAML's; with ``data_only`` a YAML without ``model`` is a :class:`DataConfig`.
    """
    data, applied = load_yaml_overrides(path, overrides)
    if max_duration is not None:
        data['max_duration'] = max_duration
    cls = DataConfig if data_only and 'model' not in data else TrainConfig
    try:
        return cls.from_dict(data)
    except ConfigError as e:  # every problem, each blamed on its override or on the file
        raise blame(e, path, applied, data) from None


def check_streams(cfg: TrainConfig, max_seq_len: int, tokenizer: Any) -> None:
    """The train streams' rows must be ``max_seq_len`` long, from ``cfg.tokenizer`` (and the
    pretrained model's), and LoRA ``target_modules`` must name layers of the model; ``train``
    and ``plan`` refuse alike. ``tokenizer`` is the streams' ``TokenizerInfo``."""
    check_data_streams(cfg, max_seq_len, tokenizer)
    if cfg.model is not None and cfg.model.pretrained is not None:
        from foundrymix.train.weights import check_has_weights, check_pretrained_tokenizer
        check_has_weights(cfg.model)
        check_pretrained_tokenizer(cfg.model, tokenizer)
    if cfg.model is not None and cfg.model.peft is not None:
        from foundrymix.train.lora import check_spec_targets
        check_spec_targets(cfg.model, tokenizer)


def check_eval_streams(cfg: TrainConfig, max_seq_len: int, tokenizer: Any) -> Any:
    """The ``eval_loader``'s :class:`~foundrymix.loader.mixer.StreamMixer`, checked to hold rows
    like the train streams' (``max_seq_len``, ``tokenizer``)."""
    from foundrymix.loader.mixer import StreamMixer

    eval_mixer = StreamMixer(cfg.eval_loader, 'eval_loader')
    eval_mixer.validate()
    if eval_mixer.max_seq_len != max_seq_len or eval_mixer.tokenizer.fingerprint != tokenizer.fingerprint:
        raise ConfigError(f'eval_loader.streams: rows of max_seq_len {eval_mixer.max_seq_len} from tokenizer '
                          f'{eval_mixer.tokenizer.name}, but the train streams\' are {max_seq_len} from '
                          f'{tokenizer.name}: evaluate on data converted like the training data')
    return eval_mixer


def check_data_streams(cfg: TrainConfig, max_seq_len: int, tokenizer: Any) -> None:
    """What :func:`check_streams` checks without the model: ``max_seq_len`` and ``tokenizer``
    against the streams (imports neither torch nor composer, for a loader used alone)."""
    if cfg.max_seq_len is not None:  # a data-only YAML may leave it to the streams
        check_seq_len(cfg, max_seq_len)
    if cfg.tokenizer is not None:
        from foundrymix.tokenizer import describe_tokenizer
        memo = os.path.join(cache_base(cfg.train_loader.cache_root), 'tokenizers')
        have = describe_tokenizer(cfg.tokenizer, memo)
        if have.fingerprint != tokenizer.fingerprint:
            from foundrymix.format.schema import changed_tokenizer_note, tokenizer_differences
            raise ConfigError(f'tokenizer {cfg.tokenizer!r} differs from the one the streams were '
                              f'converted with ({tokenizer.name}): {tokenizer_differences(have, tokenizer)} '
                              f"(this one vs the streams'){changed_tokenizer_note(cfg.tokenizer, tokenizer)}")


def check_seq_len(cfg: TrainConfig, stream_seq_len: int) -> None:
    """The train streams' rows must be ``max_seq_len`` long (``train`` and ``plan`` refuse alike)."""
    if stream_seq_len != cfg.max_seq_len:
        raise ConfigError(f'max_seq_len={cfg.max_seq_len}, but the train streams hold rows of '
                          f'{stream_seq_len} tokens')
