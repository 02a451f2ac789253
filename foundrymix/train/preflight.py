"""What Composer would refuse when a run starts (inside ``Trainer(...)`` or at the first batch, as a
traceback naming no YAML key), refused first by :func:`check_start`, which ``train`` and ``plan`` both
call. Imports neither torch nor composer; the device is asked for only for GPU-only settings.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from foundrymix.config import DURATION_UNITS, INTERVAL_UNITS, UNIT_WORDS, ConfigError, Gather, parse_time
from foundrymix.errors import MissingError
from foundrymix.train import gpu as gpu_settings
from foundrymix.train.remote_resume import incomplete

#: Composer 0.32's precisions (``composer.core.Precision``) and ours (``auto``)
PRECISIONS = ('auto', 'fp32', 'amp_fp16', 'amp_bf16', 'amp_fp8')
#: ``load_path`` schemes foundrymix reads checkpoints from (a path without one is local)
LOAD_SCHEMES = ('s3',)
#: Composer's schedulers that check ``t_warmup`` against ``max_duration`` (``wsd`` is ours)
WARMUP_SCHEDULERS = ('cosine_with_warmup', 'linear_decay_with_warmup', 'constant_with_warmup')


def local_device() -> str:
    """``gpu`` when this machine has a CUDA device (as ``device: auto`` picks), else ``cpu``."""
    import torch
    return 'gpu' if torch.cuda.is_available() else 'cpu'


def composer_duration(run: Any) -> str:
    """The ``max_duration`` Composer is given for a run with stages: its batches, or, when the
    stages' global batches differ, its samples, so that a ``dur`` schedule is a fraction of the
    data rather than of the optimizer steps (docs/stages.md)."""
    return f'{run.total_samples}sp' if run.batch_varies else f'{run.total_batches}ba'


def _composer_unit(unit: str, max_unit: str) -> str:
    """The unit Composer's schedulers compare a time in (``_convert_time``): epochs become
    batches, a fraction of the run takes the run's unit."""
    if unit == 'dur':
        unit = max_unit
    return 'ba' if unit == 'ep' else unit


def composer_warmup(cfg: Any, max_duration: str, run: Any) -> str:
    """``scheduler.t_warmup`` as Composer is to be given it next to ``max_duration``: its warmup
    schedulers refuse, at the first batch, another unit than the run's. Converted where exact (a
    zero warmup, a run in samples); else refused, naming the same point in the run's unit."""
    t_warmup = str(cfg.scheduler.t_warmup)
    warmup = parse_time(t_warmup, 'scheduler.t_warmup', INTERVAL_UNITS)
    value, unit = warmup.value, warmup.unit
    if run.explicit and unit == 'ep':
        raise ConfigError(f'scheduler.t_warmup: {t_warmup} is ambiguous with stages (epochs of which '
                          f'stage?); give it in batches (ba) or as a fraction of the run (e.g. 0.05dur)')
    if cfg.scheduler.name not in WARMUP_SCHEDULERS:
        return t_warmup
    max_unit = parse_time(max_duration, 'max_duration', DURATION_UNITS).unit
    if max_unit == 'sp' and unit in ('ba', 'sp', 'tok', 'dur'):
        return warmup_in_samples(t_warmup, run)
    want = _composer_unit(max_unit, max_unit)
    if _composer_unit(unit, max_unit) == want:
        return t_warmup
    if value == 0:
        return f'0{want}'
    same = ''
    if unit in ('ba', 'sp') and want in ('sp', 'tok') and not run.batch_varies:
        rows = int(value) * (run.stages[0].global_batch_size if unit == 'ba' else 1)
        same = f'{rows * run.max_seq_len if want == "tok" else rows}{want} (the same point) or '
    raise ConfigError(
        f'scheduler.t_warmup: {t_warmup} is in {UNIT_WORDS[unit]}, but this run is counted '
        f'in {UNIT_WORDS[want]} (max_duration {max_duration}) and Composer\'s '
        f'{cfg.scheduler.name} takes t_warmup in that unit: give t_warmup: {same}a fraction of '
        f'the run (e.g. 0.05dur)')


def warmup_in_samples(t_warmup: str, run: Any) -> str:
    """``t_warmup`` for a run Composer counts in samples, where it is the same point: a ``ba`` warmup
    inside the first stage, a ``tok`` warmup of whole rows (Composer's tok: rows x ``max_seq_len``).
    Else refused, naming its value in samples."""
    warmup = parse_time(t_warmup, 'scheduler.t_warmup', INTERVAL_UNITS)
    unit = warmup.unit
    if unit in ('sp', 'dur'):
        return t_warmup
    first, L = run.stages[0], run.max_seq_len
    value = int(warmup.value)
    if unit == 'ba' and value <= first.batches:
        return f'{value * first.global_batch_size}sp'
    if unit == 'tok' and value % L == 0:  # Composer's tok: rows x max_seq_len
        return f'{value // L}sp'
    if unit == 'tok':
        raise ConfigError(
            f'scheduler.t_warmup: {t_warmup} is not whole rows of {L} tokens, and Composer counts '
            f'this run in samples: give t_warmup: {-(-value // L)}sp')
    batch = min(value, run.total_batches)
    stage = run.stage_at(batch) if batch < run.total_batches else run.stages[-1]
    samples = (run.total_samples if batch >= stage.end_batch  # rows trained before batch ``batch``
               else stage.start_sample + (batch - stage.start_batch) * stage.global_batch_size)
    raise ConfigError(
        f'scheduler.t_warmup: {t_warmup} ends after the first stage, and with stages of different '
        f'global_train_batch_size Composer counts the run in samples ({run.total_samples}sp): its '
        f'schedulers take t_warmup in samples only. Batch {batch} of this run is sample {samples}: '
        f'give t_warmup: {samples}sp (the LR then warms up linearly in samples), or a fraction '
        f'of the run ({samples / run.total_samples:.4g}dur)')


def check_start(cfg: Any, run: Any, device: Callable[[], str] = local_device) -> tuple[str, str]:
    """Refuse, one :class:`ConfigError` per key (all at once), what Composer refuses at start (GPU-only
    settings off a GPU, a precision, a ``load_path`` scheme, a ``t_warmup`` unit); return ``max_duration``
    and ``t_warmup`` as Composer is to be given them. ``device()`` is called only when needed."""
    gather = Gather()
    gpu_only, not_cpu = [], []
    if cfg.device_train_microbatch_size == 'auto':
        gpu_only.append('device_train_microbatch_size: auto needs a GPU (Composer fits the microbatch to the '
                        'GPU\'s memory), and this run is on {where}: leave it out (one microbatch per batch) '
                        'or give a whole number that divides the per-rank batch')
    if cfg.fsdp is not None:
        gpu_only.append('fsdp: FSDP runs on GPUs, and this run is on {where}: leave fsdp out')
        if cfg.fsdp.version == 2 and cfg.device_train_microbatch_size == 'auto':
            gather.add(ConfigError("device_train_microbatch_size: auto is not with fsdp.version: 2 (Composer's "
                                   'FSDP2 does not fit the microbatch): give a whole number that divides the '
                                   'per-rank batch'))
        if getattr(cfg.model, 'fused_loss', False) and cfg.fsdp.version != 2:
            gather.add(ConfigError('model.fused_loss: not with FSDP1 (the output layer would run outside '
                                   "FSDP's forward): give fsdp.version: 2 (fully_shard), or leave fused_loss out"))
    if cfg.precision not in PRECISIONS:
        gather.add(ConfigError(f"precision: {cfg.precision!r} is not one of {', '.join(PRECISIONS)} "
                               f"(auto: fp32 on CPU, amp_bf16 on GPU)"))
    elif cfg.precision not in ('auto', 'fp32'):
        not_cpu.append(f'precision: {cfg.precision} needs a GPU, and this run is on {{where}}: give '
                       f'precision: fp32 (or auto: fp32 on CPU, amp_bf16 on GPU)')
    flex = getattr(cfg.model, 'attn_implementation', None) == 'flex_attention'
    if gpu_only or not_cpu or flex:
        resolved = cfg.device if cfg.device != 'auto' else device()
        where = ('the CPU (device: auto, and this machine has no GPU)' if cfg.device == 'auto'
                 else f'device: {cfg.device}')
        if flex and resolved == 'cpu':
            import torch

            from foundrymix.train.flex import trains_on_cpu
            if not trains_on_cpu():
                gather.add(ConfigError(f'model.attn_implementation: flex_attention has no backward on the CPU in '
                                       f'torch {torch.__version__}, and this run is on {where}: give '
                                       f'attn_implementation: sdpa for a CPU run (flex_attention on a GPU)'))
        if cfg.precision == 'amp_fp8':
            problem = gpu_settings.fp8_problem(resolved == 'gpu')
            if problem:
                gather.add(ConfigError(problem))
        for message in gpu_only if resolved != 'gpu' else []:
            gather.add(ConfigError(message.format(where=where)))
        for message in not_cpu if resolved == 'cpu' else []:
            gather.add(ConfigError(message.format(where=where)))
    scheme = cfg.load_path.split('://', 1)[0] if '://' in (cfg.load_path or '') else None
    if scheme is not None and scheme.lower() not in LOAD_SCHEMES:  # the object stores foundrymix reads
        gather.add(ConfigError(f'load_path: {cfg.load_path}: foundrymix loads checkpoints from a local path or '
                               f's3://bucket/key, not {scheme}://; give one of those, or leave load_path out '
                               f'to start from scratch'))
    max_duration, t_warmup = str(cfg.max_duration), str(cfg.scheduler.t_warmup)
    with gather:
        # a single mixture keeps the YAML's; stages and adaptive segments: composer_duration
        adaptive = any(s.config is not None and s.config.adaptive for s in run.stages)
        max_duration = composer_duration(run) if run.explicit or adaptive else str(cfg.max_duration)
        t_warmup = composer_warmup(cfg, max_duration, run)
    gather.raise_any()
    if cfg.load_path and '://' not in cfg.load_path and not os.path.exists(cfg.load_path):
        raise MissingError(f'load_path: {cfg.load_path}: no such checkpoint')
    if cfg.load_path and cfg.load_path.endswith('.pt') and os.path.isfile(cfg.load_path):
        why = incomplete(cfg.load_path)
        if why:
            raise ConfigError(f'load_path: {cfg.load_path} is not a whole checkpoint ({why}): give a '
                              f'checkpoint a run saved whole (ep*-ba*-rank0.pt)')
    return max_duration, t_warmup

